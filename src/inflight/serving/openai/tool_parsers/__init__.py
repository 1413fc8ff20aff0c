"""Tool-call parsers, chosen with `--tool-call-parser` (vLLM's names): how a model writes a tool call in its
text, read back into OpenAI's `tool_calls`, and the structural tag that constrains a call once the model
opens one, so that an `auto` tool call always parses."""

from __future__ import annotations

from inflight.serving.openai.tool_parsers.base import ToolCall, ToolCallStream, ToolParser
from inflight.serving.openai.tool_parsers.hermes import HermesToolParser
from inflight.serving.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """The parser `name`; ValueError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser"]
