"""What the OpenAI front refuses before any work: a pure ASGI middleware in front of the routes.

In this order, each before the body is read:
- `/v1/*` without `Authorization: Bearer <api key>` (when a key is set): 401. `/health` stays open.
- a generation request (`POST /v1/completions`, `/v1/chat/completions`) over `max_inflight` in flight in this
  front (counted until its response, streamed or not, has ended): 429 with `Retry-After`.
- a body whose Content-Length is over `max_body_bytes`: 413.
Then the body is read here, counted as it arrives: 413 as soon as it passes `max_body_bytes` (the rest is
never read), 408 if it is not complete within `body_timeout_s` of the request's start (a client that trickles
its body holds nothing for longer). The app then gets the body as it came, and later `receive()` calls (the
disconnect watch) go to the server.

uvicorn itself bounds a request line and headers at 16 KiB (h11) but not their read time, and closes an idle
keep-alive connection after `timeout_keep_alive` (5 s); a slow-headers client is a reverse proxy's job.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from dataclasses import dataclass, field

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
API_KEY_ENV = ("INFLIGHT_API_KEY", "VLLM_API_KEY")
LORA_ADMIN_KEY_ENV = "INFLIGHT_LORA_ADMIN_KEY"  # the Triton model reads its key from the same variable


@dataclass(frozen=True)
class FrontLimits:
    """The front's own bounds; flags of `inflight openai` and `inflight serve --openai-*`."""

    # 16 MiB: 4x (JSON escaping, \\uXXXX for non-ASCII) the default max_prompt_bytes of a 128k-token model
    # (16 bytes a token = 2 MiB), twice over; it bounds the JSON parse on the event loop.
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0  # the whole body, from the request's start
    # Longest silence of a streamed request's Triton stream (before its first response: queueing and prefill).
    stream_timeout_s: float = 120.0
    max_inflight: int = 256  # generation requests in this front at once (4x the engine's default max_num_seqs)
    api_key: str | None = field(default=None, repr=False)  # None: $INFLIGHT_API_KEY, else $VLLM_API_KEY, else none
    # The Triton server's LoRA admin key, for /v1/load_lora_adapter and /v1/unload_lora_adapter (None:
    # $INFLIGHT_LORA_ADMIN_KEY, else those endpoints are off). `inflight serve` sets it per launch.
    lora_admin_key: str | None = field(default=None, repr=False)
    # vLLM's --tool-call-parser (tool_parsers.TOOL_PARSERS): how the model writes tool calls; None: tool_choice
    # "auto" is refused ("required" and a named function need no parser).
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        from inflight.serving.openai.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            known = ", ".join(sorted(TOOL_PARSERS))
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is invalid: must be one of {known}")
        for name in ("max_body_bytes", "max_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        for name in ("body_timeout_s", "stream_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 0 (0 = no limit)")


_default_limits = FrontLimits()


def set_default_limits(limits: FrontLimits) -> None:
    """What `create_app(limits=None)` uses (`inflight serve` sets its `--openai-*` flags here)."""
    global _default_limits
    _default_limits = limits


def default_limits() -> FrontLimits:
    return _default_limits


def resolve_api_key(flag: str | None) -> str | None:
    """`--api-key`, else $INFLIGHT_API_KEY, else vLLM's $VLLM_API_KEY; None: no key required."""
    if flag:
        return flag
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


def resolve_lora_admin_key(flag: str | None) -> str | None:
    """The LoRA admin key given, else $INFLIGHT_LORA_ADMIN_KEY; None: runtime LoRA updating is off."""
    return flag or os.environ.get(LORA_ADMIN_KEY_ENV) or None


async def _respond(send, status: int, message: str, kind: str, code: str, headers=()) -> None:
    """An OpenAI-shaped error; the connection closes after it (the body may be unread)."""
    data = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }  # fmt: skip
    )
    await send({"type": "http.response.body", "body": data})


class Guard:
    """The ASGI middleware (see the module's docstring)."""

    def __init__(self, app, limits: FrontLimits | None = None, api_key: str | None = None) -> None:
        self.app = app
        self.limits = limits or FrontLimits()
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self.inflight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, limits = scope.get("path", ""), self.limits
        headers = dict(scope.get("headers") or ())
        if self._key is not None and path.startswith("/v1/"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                message = "a valid API key is required: send 'Authorization: Bearer <key>'"
                await _respond(send, 401, message, "invalid_request_error", "invalid_api_key",
                               [(b"www-authenticate", b"Bearer")])  # fmt: skip
                return
        counted = scope.get("method") == "POST" and path in GENERATION_PATHS
        if counted and self.inflight >= limits.max_inflight:
            message = (f"the server is busy: {self.inflight} requests are in flight, the limit is "
                       f"max_inflight_requests={limits.max_inflight}; retry shortly")  # fmt: skip
            await _respond(send, 429, message, "rate_limit_error", "rate_limit_exceeded", [(b"retry-after", b"1")])
            return
        if counted:
            self.inflight += 1
        try:
            await self._with_body(scope, receive, send, headers)
        finally:
            if counted:
                self.inflight -= 1

    async def _with_body(self, scope, receive, send, headers: dict[bytes, bytes]) -> None:
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > limit:
            await self._too_large(send, f"{int(declared)} bytes (Content-Length)")
            return
        loop = asyncio.get_running_loop()
        timeout = self.limits.body_timeout_s
        deadline = loop.time() + timeout if timeout else None
        messages: list[dict] = []
        size = 0
        while True:
            try:
                remaining = None if deadline is None else max(deadline - loop.time(), 0)
                message = await asyncio.wait_for(receive(), remaining)
            except asyncio.TimeoutError:
                await _respond(send, 408, f"the request body did not arrive within body_timeout_s={timeout:g} s "
                               f"({size} bytes came)", "invalid_request_error", "request_timeout")  # fmt: skip
                return
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > limit:
                await self._too_large(send, f"over {limit} bytes (read so far: {size})")
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send, what: str) -> None:
        limit = self.limits.max_body_bytes
        await _respond(send, 413, f"the request body is {what}: the limit is max_body_bytes={limit}",
                       "invalid_request_error", "request_too_large")  # fmt: skip
