"""The OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.

Each request becomes one gRPC stream of the `llm` model (triton_stream.py); `stream: true` answers with
Server-Sent Events ending in `data: [DONE]`. A streamed request waits for the model's first response
before answering, so a request the model rejects still gets a proper 400 rather than an event. When the
client goes away (during the stream or while a non-streamed request is running), the Triton request is
cancelled and the engine frees its KV blocks at once. The Guard middleware (guard.py) refuses what must not
reach the routes: bodies over the cap or too slow, a missing API key, more requests than the in-flight bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.serving.openai import logprobs as lp
from inflight.serving.openai.chat_template import ChatTemplateError
from inflight.serving.openai.checkpoint import Checkpoint
from inflight.serving.openai.guard import FrontLimits, Guard, default_limits, resolve_api_key
from inflight.serving.openai.protocol import (
    MODEL_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    openai_param,
)
from inflight.serving.openai.triton_stream import (
    ModelError,
    ModelOutput,
    TritonLLM,
    TritonTimeout,
    TritonUnavailable,
)

T = TypeVar("T")
log = logging.getLogger(__name__)
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|function-.*|[A-Z]\w*)$")
_JSON_SEPARATORS = (",", ":")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}.get(status, "server_error")
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


class Frontend:
    """Shared state: the Triton client and what the served checkpoint and the model's limits say (read on
    first use)."""

    def __init__(
        self, llm: TritonLLM, served_model_name: str, model_dir: str | Path | None, metrics_url: str | None = None
    ) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.model_dir = Path(model_dir) if model_dir else None
        self.metrics_url = metrics_url
        self.created = int(time.time())
        self._checkpoint: Checkpoint | None = None
        self.kv_capacity: int | None = None  # tokens; the model's metrics say, if reachable
        self.max_prompt_bytes: int | None = None  # the model's bound on prompt text (its config), if known
        self._lock = asyncio.Lock()

    async def checkpoint(self) -> Checkpoint:
        if self._checkpoint is not None:
            return self._checkpoint
        async with self._lock:
            if self._checkpoint is None:
                params = await self.llm.parameters()  # raises TritonUnavailable
                max_len = params.get("max_model_len", "")
                max_bytes = params.get("max_prompt_bytes", "")
                model_dir = self.model_dir or (Path(params["model"]) if params.get("model") else None)
                if self.metrics_url:
                    self.kv_capacity = await asyncio.to_thread(_kv_capacity, self.metrics_url, self.llm.model)
                # No model: the default one (SmolLM2's GGUF), "demo": the demo checkpoint; the same bytes here.
                checkpoint = await asyncio.to_thread(
                    Checkpoint.resolve, model_dir, int(max_len) if max_len.strip().isdigit() else None
                )
                if max_bytes.strip().isdigit():
                    self.max_prompt_bytes = int(max_bytes)
                elif checkpoint.max_model_len:  # the engine's default
                    self.max_prompt_bytes = 16 * checkpoint.max_model_len
                self._checkpoint = checkpoint
        return self._checkpoint

    def check_chat_size(self, messages: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        """Bound what the template and the tokenizer will get before either runs: the prompt they make is
        at least as long as the messages' text, and the model refuses prompts over max_prompt_bytes."""
        limit = self.max_prompt_bytes
        if limit is None:
            return
        # Linear, as parsing the body was: every field the template may read counts.
        size = len(json.dumps([messages, extra], ensure_ascii=False).encode("utf-8"))
        if size > limit:
            raise RequestError(
                f"messages are {size} bytes (as JSON, roles and chat_template_kwargs included): the limit is "
                f"max_prompt_bytes={limit}, the model's bound on the prompt they make",
                "messages",
            )

    def check_prompt_size(self, prompt: str) -> None:
        """A completion's prompt against max_prompt_bytes, before it is encoded and sent to the model."""
        limit = self.max_prompt_bytes
        if limit is not None and len(prompt) > limit // 4:  # under limit // 4 characters it cannot be over
            size = len(prompt.encode("utf-8"))
            if size > limit:
                raise RequestError(
                    f"prompt is {size} bytes (UTF-8): the limit is max_prompt_bytes={limit}, the model's bound "
                    "(refused by the API before sending)",
                    "prompt",
                )

    def default_max_tokens(self, checkpoint: Checkpoint, num_prompt_tokens: int | None) -> int | None:
        """OpenAI's default: the rest of the context, which is also capped by what the KV cache holds
        (the engine rejects a request that could never fit)."""
        limits = [n for n in (checkpoint.max_model_len, self.kv_capacity) if n]
        if not limits or num_prompt_tokens is None or num_prompt_tokens >= min(limits):
            return None
        return min(limits) - num_prompt_tokens

    def check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise RequestError(
                f"model={name!r} does not exist: this server serves {self.served_model_name!r}",
                "model",
                "model_not_found",
            )


