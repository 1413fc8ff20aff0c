"""What both endpoints share: a request's path from body to response (one JSON answer or Server-Sent Events),
error mapping, and cancellation when the client goes away. serving_chat.py and serving_completion.py fill
in the prompt and the shapes of their responses. A request is one Triton request per choice (a prompt of a
completions batch times `n`); a prompt's later samples start once its first has a token, so that they find its
KV blocks in the prefix cache.

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
from inflight.serving.openai.tool_parsers import ToolCall
from inflight.serving.openai.tools import ToolOutputStream, ToolUse
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
class Choice:
    """One sequence of a request: its prompt and sampling, and (chat) how its output is read for tool calls.
    A request has one per prompt and per `n`: `index` = prompt * n + sample, as vLLM numbers them."""

    index: int
    prompt_index: int
    prompt: str | list[int]
    sampling: dict[str, Any]
    echo: str = ""  # prompt text the choice repeats before its output (completions' `echo`)
    counts_prompt: bool = True  # its prompt's tokens count in `usage` (once per prompt, not per sample)
    tool_stream: ToolOutputStream | None = None  # chat, streamed: the output's split into content and tool calls
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat: the calls the output made (once complete)


@dataclass
class ServeContext:
    """One request on its way through an endpoint."""

    body: CompletionRequest | ChatCompletionRequest
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    prompts: list[str | list[int]] = field(default_factory=list)  # one per prompt (completions take a batch)
    echoes: list[str] = field(default_factory=list)  # per prompt: what its choices repeat before the output
    top_logprobs: int | None = None  # None: no logprobs asked for
    sampling: dict[str, Any] = field(default_factory=dict)
    lora_name: str | None = None  # the LoRA adapter `model` names (None: the base model)
    tool_use: ToolUse | None = None  # chat: how the output is read for tool calls
    choices: list[Choice] = field(default_factory=list)

    def fan_out(self) -> None:
        """A choice per prompt and per `n`. With a seed, sample j of a prompt takes seed + j (vLLM's rule for
        its child requests), so each choice equals a single request with that seed."""
        n = self.body.n
        seed = self.sampling.get("seed")
        for i, prompt in enumerate(self.prompts):
            for j in range(n):
                sampling = self.sampling | ({"seed": seed + j} if seed is not None and j else {})
                echo = self.echoes[i] if self.echoes else ""
                self.choices.append(Choice(i * n + j, i, prompt, sampling, echo, counts_prompt=j == 0))


class OpenAIServing:
    """One endpoint over the served model; subclasses say how a body becomes a prompt and what a choice is."""

    request_id_prefix: ClassVar[str]
    object_name: ClassVar[str]  # of the JSON response
    chunk_object_name: ClassVar[str]  # of each streamed chunk

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    # ---- what each endpoint fills in ------------------------------------------------------------------

    async def prepare(self, ctx: ServeContext) -> None:
        """Check the body and set the context's prompts, sampling parameters and logprobs."""
        raise NotImplementedError

    def new_choice(self, ctx: ServeContext, ch: Choice, stream: bool) -> None:
        """Per-choice state, before its output comes."""

    def logprobs(self, ctx: ServeContext, entries: list[dict], offset: int) -> dict:
        raise NotImplementedError

    def choice(self, ctx: ServeContext, ch: Choice, text: str) -> dict[str, Any]:
        """The output of a non-streamed choice (logprobs and finish_reason are added after it)."""
        raise NotImplementedError

    def delta(self, ctx: ServeContext, ch: Choice, text: str, final: bool) -> dict[str, Any] | None:
        """The new output of one streamed chunk (None: nothing to send yet; never None when `final`)."""
        raise NotImplementedError

    def finish_reason(self, ctx: ServeContext, ch: Choice, reason: str | None) -> str | None:
        """The choice's finish_reason, from the model's."""
        return reason

    def opening_choice(self, ctx: ServeContext, ch: Choice) -> dict[str, Any] | None:
        """What a stream says for a choice before the model's first text, if anything."""
        return None

    # ---- the shared path ----------------------------------------------------------------------------

    async def create(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        ctx = ServeContext(body, self.request_id_prefix + uuid.uuid4().hex)
        try:
            ctx.lora_name = await self.model.resolve_model(body.model)
            await self.prepare(ctx)
            if ctx.lora_name is not None:
                ctx.sampling["lora_name"] = ctx.lora_name  # Triton's vLLM backend names the adapter here
            ctx.fan_out()
            for ch in ctx.choices:
                self.new_choice(ctx, ch, body.stream)
            if not body.stream:
                return JSONResponse(await until_disconnected(request, self._collect(ctx)))
            streams = _ChoiceStreams(self, ctx)
            try:
                await until_disconnected(request, streams.start())
            except BaseException:
                await streams.aclose()
                raise
            return StreamingResponse(
                self._events(ctx, streams),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        except (RequestError, ModelError, TritonUnavailable) as e:
            return self._error(ctx, e)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the Triton request is already cancelled

    def outputs(self, ctx: ServeContext, ch: Choice, stream: bool) -> AsyncIterator[ModelOutput]:
        request_id = ctx.request_id if len(ctx.choices) == 1 else f"{ctx.request_id}-{ch.index}"
        return self.model.llm.generate(
            ch.prompt, ch.sampling, stream=stream, logprobs=ctx.top_logprobs is not None, request_id=request_id
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

    async def _collect_choice(self, ctx: ServeContext, ch: Choice, first_token: asyncio.Event | None):
        texts, entries = [], []
        prompt_tokens = completion_tokens = 0
        finish_reason = None
        async for out in self.outputs(ctx, ch, stream=first_token is not None):
            if first_token is not None:
                first_token.set()
            texts.append(out.text)
            entries += out.logprobs or []
            prompt_tokens = out.num_input_tokens or prompt_tokens
            completion_tokens += out.num_output_tokens
            finish_reason = out.finish_reason or finish_reason
        choice = {"index": ch.index, **self.choice(ctx, ch, "".join(texts))}
        choice["logprobs"] = self._logprobs_of(ctx, entries, len(ch.echo))
        choice["finish_reason"] = self.finish_reason(ctx, ch, finish_reason)
        return choice, (prompt_tokens if ch.counts_prompt else 0), completion_tokens

    async def _collect(self, ctx: ServeContext) -> dict:
        """One JSON response."""
        if len(ctx.choices) == 1:
            results = [await self._collect_choice(ctx, ctx.choices[0], None)]
        else:
            results = await _after_first_tokens(ctx.choices, lambda ch, ev: self._collect_choice(ctx, ch, ev))
        return {
            "id": ctx.request_id,
            "object": self.object_name,
            "created": ctx.created,
            "model": ctx.body.model,
            "choices": [r[0] for r in sorted(results, key=lambda r: r[0]["index"])],
            "usage": usage(sum(r[1] for r in results), sum(r[2] for r in results)),
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

    async def _events(self, ctx: ServeContext, streams: _ChoiceStreams) -> AsyncIterator[bytes]:
        """Server-Sent Events ending in `data: [DONE]`: each choice's chunks as its outputs come."""
        options = ctx.body.stream_options
        include_usage = options is not None and options.include_usage
        every_chunk = include_usage and options.continuous_usage_stats  # vLLM's: cumulative usage on each chunk
        prompt_tokens = {ch.index: 0 for ch in ctx.choices}
        completion_tokens = 0
        offsets = {ch.index: len(ch.echo) for ch in ctx.choices}
        try:
            for ch in ctx.choices:
                opening = self.opening_choice(ctx, ch)
                if opening is not None:
                    choice = {"index": ch.index, **opening, "logprobs": None, "finish_reason": None}
                    yield self._chunk(ctx, [choice], None, include_usage)
            async for ch, out in streams:
                if ch.counts_prompt:
                    prompt_tokens[ch.index] = out.num_input_tokens or prompt_tokens[ch.index]
                completion_tokens += out.num_output_tokens
                piece = self.delta(ctx, ch, out.text, out.final) if out.text or out.final else None
                if piece is not None:
                    choice = {
                        "index": ch.index,
                        **piece,
                        "logprobs": self._logprobs_of(ctx, out.logprobs, offsets[ch.index]),
                        "finish_reason": self.finish_reason(ctx, ch, out.finish_reason) if out.final else None,
                    }
                    running = usage(sum(prompt_tokens.values()), completion_tokens) if every_chunk else None
                    yield self._chunk(ctx, [choice], running, include_usage)
                offsets[ch.index] += len(out.text)
            if include_usage:
                yield self._chunk(ctx, [], usage(sum(prompt_tokens.values()), completion_tokens), include_usage)
        except (ModelError, TritonUnavailable) as e:  # after the 200: the error goes out as an event
            yield sse(json.loads(self._error(ctx, e).body))
        finally:
            await streams.aclose()  # cancels the Triton requests if the client left early
        yield b"data: [DONE]\n\n"


async def _after_first_tokens(choices: list[Choice], run) -> list:
    """Run `run(choice, first_token_event)` for every choice; a prompt's other samples start once its first
    sample has its first token, so they find the prompt's KV blocks in the prefix cache (one prefill per
    prompt). Leaving early cancels them all."""
    leaders: dict[int, tuple[asyncio.Event, asyncio.Task]] = {}
    tasks = []

    async def follow(ch: Choice, leader: asyncio.Event, leader_task: asyncio.Task):
        waiter = asyncio.ensure_future(leader.wait())
        await asyncio.wait({waiter, leader_task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        return await run(ch, None)

    try:
        for ch in choices:  # a prompt's first sample comes before its others
            if ch.counts_prompt:
                event = asyncio.Event()
                task = asyncio.ensure_future(run(ch, event))
                leaders[ch.prompt_index] = (event, task)
            else:
                task = asyncio.ensure_future(follow(ch, *leaders[ch.prompt_index]))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ChoiceStreams:
    """A streamed request's choices, their outputs merged as they come. `start()` waits for each prompt's first
    sample's first output (a request the model refuses fails there, before the 200); the prompt's other
    samples start then, finding its KV blocks in the prefix cache. One choice is read straight through."""

    def __init__(self, serving: OpenAIServing, ctx: ServeContext) -> None:
        self.serving = serving
        self.ctx = ctx
        self.iters: dict[int, AsyncIterator[ModelOutput]] = {}
        self.firsts: list[tuple[Choice, ModelOutput]] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        leaders = [ch for ch in self.ctx.choices if ch.counts_prompt]
        for ch in leaders:
            self.iters[ch.index] = self.serving.outputs(self.ctx, ch, stream=True)
        firsts = await asyncio.gather(*(anext(self.iters[ch.index]) for ch in leaders))
        self.firsts = list(zip(leaders, firsts))
        if len(self.ctx.choices) == 1:
            return
        for ch in self.ctx.choices:
            if ch.index not in self.iters:
                self.iters[ch.index] = self.serving.outputs(self.ctx, ch, stream=True)
            first = None if not ch.counts_prompt else next(o for c, o in self.firsts if c is ch)
            self.tasks.append(asyncio.ensure_future(self._pump(ch, first)))

    async def _pump(self, ch: Choice, first: ModelOutput | None) -> None:
        try:
            if first is not None:
                await self.queue.put((ch, first, None))
                if first.final:
                    return
            async for out in self.iters[ch.index]:
                await self.queue.put((ch, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await self.queue.put((ch, None, e))
        finally:
            await self.queue.put((ch, None, None))

    async def __aiter__(self) -> AsyncIterator[tuple[Choice, ModelOutput]]:
        if len(self.ctx.choices) == 1:
            ch, out = self.firsts[0]
            yield ch, out
            if not out.final:
                async for out in self.iters[ch.index]:
                    yield ch, out
            return
        remaining = len(self.tasks)
        while remaining:
            ch, out, error = await self.queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
                continue
            yield ch, out

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for it in self.iters.values():
            await it.aclose()
