"""Structured outputs through xgrammar: the manager (per request), the compile pool, the step's bitmask."""

from inflight.engine.structured_output.compile_pool import GrammarCompileError
from inflight.engine.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarCompileError", "StructuredOutputManager"]
