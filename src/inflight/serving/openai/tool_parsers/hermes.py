"""Hermes / Qwen 2.5 tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one per call."""

from __future__ import annotations

import json
import re

from inflight.serving.openai.tool_parsers.base import ToolCall, ToolParser, dumps

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    call_end = "}\n</tool_call>"
    trigger = "<tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        calls = []
        for match in _CALL.finditer(text, start):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            try:
                call = json.loads(body)
            except json.JSONDecodeError:
                call = None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                if match.group(2) is not None and calls:
                    break  # a last call cut short (max_tokens) after whole ones: the whole ones stand
                return text, []
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ToolCall(call["name"], dumps(arguments)))
        content = text[:start]
        return (content if content.strip() else None), calls

    def call_begin(self, name: str) -> str:
        return f'<tool_call>\n{{"name": {dumps(name)}, "arguments": '
