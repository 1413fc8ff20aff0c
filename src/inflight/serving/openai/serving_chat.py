"""`POST /v1/chat/completions`: messages rendered with the served model's chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from inflight.serving.openai import logprobs as lp
from inflight.serving.openai.chat_template import ChatTemplateError
from inflight.serving.openai.protocol import ChatCompletionRequest, RequestError
from inflight.serving.openai.renderer import PromptRenderer
from inflight.serving.openai.serving_engine import Choice, OpenAIServing, ServeContext
from inflight.serving.openai.tools import ToolOutputStream, ToolUse, template_messages


def _render(
    renderer: PromptRenderer, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict, count: bool
) -> tuple[str, int | None]:
    """The chat prompt and (if `count`) its number of tokens."""
    try:
        prompt = renderer.chat_prompt(messages, add_generation_prompt, **extra)
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from None
    return prompt, renderer.num_tokens(prompt) if count else None


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    async def prepare(self, ctx: ServeContext) -> None:
        body: ChatCompletionRequest = ctx.body
        body.check()
        renderer = await self.model.renderer()
        ctx.tool_use = ToolUse.of(body, self.model.tool_parser)
        reads_tools = renderer.template is not None and "tools" in renderer.template.source
        messages, tool_vars = template_messages([m.for_template() for m in body.messages], body, reads_tools)
        extra = (body.chat_template_kwargs or {}) | tool_vars
        self.model.check_chat_size(messages, extra)
        max_tokens = body.requested_max_tokens
        # Templating and tokenizing take time in the prompt's length: off the event loop, so that other
        # clients' streams go on meanwhile.
        prompt, num_tokens = await asyncio.to_thread(
            _render, renderer, messages, body.add_generation_prompt, extra, max_tokens is None
        )
        ctx.prompts = [prompt]
        if max_tokens is None:
            max_tokens = self.model.default_max_tokens(num_tokens)
        ctx.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        ctx.sampling = body.sampling_parameters(max_tokens, ctx.top_logprobs)
        constraint = ctx.tool_use.structured_outputs(body)
        if constraint is not None:
            ctx.sampling["structured_outputs"] = constraint

    def new_choice(self, ctx: ServeContext, ch: Choice, stream: bool) -> None:
        if stream and ctx.tool_use.calls_tools:
            ch.tool_stream = ToolOutputStream(ctx.tool_use)

    def logprobs(self, ctx: ServeContext, entries: list[dict], offset: int) -> dict:
        return lp.chat_logprobs(entries, ctx.top_logprobs)

    def choice(self, ctx: ServeContext, ch: Choice, text: str) -> dict[str, Any]:
        content, calls = ctx.tool_use.read(text) if ctx.tool_use is not None else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            ch.tool_calls = calls
        return {"message": message}

    def delta(self, ctx: ServeContext, ch: Choice, text: str, final: bool) -> dict[str, Any] | None:
        if ch.tool_stream is None:
            return {"delta": {"content": text} if text else {}}
        content, calls = ch.tool_stream.feed(text, final)
        ch.tool_calls = ch.tool_stream.calls
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return {"delta": delta} if delta or final else None

    def finish_reason(self, ctx: ServeContext, ch: Choice, reason: str | None) -> str | None:
        """The model's "stop" is "tool_calls" where it called tools (OpenAI's rule: not for a named function)."""
        if ch.tool_calls and reason == "stop" and ctx.tool_use.mode != "named":
            return "tool_calls"
        return reason

    def opening_choice(self, ctx: ServeContext, ch: Choice) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": ""}}  # the role first, as OpenAI does
