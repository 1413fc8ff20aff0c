"""What the OpenAI front refuses before any work (issue 27): bodies over the cap (413) or too slow (408), requests
without the API key (401), more requests in flight than the bound (429), lists over their bounds (400, before
pydantic builds them), and a Triton stream that goes silent (504 / an SSE error event, the request cancelled).

ASGI-level: no server, no Triton."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import ValidationError

from inflight.serving.openai.app import create_app
from inflight.serving.openai.guard import FrontLimits, Guard, resolve_api_key
from inflight.serving.openai.protocol import (
    MAX_CONTENT_PARTS,
    MAX_LIST_ITEMS,
    MAX_MESSAGES,
    ChatCompletionRequest,
    CompletionRequest,
)
from inflight.serving.openai.triton_stream import ModelOutput, TritonLLM, TritonTimeout


async def call(app, method="POST", path="/v1/completions", headers=(), chunks=(b"{}",), delay=0.0, content_length=True):
    """One HTTP request through `app`: the body in `chunks` (each after `delay` s); returns (status, headers,
    body, number of receive() calls)."""
    body = b"".join(chunks)
    hdrs = [(k.lower().encode(), v.encode()) for k, v in headers]
    if content_length:
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": hdrs, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    pending = list(chunks)
    received = 0
    done = asyncio.Event()

    async def receive():
        nonlocal received
        received += 1
        if pending:
            await asyncio.sleep(delay)
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        await done.wait()
        return {"type": "http.disconnect"}

    status, out_headers, out = None, {}, []

    async def send(message):
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            out.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    done.set()
    return status, out_headers, b"".join(out), received


class Echo:
    """An inner app: answers 200 with the body it read; `hold` keeps it from answering a POST until set."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold: asyncio.Event | None = None

    async def __call__(self, scope, receive, send):
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.hold is not None and scope["method"] == "POST":
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


# ---- body size and read time ----------------------------------------------------------------------


def test_content_length_over_the_cap_is_a_413_before_reading():
    inner = Echo()
    guard = Guard(inner, FrontLimits(max_body_bytes=1000))
    status, _, body, received = asyncio.run(call(guard, chunks=[b"x" * 600, b"x" * 600]))
    assert status == 413 and inner.calls == 0 and received == 0
    error = error_of(body)
    assert "max_body_bytes=1000" in error["message"] and "1200" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_body_without_content_length_is_cut_off_as_it_passes_the_cap():
    inner = Echo()
    guard = Guard(inner, FrontLimits(max_body_bytes=1000))
    chunks = [b"x" * 400] * 100  # 40 KB sent in pieces, no Content-Length
    status, _, body, received = asyncio.run(call(guard, chunks=chunks, content_length=False))
    assert status == 413 and inner.calls == 0
    assert received == 3  # refused at the chunk that passed 1000 bytes, the rest never read
    assert "max_body_bytes=1000" in error_of(body)["message"]


def test_a_body_within_the_cap_reaches_the_app_whole():
    inner = Echo()
    guard = Guard(inner, FrontLimits(max_body_bytes=1000))
    status, _, body, _ = asyncio.run(call(guard, chunks=[b"a" * 500, b"b" * 500], content_length=False))
    assert status == 200 and body == b"a" * 500 + b"b" * 500


def test_a_trickling_body_is_a_408_at_the_deadline():
    inner = Echo()
    guard = Guard(inner, FrontLimits(body_timeout_s=0.3))
    status, _, body, received = asyncio.run(call(guard, chunks=[b"x"] * 100, delay=0.05))
    assert status == 408 and inner.calls == 0
    assert received < 100  # it stopped reading at the deadline, not after the whole body
    assert "0.3" in error_of(body)["message"]


# ---- API key ---------------------------------------------------------------------------------------


