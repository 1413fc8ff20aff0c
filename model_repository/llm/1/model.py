"""Triton's entry point for the `llm` model: the logic lives in the installed `inflight` package."""

from inflight.serving.triton_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
