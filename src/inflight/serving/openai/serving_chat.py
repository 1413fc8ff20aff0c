"""`POST /v1/chat/completions`: messages rendered with the served model's chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from inflight.serving.openai import logprobs as lp
from inflight.serving.openai.chat_template import ChatTemplateError
from inflight.serving.openai.protocol import ChatCompletionRequest, RequestError
from inflight.serving.openai.renderer import PromptRenderer
from inflight.serving.openai.serving_engine import OpenAIServing, ServeContext


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
        messages = [m.for_template() for m in body.messages]
        extra = body.chat_template_kwargs or {}
        self.model.check_chat_size(messages, extra)
        max_tokens = body.requested_max_tokens
        # Templating and tokenizing take time in the prompt's length: off the event loop, so that other
        # clients' streams go on meanwhile.
        ctx.prompt, num_tokens = await asyncio.to_thread(
            _render, renderer, messages, body.add_generation_prompt, extra, max_tokens is None
        )
        if max_tokens is None:
            max_tokens = self.model.default_max_tokens(num_tokens)
        ctx.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        ctx.sampling = body.sampling_parameters(max_tokens, ctx.top_logprobs)

    def logprobs(self, ctx: ServeContext, entries: list[dict], offset: int) -> dict:
        return lp.chat_logprobs(entries, ctx.top_logprobs)

    def choice(self, ctx: ServeContext, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def delta(self, ctx: ServeContext, text: str) -> dict[str, Any]:
        return {"delta": {"content": text} if text else {}}

    def opening_choice(self, ctx: ServeContext) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": ""}}  # the role first, as OpenAI does
