"""Tool calling on `/v1/chat/completions`, the request's side: the tools into the prompt, the output constraint
for each `tool_choice`, and the output read back into `tool_calls`.

- `required` and a named function: the output is JSON constrained by the tools' schemas (structured outputs),
  so the arguments always parse and validate: a list of {"name", "arguments"} for `required`, the function's
  arguments for a named one. No parser is needed.
- `auto`: the `--tool-call-parser`'s format; free text until the model opens a call, then the call constrained
  by the tools' schemas (a structural tag), so an opened call always parses.
- `none`: the tools reach the template, and the output is text.

A chat template that reads `tools` gets them as HF's `apply_chat_template(tools=...)` passes them. One that
ignores them (SmolLM2's, for one) gets them in a system message in the Hermes format (Qwen 2.5's wording), and
the history's assistant `tool_calls` and `tool` messages in the same format (`<tool_call>`, `<tool_response>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inflight.serving.openai.protocol import ChatCompletionRequest, NamedToolChoice, RequestError
from inflight.serving.openai.tool_parsers import ToolCall, ToolCallStream, ToolParser
from inflight.serving.openai.tool_parsers.base import arguments_schema, new_call_id

_SYSTEM_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ToolUse:
    """How one request's output is read: `mode` none | auto | required | named (`name`)."""

    mode: str
    name: str | None = None
    parser: ToolParser | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser | None) -> ToolUse:
        choice = body.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            return cls("named", choice.function.name)
        if choice == "auto" and body.tools:
            if parser is None:
                raise RequestError(
                    'tool_choice "auto" needs a tool call parser: start the server with --tool-call-parser '
                    '(hermes or llama3_json), or send tool_choice "required" or a named function',
                    "tool_choice",
                )
            return cls("auto", parser=parser)
        return cls(choice if body.tools else "none")

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self, body: ChatCompletionRequest) -> dict[str, Any] | None:
        """The output constraint of this mode (None: the text is free)."""
        tools = body.tools or []
        if self.mode == "named":
            tool = next(t for t in tools if t.function.name == self.name)
            return {"json": arguments_schema(tool.function.parameters), "disable_any_whitespace": True}
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"enum": [t.function.name]},
                        "arguments": arguments_schema(t.function.parameters),
                    },
                    "required": ["name", "arguments"],
                }  # fmt: skip
                for t in tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not body.parallel_tool_calls:
                schema["maxItems"] = 1
            return {"json": schema, "disable_any_whitespace": True}
        if self.mode == "auto":
            assert self.parser is not None
            return {"structural_tag": self.parser.structural_tag(tools, body.parallel_tool_calls)}
        return None

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output."""
        if self.mode == "named":
            return None, [ToolCall(self.name or "", text)]
        if self.mode == "required":
            items = _complete_items(text)
            if not items:
                return text, []  # cut short by max_tokens before a call was whole
            return None, [ToolCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items]
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.extract(text)
        return text, []


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The whole items of a JSON list of calls, the list itself possibly cut short (max_tokens): the constraint
    made every item it finished valid."""
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    items = []
    while 0 < pos < len(text):
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(item)
        while pos < len(text) and text[pos] in ", \n":
            pos += 1
    return [i for i in items if isinstance(i, dict) and "name" in i and "arguments" in i]


def _arguments_object(arguments: Any) -> Any:
    """A history call's arguments as HF templates take them: an object (OpenAI sends its JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def template_messages(
    messages: list[dict[str, Any]], body: ChatCompletionRequest, template_reads_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (and extra template variables) a template renders: tools and tool history as the template
    takes them, or in the Hermes format where it ignores them."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if template_reads_tools:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = m | {"tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            lines = [m.get("content") or ""]
            for c in m["tool_calls"]:
                f = c.get("function", {})
                call = {"name": f.get("name"), "arguments": _arguments_object(f.get("arguments", {}))}
                lines.append(f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>")
            m = {"role": "assistant", "content": "\n".join(x for x in lines if x)}
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = _SYSTEM_TOOLS.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = out[0] | {"content": f"{out[0].get('content', '')}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    return call | {"function": function | {"arguments": _arguments_object(function.get("arguments"))}}


class ToolOutputStream:
    """A streamed output in OpenAI's delta shape: content as it comes; a named function's arguments as they
    come (the first delta carries its id and name); `required`'s calls and `auto`'s opened calls whole, at the
    end. Their deltas assemble to what `ToolUse.read` gives for the whole text."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.calls: list[ToolCall] = []
        self._split = ToolCallStream(use.parser) if use.mode == "auto" and use.parser else None
        self._named_id = new_call_id()

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool call deltas) to send now."""
        first = not self.text
        self.text += delta
        if self.use.mode == "named":
            if final:
                self.calls = [ToolCall(self.use.name or "", self.text, self._named_id)]
            if first:
                call = ToolCall(self.use.name or "", delta, self._named_id)
                return "", [call.to_openai(0)]
            return "", ([{"index": 0, "function": {"arguments": delta}}] if delta else [])
        if self.use.mode == "required":
            if not final:
                return "", []
            content, self.calls = self.use.read(self.text)
            return content or "", [c.to_openai(i) for i, c in enumerate(self.calls)]
        if self._split is None:
            return delta, []
        content = self._split.feed(delta)
        if final:
            rest, self.calls = self._split.finish()
            content += rest
        return content, [c.to_openai(i) for i, c in enumerate(self.calls)]
