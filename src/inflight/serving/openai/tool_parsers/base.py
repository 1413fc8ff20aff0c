"""What every tool-call parser shares: the call it reads, the constraint it writes, and the streaming split
between content (sent as it comes) and a call (held from its opening text to the end of the output)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Consecutive whitespace a constrained call's JSON may hold: a small model sampling at temperature 1 can
# otherwise spend its tokens on indentation.
MAX_JSON_WHITESPACE = 4


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """`message.tool_calls[i]`, or a streamed delta's entry when `index` is given."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema; a function without one takes any object."""
    return parameters if parameters else {"type": "object"}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


class ToolParser:
    """One model family's tool-call format. `trigger` is the text that opens a call."""

    name: ClassVar[str]
    trigger: ClassVar[str]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output: the text before the first call (None when blank), and the calls.
        Text whose calls do not parse is all content, with no calls (as vLLM's parsers answer it)."""
        raise NotImplementedError

    # A call as text: call_begin(name), the arguments (JSON), call_end.
    call_end: ClassVar[str]

    def call_begin(self, name: str) -> str:
        raise NotImplementedError

    def structural_tag(self, tools: list[Any], parallel: bool) -> dict[str, Any]:
        """xgrammar's structural tag: free text until `trigger`, then one of `tools`' calls, its arguments
        constrained by the function's schema (`parallel`: more calls may follow)."""
        tags = [
            {
                "type": "tag",
                "begin": self.call_begin(t.function.name),
                "content": json_content(arguments_schema(t.function.parameters)),
                "end": self.call_end,
            }
            for t in tools
        ]
        return {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                       "stop_after_first": not parallel},
        }  # fmt: skip


class ToolCallStream:
    """A streamed output's split: content goes out as it comes, except a tail that may be the start of the
    trigger; from the trigger on, the text is held and read with `extract` at the end. The content and calls
    so sent equal what `extract` gives for the whole text."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # text[:sent] went out as content
        self.in_call = False

    def feed(self, delta: str) -> str:
        """The content to send now."""
        self.text += delta
        if self.in_call:
            return ""
        trigger = self.parser.trigger
        start = self.text.find(trigger, max(0, self.sent - len(trigger)))
        if start >= 0:
            self.in_call = True
            end = max(start, self.sent)
        else:  # hold back the longest tail that could begin the trigger
            end = len(self.text)
            for n in range(min(len(trigger) - 1, len(self.text) - self.sent), 0, -1):
                if trigger.startswith(self.text[-n:]):
                    end -= n
                    break
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the content and the calls, once the output is complete. The content sent before the
        trigger is what `extract` gives as content; a call that does not parse goes out as content."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        if self.in_call:
            _, calls = self.parser.extract(self.text)
            if calls:
                return "", calls
        return rest, []


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