def test_the_api_key_guards_v1_and_leaves_health_open():
    inner = Echo()
    guard = Guard(inner, FrontLimits(), api_key="s3cret")
    for headers in ((), (("Authorization", "Bearer wrong"),), (("Authorization", "s3cret"),)):
        status, _, body, _ = asyncio.run(call(guard, headers=headers))
        assert status == 401, headers
        assert error_of(body)["code"] == "invalid_api_key"
    assert asyncio.run(call(guard, headers=(("Authorization", "Bearer s3cret"),)))[0] == 200
    assert asyncio.run(call(guard, method="GET", path="/health", chunks=[b""]))[0] == 200
    assert inner.calls == 2


def test_the_api_key_comes_from_the_flag_then_inflight_then_vllm(monkeypatch):
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert resolve_api_key(None) == "v"
    monkeypatch.setenv("INFLIGHT_API_KEY", "i")
    assert resolve_api_key(None) == "i"
    assert resolve_api_key("flag") == "flag"


# ---- requests in flight ----------------------------------------------------------------------------


def test_requests_over_the_in_flight_bound_get_429_with_retry_after():
    async def scenario():
        inner = Echo()
        inner.hold = asyncio.Event()
        guard = Guard(inner, FrontLimits(max_inflight=2))
        held = [asyncio.ensure_future(call(guard)) for _ in range(2)]
        await asyncio.sleep(0.05)
        status, headers, body, _ = await call(guard)
        assert status == 429 and headers.get("retry-after")
        error = error_of(body)
        assert error["code"] == "rate_limit_exceeded" and "max_inflight_requests=2" in error["message"]
        assert (await call(guard, method="GET", path="/v1/models"))[0] != 429  # not a generation request
        inner.hold.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
        inner.hold = None
        assert (await call(guard))[0] == 200  # the count went back down

    asyncio.run(scenario())


# ---- list bounds, checked before pydantic builds the items ----------------------------------------


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (list(range(10)) * 400_000, "prompt has 4000000 token ids: the limit is 1048576"),
        ([list(range(10)) * 1000] * 200, "prompt has 2000000 token ids: the limit is 1048576"),
        (["a"] * 257, "prompt has 257 items: the limit is 256"),
        ([], "prompt is an empty list"),
    ],
)
def test_prompt_token_ids_and_batches_are_bounded_without_validating_millions_of_items(prompt, match):
    start = time.process_time()  # this process's CPU time: a busy machine does not inflate it
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "llm", "prompt": prompt})
    assert time.process_time() - start < 0.5
    error = info.value.errors()[0]
    assert error["loc"] == ("prompt",) and match in error["msg"]


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("messages", [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1), MAX_MESSAGES),
        ("messages", [{"role": "user", "content": [{"type": "text", "text": ""}] * (MAX_CONTENT_PARTS + 1)}],
         MAX_CONTENT_PARTS),
        ("stop", ["x"] * (MAX_LIST_ITEMS + 1), MAX_LIST_ITEMS),
        ("stop_token_ids", [1] * (MAX_LIST_ITEMS + 1), MAX_LIST_ITEMS),
        ("logit_bias", {str(i): 1.0 for i in range(MAX_LIST_ITEMS + 1)}, MAX_LIST_ITEMS),
        ("tools", [{}] * (MAX_LIST_ITEMS + 1), MAX_LIST_ITEMS),
    ],
)  # fmt: skip
def test_lists_over_their_bound_name_the_field_and_the_limit(field, value, limit):
    body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = info.value.errors()[0]
    assert error["loc"][0] == field and str(limit) in error["msg"], error["msg"]


def test_a_huge_invalid_list_gets_a_short_400(demo_model_dir):
    app = create_app("localhost:1", model_dir=demo_model_dir)
    body = json.dumps({"model": "llm", "messages": [{"role": "user", "content": "hi"}] * 200_000}).encode()
    start = time.process_time()  # this process's CPU time: a busy machine does not inflate it
    status, _, out, _ = asyncio.run(call(app, path="/v1/chat/completions", chunks=[body],
                                         headers=(("content-type", "application/json"),)))  # fmt: skip
    assert status == 400 and time.process_time() - start < 2.0
    assert len(out) < 2000, out[:300]  # the input is not echoed back whole
    assert error_of(out)["param"] == "messages" and str(MAX_MESSAGES) in error_of(out)["message"]


