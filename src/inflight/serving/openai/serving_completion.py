"""`POST /v1/completions`: a prompt (text or token ids) or a list of them, each sent as it is, a choice per prompt
and per `n` (vLLM's numbering); `echo` repeats the prompt before the output."""

from __future__ import annotations

from typing import Any

from inflight.serving.openai import logprobs as lp
from inflight.serving.openai.protocol import CompletionRequest, RequestError
from inflight.serving.openai.serving_engine import Choice, OpenAIServing, ServeContext


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    async def prepare(self, ctx: ServeContext) -> None:
        body: CompletionRequest = ctx.body
        ctx.prompts = body.check()
        renderer = await self.model.renderer()  # reads max_prompt_bytes (once)
        for prompt in ctx.prompts:
            if isinstance(prompt, str):
                self.model.check_prompt_size(prompt)
        if body.echo:
            ctx.echoes = [p if isinstance(p, str) else self._decode(renderer, p) for p in ctx.prompts]
        ctx.top_logprobs = body.logprobs
        ctx.sampling = body.sampling_parameters(body.max_tokens, ctx.top_logprobs)

    @staticmethod
    def _decode(renderer, ids: list[int]) -> str:
        if renderer.tokenizer is None:
            raise RequestError("echo of a token-id prompt needs the model's tokenizer, which this front lacks", "echo")
        return renderer.tokenizer.decode(ids, skip_special_tokens=False)

    def logprobs(self, ctx: ServeContext, entries: list[dict], offset: int) -> dict:
        return lp.completion_logprobs(entries, ctx.top_logprobs, offset)

    def choice(self, ctx: ServeContext, ch: Choice, text: str) -> dict[str, Any]:
        return {"text": ch.echo + text}

    def delta(self, ctx: ServeContext, ch: Choice, text: str, final: bool) -> dict[str, Any] | None:
        return {"text": text}

    def opening_choice(self, ctx: ServeContext, ch: Choice) -> dict[str, Any] | None:
        return {"text": ch.echo} if ch.echo else None
