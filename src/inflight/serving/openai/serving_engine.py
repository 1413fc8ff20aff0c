"""What both endpoints share: a request's path from body to response (one JSON answer or Server-Sent Events),
error mapping, and cancellation when the client goes away. serving_chat.py and serving_completion.py fill
in the prompt and the shapes of their responses.

A streamed request waits for the model's first response before answering, so a request the model rejects
still gets a proper 400 rather than an event. When the client goes away (during the stream or while a
non-streamed request is running), the Triton request is cancelled and the engine frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.serving.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestError, openai_param
from inflight.serving.openai.served_model import ServedModel
from inflight.serving.openai.triton_stream import ModelError, ModelOutput, TritonTimeout, TritonUnavailable

T = TypeVar("T")
_JSON_SEPARATORS = (",", ":")


_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
                503: "service_unavailable", 504: "timeout"}  # fmt: skip


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


class ClientDisconnected(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its Triton request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=_JSON_SEPARATORS)}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ServeContext:
    """One request on its way through an endpoint."""

    body: CompletionRequest | ChatCompletionRequest
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    prompt: str = ""
    echo: str = ""  # prompt text the response repeats before the output (completions' `echo`)
    top_logprobs: int | None = None  # None: no logprobs asked for
    sampling: dict[str, Any] = field(default_factory=dict)
    lora_name: str | None = None  # the LoRA adapter `model` names (None: the base model)
    tool_use: Any = None  # chat: how the output is read for tool calls (tools.ToolUse)
    tool_stream: Any = None  # chat, streamed: the output's split into content and tool calls (tools.ToolOutputStream)
    tool_calls: list = field(default_factory=list)  # chat: the calls the output made (once it is complete)


class OpenAIServing:
    """One endpoint over the served model; subclasses say how a body becomes a prompt and what a choice is."""

    request_id_prefix: ClassVar[str]
    object_name: ClassVar[str]  # of the JSON response
    chunk_object_name: ClassVar[str]  # of each streamed chunk

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    # ---- what each endpoint fills in ------------------------------------------------------------------

    async def prepare(self, ctx: ServeContext) -> None:
        """Check the body and set the context's prompt, sampling parameters and logprobs."""
        raise NotImplementedError

    def logprobs(self, ctx: ServeContext, entries: list[dict], offset: int) -> dict:
        raise NotImplementedError

    def choice(self, ctx: ServeContext, text: str) -> dict[str, Any]:
        """The output of a non-streamed response (logprobs and finish_reason are added after it)."""
        raise NotImplementedError

    def delta(self, ctx: ServeContext, text: str, final: bool) -> dict[str, Any] | None:
        """The new output of one streamed chunk (None: nothing to send yet; never None when `final`)."""
        raise NotImplementedError

    def finish_reason(self, ctx: ServeContext, reason: str | None) -> str | None:
        """The choice's finish_reason, from the model's."""
        return reason

    def opening_choice(self, ctx: ServeContext) -> dict[str, Any] | None:
        """What a stream says before the model's first text, if anything."""
        return None

    # ---- the shared path ----------------------------------------------------------------------------

    async def create(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        ctx = ServeContext(body, self.request_id_prefix + uuid.uuid4().hex)
        try:
            ctx.lora_name = await self.model.resolve_model(body.model)
            await self.prepare(ctx)
            if ctx.lora_name is not None:
                ctx.sampling["lora_name"] = ctx.lora_name  # Triton's vLLM backend names the adapter here
            if not body.stream:
                return JSONResponse(await until_disconnected(request, self._collect(ctx)))
            outputs = self._outputs(ctx, stream=True)
            try:
                first = await until_disconnected(request, anext(outputs))
            except BaseException:
                await outputs.aclose()
                raise
            return StreamingResponse(
                self._events(ctx, first, outputs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        except (RequestError, ModelError, TritonUnavailable) as e:
            return self._error(ctx, e)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the Triton request is already cancelled

    def _outputs(self, ctx: ServeContext, stream: bool) -> AsyncIterator[ModelOutput]:
        return self.model.llm.generate(
            ctx.prompt, ctx.sampling, stream=stream, logprobs=ctx.top_logprobs is not None, request_id=ctx.request_id
        )

    def _error(self, ctx: ServeContext, e: Exception) -> JSONResponse:
        if isinstance(e, RequestError):
            return error_response(e.status, e.message, e.param, e.code)
        if isinstance(e, ModelError):
            if not e.kind.is_users:
                return error_response(500, e.message)
            if e.field == "lora_name":  # the adapter `model` named is gone (unloaded since it was listed)
                self.model.forget_adapters()
                return error_response(404, e.message, "model", "model_not_found")
            return error_response(400, e.message, openai_param(e.field, ctx.body))
        if isinstance(e, TritonTimeout):
            return error_response(504, str(e), code="timeout")
        if isinstance(e, TritonUnavailable):
            return error_response(503, str(e), code="service_unavailable")
        raise e

    def _logprobs_of(self, ctx: ServeContext, entries: list[dict] | None, offset: int) -> dict | None:
        if ctx.top_logprobs is None or entries is None:
            return None
        return self.logprobs(ctx, entries, offset)

    async def _collect(self, ctx: ServeContext) -> dict:
        """One JSON response."""
        texts, entries = [], []
        prompt_tokens = completion_tokens = 0
        finish_reason = None
        async for out in self._outputs(ctx, stream=False):
            texts.append(out.text)
            entries += out.logprobs or []
            prompt_tokens = out.num_input_tokens or prompt_tokens
            completion_tokens += out.num_output_tokens
            finish_reason = out.finish_reason or finish_reason
        choice = {"index": 0, **self.choice(ctx, "".join(texts))}
        choice["logprobs"] = self._logprobs_of(ctx, entries, len(ctx.echo))
        choice["finish_reason"] = self.finish_reason(ctx, finish_reason)
        return {
            "id": ctx.request_id,
            "object": self.object_name,
            "created": ctx.created,
            "model": ctx.body.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _chunk(self, ctx: ServeContext, choices: list[dict], usage: dict | None, include_usage: bool) -> bytes:
        chunk = {
            "id": ctx.request_id,
            "object": self.chunk_object_name,
            "created": ctx.created,
            "model": ctx.body.model,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage
        return sse(chunk)

    async def _events(
        self, ctx: ServeContext, first: ModelOutput, rest: AsyncIterator[ModelOutput]
    ) -> AsyncIterator[bytes]:
        """Server-Sent Events ending in `data: [DONE]`."""
        options = ctx.body.stream_options
        include_usage = options is not None and options.include_usage
        every_chunk = include_usage and options.continuous_usage_stats  # vLLM's: cumulative usage on each chunk
        prompt_tokens = completion_tokens = 0
        offset = len(ctx.echo)
        try:
            opening = self.opening_choice(ctx)
            if opening is not None:
                choice = {"index": 0, **opening, "logprobs": None, "finish_reason": None}
                yield self._chunk(ctx, [choice], None, include_usage)
            out: ModelOutput | None = first
            while out is not None:
                prompt_tokens = out.num_input_tokens or prompt_tokens
                completion_tokens += out.num_output_tokens
                piece = self.delta(ctx, out.text, out.final) if out.text or out.final else None
                if piece is not None:
                    choice = {
                        "index": 0,
                        **piece,
                        "logprobs": self._logprobs_of(ctx, out.logprobs, offset),
                        "finish_reason": self.finish_reason(ctx, out.finish_reason) if out.final else None,
                    }
                    running = usage(prompt_tokens, completion_tokens) if every_chunk else None
                    yield self._chunk(ctx, [choice], running, include_usage)
                offset += len(out.text)
                out = None if out.final else await anext(rest, None)
            if include_usage:
                yield self._chunk(ctx, [], usage(prompt_tokens, completion_tokens), include_usage)
        except (ModelError, TritonUnavailable) as e:  # after the 200: the error goes out as an event
            yield sse(json.loads(self._error(ctx, e).body))
        finally:
            await rest.aclose()  # cancels the Triton request if the client left early
        yield b"data: [DONE]\n\n"
