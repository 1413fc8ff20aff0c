"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
several separated by `; `."""

from __future__ import annotations

import json

from inflight.serving.openai.tool_parsers.base import ToolCall, ToolParser, dumps

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    call_end = "}"
    trigger = '{"name": '

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        content = text[:start].replace(_PYTHON_TAG, "")
        decoder = json.JSONDecoder()
        calls, pos = [], start
        while pos < len(text):
            try:
                call, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            arguments = call.get("parameters", call.get("arguments", {}))
            calls.append(ToolCall(call["name"], dumps(arguments)))
            rest = text[end:].lstrip()
            if not rest.startswith(";"):
                if rest:  # text after the calls: not this format
                    return text, []
                break
            pos = len(text) - len(rest[1:].lstrip())
        return (content if content.strip() else None), calls

    def call_begin(self, name: str) -> str:
        return f'{{"name": {dumps(name)}, "parameters": '