def _short(value: Any, limit: int = 200) -> str:
    """A value for an error message, cut short (it may be a list of millions of items)."""
    if isinstance(value, (list, dict, tuple)) and len(value) > 20:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[:limit] + "..."


def _kv_capacity(metrics_url: str, model: str) -> int | None:
    """The model's `inflight_kv_cache_capacity_tokens` from Triton's Prometheus endpoint."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            text = reply.read().decode("utf-8", "replace")
    except OSError as e:
        log.warning("cannot read %s (%s): the default max_tokens is not capped by the KV cache", metrics_url, e)
        return None
    for m in re.finditer(r"^inflight_kv_cache_capacity_tokens\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        if f'model="{model}"' in m.group(1):
            return int(float(m.group(2)))
    log.warning("%s has no inflight_kv_cache_capacity_tokens for model %r", metrics_url, model)
    return None


def _render(
    checkpoint: Checkpoint, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict, count: bool
) -> tuple[str, int | None]:
    """The chat prompt and (if `count`) its number of tokens."""
    try:
        prompt = checkpoint.chat_prompt(messages, add_generation_prompt, **extra)
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from None
    return prompt, checkpoint.num_tokens(prompt) if count else None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=_JSON_SEPARATORS)


def _sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Run:
    """One request's translation: prompt, sampling parameters and the response shapes of its endpoint."""

    def __init__(self, frontend: Frontend, body: CompletionRequest | ChatCompletionRequest) -> None:
        self.frontend = frontend
        self.body = body
        self.chat = isinstance(body, ChatCompletionRequest)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.prompt = ""
        self.echo = ""
        self.top_logprobs: int | None = None
        self.sampling: dict[str, Any] = {}

    async def prepare(self) -> None:
        body, frontend = self.body, self.frontend
        frontend.check_model(body.model)
        if isinstance(body, ChatCompletionRequest):
            body.check()
            checkpoint = await frontend.checkpoint()
            messages = [m.for_template() for m in body.messages]
            extra = body.chat_template_kwargs or {}
            frontend.check_chat_size(messages, extra)
            max_tokens = body.requested_max_tokens
            # Templating and tokenizing take time in the prompt's length: off the event loop, so that
            # other clients' streams go on meanwhile.
            self.prompt, num_tokens = await asyncio.to_thread(
                _render, checkpoint, messages, body.add_generation_prompt, extra, max_tokens is None
            )
            if max_tokens is None:
                max_tokens = frontend.default_max_tokens(checkpoint, num_tokens)
            self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            self.prompt = body.check()
            await frontend.checkpoint()  # reads max_prompt_bytes (once)
            frontend.check_prompt_size(self.prompt)
            self.echo = self.prompt if body.echo else ""
            max_tokens = body.max_tokens
            self.top_logprobs = body.logprobs
        self.sampling = body.sampling_parameters(max_tokens, self.top_logprobs)

    def outputs(self, stream: bool) -> AsyncIterator[ModelOutput]:
        return self.frontend.llm.generate(
            self.prompt, self.sampling, stream=stream, logprobs=self.top_logprobs is not None, request_id=self.id
        )

    def error(self, e: Exception) -> JSONResponse:
        if isinstance(e, RequestError):
            return error_response(400, e.message, e.param, e.code)
        if isinstance(e, ModelError):
            if e.field is None:
                return error_response(500, e.message)
            return error_response(400, e.message, openai_param(e.field, self.body))
        if isinstance(e, TritonTimeout):
            return error_response(504, str(e), code="timeout")
        if isinstance(e, TritonUnavailable):
            return error_response(503, str(e), code="service_unavailable")
        raise e

    def _logprobs(self, entries: list[dict] | None, offset: int) -> dict | None:
        if self.top_logprobs is None or entries is None:
            return None
        if self.chat:
            return lp.chat_logprobs(entries, self.top_logprobs)
        return lp.completion_logprobs(entries, self.top_logprobs, offset)

    # ---- one JSON response ----------------------------------------------------------------------

    async def collect(self) -> dict:
        texts, entries = [], []
        prompt_tokens = completion_tokens = 0
        finish_reason = None
        async for out in self.outputs(stream=False):
            texts.append(out.text)
            entries += out.logprobs or []
            prompt_tokens = out.num_input_tokens or prompt_tokens
            completion_tokens += out.num_output_tokens
            finish_reason = out.finish_reason or finish_reason
        text = "".join(texts)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = self.echo + text
        choice["logprobs"] = self._logprobs(entries, len(self.echo))
        choice["finish_reason"] = finish_reason
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.body.model,
            "choices": [choice],
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    # ---- Server-Sent Events ---------------------------------------------------------------------

    def _chunk(self, choices: list[dict], usage: dict | None, include_usage: bool) -> bytes:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
        }
        if include_usage:
            chunk["usage"] = usage
        return _sse(chunk)

    def _choice(self, text: str, out: ModelOutput | None, offset: int, first: bool) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(out.logprobs, offset) if out is not None else None
        choice["finish_reason"] = out.finish_reason if out is not None and out.final else None
        return choice

    async def events(self, first: ModelOutput, rest: AsyncIterator[ModelOutput]) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        include_usage = options is not None and options.include_usage
        every_chunk = include_usage and options.continuous_usage_stats  # vLLM's: cumulative usage on each chunk
        prompt_tokens = completion_tokens = 0
        offset = len(self.echo)
        try:
            if self.chat:  # the role first, as OpenAI does
                yield self._chunk([self._choice("", None, 0, first=True)], None, include_usage)
            elif self.echo:
                yield self._chunk([self._choice(self.echo, None, 0, first=True)], None, include_usage)
            out: ModelOutput | None = first
            while out is not None:
                prompt_tokens = out.num_input_tokens or prompt_tokens
                completion_tokens += out.num_output_tokens
                if out.text or out.final:
                    usage = _usage(prompt_tokens, completion_tokens) if every_chunk else None
                    yield self._chunk([self._choice(out.text, out, offset, first=False)], usage, include_usage)
                offset += len(out.text)
                out = None if out.final else await anext(rest, None)
            if include_usage:
                yield self._chunk([], _usage(prompt_tokens, completion_tokens), include_usage)
        except (ModelError, TritonUnavailable) as e:  # after the 200: the error goes out as an event
            yield _sse(json.loads(self.error(e).body))
        finally:
            await rest.aclose()  # cancels the Triton request if the client left early
        yield b"data: [DONE]\n\n"