# ---- a Triton stream that goes silent ----------------------------------------------------------------


class _StalledCall:
    """A gRPC stream that sends `n` responses, then nothing."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.n:
            self.n -= 1
            return f"out{self.n}", None
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


class _FakeClient:
    def __init__(self, n: int) -> None:
        self.call = _StalledCall(n)

    def stream_infer(self, _requests):
        return self.call

    async def get_model_config(self, *_a, **_k):
        return {"config": {"parameters": {"max_model_len": {"string_value": "128"}}}}

    async def close(self):
        pass


def _fake_output(_result) -> ModelOutput:
    return ModelOutput("tok", False, None, 3, 1, None)


def _stalled_llm(monkeypatch, n: int, timeout_s: float) -> TritonLLM:
    monkeypatch.setattr(TritonLLM, "_output", staticmethod(_fake_output))
    llm = TritonLLM("fake:1", "llm", stream_timeout_s=timeout_s)
    llm._client = _FakeClient(n)
    return llm


def test_a_silent_stream_times_out_and_is_cancelled(monkeypatch):
    llm = _stalled_llm(monkeypatch, 2, 0.2)

    async def consume():
        got = []
        with pytest.raises(TritonTimeout) as info:
            async for out in llm.generate("hi", {}, stream=True):
                got.append(out.text)
        return got, info.value

    start = time.monotonic()
    got, error = asyncio.run(consume())
    assert got == ["tok", "tok"] and llm._client.call.cancelled
    # At least the timeout; the upper bound is only generous for a loaded machine (the fake stalls forever).
    assert 0.2 <= time.monotonic() - start < 10
    assert "0.2" in str(error)


@pytest.mark.parametrize(("sent", "status"), [(0, 504), (1, 200)])
def test_a_silent_stream_is_a_504_before_the_first_byte_and_an_error_event_after(
    monkeypatch, demo_model_dir, sent, status
):
    app = create_app("fake:1", model_dir=demo_model_dir, limits=FrontLimits(stream_timeout_s=0.2))
    served = app.state.served_model
    served.llm = _stalled_llm(monkeypatch, sent, 0.2)
    body = json.dumps({"model": "llm", "prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    got, _, out, _ = asyncio.run(call(app, chunks=[body], headers=(("content-type", "application/json"),)))
    assert got == status
    if status == 504:
        assert error_of(out)["code"] == "timeout"
    else:
        events = [line[6:] for line in out.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "timeout"
    assert served.llm._client.call.cancelled


# ---- flags -------------------------------------------------------------------------------------------


def test_the_flags_make_the_limits_and_the_api_listens_on_localhost_by_default():
    from inflight.launcher.cli import _openai_limits, build_parser

    ns = build_parser().parse_args(["serve", "--openai-max-body-bytes", "1000", "--max-num-seqs", "8", "--api-key", "k",
                                    "--openai-stream-timeout", "0"])  # fmt: skip
    limits = _openai_limits(ns)
    assert (limits.max_body_bytes, limits.max_inflight, limits.stream_timeout_s, limits.api_key) == (1000, 32, 0, "k")
    assert "k" not in repr(limits)
    assert ns.openai_host == "127.0.0.1"
    ns = build_parser().parse_args(["openai"])
    assert ns.host == "127.0.0.1" and _openai_limits(ns) == FrontLimits()
    ns = build_parser().parse_args(["openai", "--max-inflight-requests", "0"])
    with pytest.raises(SystemExit, match="max_inflight=0"):
        _openai_limits(ns)
