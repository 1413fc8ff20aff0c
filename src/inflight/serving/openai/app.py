"""The OpenAI-compatible HTTP API: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, and
vLLM's `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` (serving_models.py) and `POST /tokenize` /
`POST /detokenize` (serving_tokenization.py).

Each request becomes one gRPC stream of the `llm` model (triton_stream.py), served by its endpoint's class
(serving_chat.py, serving_completion.py over serving_engine.py); `stream: true` answers with Server-Sent
Events ending in `data: [DONE]`. The Guard middleware (guard.py) refuses what must not reach the routes:
bodies over the cap or too slow, a missing API key, more requests than the in-flight bound. A LoRA adapter is
served as a model of its own name: `"model": "<adapter>"` runs the base model with that adapter.
"""

from __future__ import annotations

import re
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from inflight.serving.openai.guard import FrontLimits, Guard, default_limits, resolve_api_key, resolve_lora_admin_key
from inflight.serving.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from inflight.serving.openai.served_model import ServedModel
from inflight.serving.openai.serving_chat import OpenAIServingChat
from inflight.serving.openai.serving_completion import OpenAIServingCompletion
from inflight.serving.openai.serving_engine import error_response
from inflight.serving.openai.serving_models import OpenAIServingModels
from inflight.serving.openai.serving_tokenization import OpenAIServingTokenization
from inflight.serving.openai.tool_parsers import get_tool_parser
from inflight.serving.openai.triton_stream import TritonLLM

_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|function-.*|[A-Z]\w*)$")


def _short(value: Any, limit: int = 200) -> str:
    """A value for an error message, cut short (it may be a list of millions of items)."""
    if isinstance(value, (list, dict, tuple)) and len(value) > 20:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[:limit] + "..."


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint as an OpenAI 400 naming the field (`param`) in OpenAI's dotted form."""
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


def create_app(
    triton_url: str,
    *,
    model: str = "llm",
    served_model_name: str | None = None,
    model_dir: str | Path | None = None,
    limits: FrontLimits | None = None,
    api_key: str | None = None,
    lora_admin_key: str | None = None,
) -> FastAPI:
    """The ASGI app for Triton's gRPC endpoint `triton_url` (host:port), serving Triton model `model`.

    model_dir: the checkpoint whose chat template and tokenizer to use; default: the `model` parameter of
    the Triton model's config (the same machine), or the embedded demo model when that is empty.
    limits: the front's bounds (guard.py; default: `default_limits()`). api_key: required as a Bearer token on
    /v1/* (default: limits.api_key, else $INFLIGHT_API_KEY, else $VLLM_API_KEY; none of them: no key).
    lora_admin_key: the Triton server's LoRA admin key, which the load/unload endpoints send (default:
    limits.lora_admin_key, else $INFLIGHT_LORA_ADMIN_KEY; none: runtime LoRA updating is off here).
    """
    limits = limits or default_limits()
    llm = TritonLLM(triton_url, model, stream_timeout_s=limits.stream_timeout_s)
    parser = get_tool_parser(limits.tool_call_parser) if limits.tool_call_parser else None
    served = ServedModel(llm, served_model_name or model, model_dir, parser)
    serving_chat = OpenAIServingChat(served)
    serving_completion = OpenAIServingCompletion(served)
    serving_tokenization = OpenAIServingTokenization(served)
    serving_models = OpenAIServingModels(served, resolve_lora_admin_key(lora_admin_key or limits.lora_admin_key))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        served.prepared()  # the tokenizer and chat template load while Triton starts, not on the first request
        yield
        await served.llm.close()

    app = FastAPI(title="inflight OpenAI-compatible API", lifespan=lifespan)
    app.state.served_model = served
    app.add_middleware(Guard, limits=limits, api_key=resolve_api_key(api_key or limits.api_key))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.get("/v1/models")
    async def models() -> dict:
        return await serving_models.show_available_models()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return await serving_models.load_lora_adapter(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return await serving_models.unload_lora_adapter(body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving_tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await serving_tokenization.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        """Ready: the engine serves (Triton's readiness, health model included) and this front can render a
        prompt at once."""
        ready = await served.llm.ready() and served.prepared()
        return Response(status_code=200 if ready else 503)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving_completion.create(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving_chat.create(request, body)

    return app