def create_app(
    triton_url: str,
    *,
    model: str = "llm",
    served_model_name: str | None = None,
    model_dir: str | Path | None = None,
    metrics_url: str | None = None,
    limits: FrontLimits | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The ASGI app for Triton's gRPC endpoint `triton_url` (host:port), serving Triton model `model`.

    model_dir: the checkpoint whose chat template and tokenizer to use; default: the `model` parameter of
    the Triton model's config (the same machine), or the embedded demo model when that is empty.
    metrics_url: Triton's Prometheus endpoint, where the model publishes its KV cache capacity (caps the
    default max_tokens of chat requests); None: not read.
    limits: the front's bounds (guard.py; default: `default_limits()`). api_key: required as a Bearer token on
    /v1/* (default: limits.api_key, else $INFLIGHT_API_KEY, else $VLLM_API_KEY; none of them: no key).
    """
    limits = limits or default_limits()
    llm = TritonLLM(triton_url, model, MODEL_FIELDS, stream_timeout_s=limits.stream_timeout_s)
    frontend = Frontend(llm, served_model_name or model, model_dir, metrics_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await frontend.llm.close()

    app = FastAPI(title="inflight OpenAI-compatible API", lifespan=lifespan)
    app.state.frontend = frontend
    app.add_middleware(Guard, limits=limits, api_key=resolve_api_key(api_key or limits.api_key))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = []
        for part in first.get("loc", ())[1:]:  # after "body"
            if isinstance(part, str) and _UNION_MEMBER.match(part):  # pydantic names the union member it tried
                break
            loc.append(part)
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('msg')}")
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        quiet = first.get("type") in ("missing", "too_long", "prompt_list")  # the message says it all
        value = "" if quiet else f" (got {_short(first.get('input'))})"
        return error_response(400, f"{param}: {first.get('msg')}{value}", param)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": frontend.served_model_name, "object": "model", "created": frontend.created}
        return {"object": "list", "data": [card | {"owned_by": "inflight"}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await frontend.llm.ready() else 503)

    async def handle(request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        run = _Run(frontend, body)
        try:
            await run.prepare()
            if not body.stream:
                return JSONResponse(await until_disconnected(request, run.collect()))
            outputs = run.outputs(stream=True)
            try:
                first = await until_disconnected(request, anext(outputs))
            except BaseException:
                await outputs.aclose()
                raise
            return StreamingResponse(
                run.events(first, outputs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        except (RequestError, ModelError, TritonUnavailable) as e:
            return run.error(e)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the Triton request is already cancelled

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handle(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await handle(request, body)

    return app
