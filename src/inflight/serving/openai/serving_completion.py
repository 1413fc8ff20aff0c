"""`POST /v1/completions`: one text prompt, sent as it is; `echo` repeats it before the output."""

from __future__ import annotations

from typing import Any

from inflight.serving.openai import logprobs as lp
from inflight.serving.openai.protocol import CompletionRequest
from inflight.serving.openai.serving_engine import OpenAIServing, ServeContext


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    async def prepare(self, ctx: ServeContext) -> None:
        body: CompletionRequest = ctx.body
        ctx.prompt = body.check()
        await self.model.renderer()  # reads max_prompt_bytes (once)
        self.model.check_prompt_size(ctx.prompt)
        ctx.echo = ctx.prompt if body.echo else ""
        ctx.top_logprobs = body.logprobs
        ctx.sampling = body.sampling_parameters(body.max_tokens, ctx.top_logprobs)

    def logprobs(self, ctx: ServeContext, entries: list[dict], offset: int) -> dict:
        return lp.completion_logprobs(entries, ctx.top_logprobs, offset)

    def choice(self, ctx: ServeContext, text: str) -> dict[str, Any]:
        return {"text": ctx.echo + text}

    def delta(self, ctx: ServeContext, text: str, final: bool) -> dict[str, Any] | None:
        return {"text": text}

    def opening_choice(self, ctx: ServeContext) -> dict[str, Any] | None:
        return {"text": ctx.echo} if ctx.echo else None
