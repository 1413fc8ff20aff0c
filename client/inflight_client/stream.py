"""Stream one request from the `llm` model over tritonclient's gRPC stream, with client-side timing.

    client = LLMClient("localhost:8001")
    with client.stream("Hello", {"max_tokens": 32, "temperature": 0}) as s:
        for delta in s:
            print(delta.text, end="", flush=True)
    print(s.completion.ttft_s, s.completion.num_output_tokens)

Each TextStream owns one gRPC stream (and channel), so requests are independent: cancelling one or an
error on one never touches another.

Error codes: Triton's gRPC stream carries only an error's message, unless the client sends the
`triton_grpc_error` header, which makes the server end the stream with the gRPC status instead
(INVALID_ARGUMENT, ...). tritonserver 2.51 (the nvidia-pytriton wheel) segfaults now and then in that
mode (a cancellation race, fixed in 24.12 by server PR #7840), so the header is sent only to servers
>= 2.53; against older ones InferenceError.code is None.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from inflight.errors import read_tagged

_END = object()


GRPC_ERROR_MIN_VERSION = (2, 53)


class InferenceError(RuntimeError):
    """The server failed the request; `code` is the gRPC status name (e.g. INVALID_ARGUMENT) when known; `kind`
    and `field` what the model's error says (inflight.errors: invalid, limit, unavailable, internal), if it is
    the model's."""

    def __init__(self, code: str | None, message: str, kind: str | None = None, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.code = code
        self.message = message
        self.kind = kind
        self.field = field


@dataclass
class Delta:
    text: str
    time_s: float  # since the request was sent
    num_tokens: int  # output tokens this response carries (0 when the server does not report them)
    finish_reason: str | None = None  # set on the final response
    outputs: dict[str, Any] = field(default_factory=dict)  # every output tensor of the response, as numpy


@dataclass
class Completion:
    text: str
    finish_reason: str | None  # "stop" | "length" | "cancelled" | None
    num_output_tokens: int
    ttft_s: float | None  # to the first response with text
    e2e_s: float
    deltas: list[Delta] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0


class TextStream:
    """An iterator of Deltas for one request; `completion` once exhausted; `cancel()` from any thread."""

    def __init__(
        self,
        url: str,
        model: str,
        inputs: list[grpcclient.InferInput],
        timeout_s: float = 600.0,
        error_codes: bool = False,
    ) -> None:
        self.timeout_s = timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._client = grpcclient.InferenceServerClient(url)
        self._deltas: list[Delta] = []
        self._finish_reason: str | None = None
        self._cancelled = threading.Event()
        self._closed = False
        self.completion: Completion | None = None
        inbox = self._queue  # the callback must not hold `self`: an abandoned stream is then closed by __del__
        self._client.start_stream(
            callback=lambda result, error: inbox.put((result, error)),
            headers={"triton_grpc_error": "true"} if error_codes else None,
        )
        self._t0 = time.perf_counter()
        self._client.async_stream_infer(model, inputs, enable_empty_final_response=True)

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        while self.completion is None:
            if self._cancelled.is_set():  # cancel() ends the iteration: what was already buffered is dropped
                self._finish("cancelled")
                break
            try:
                item = self._queue.get(timeout=self.timeout_s)
            except queue.Empty:
                self.cancel()
                raise InferenceError("DEADLINE_EXCEEDED", f"no response within {self.timeout_s} s") from None
            if item is _END:
                self._finish("cancelled")
                break
            result, error = item
            if error is not None:
                if self._cancelled.is_set():  # the cancel's own echo, not a failure
                    self._finish("cancelled")
                    break
                self.close()
                raise _to_error(error)
            delta = self._delta(result)
            final = result.get_response().parameters["triton_final_response"].bool_param
            if final:
                self._finish_reason = delta.finish_reason
            if delta.text or final:
                self._deltas.append(delta)
            if final:
                self._finish(self._finish_reason)
            if delta.text:
                return delta
        raise StopIteration

    def _delta(self, result) -> Delta:
        now = time.perf_counter() - self._t0
        text = _first(result, "text_output")
        tokens = _first(result, "num_output_tokens")
        reason = _first(result, "finish_reason")
        return Delta(
            text=text.decode("utf-8") if text is not None else "",
            time_s=now,
            num_tokens=int(tokens) if tokens is not None else 0,
            finish_reason=(reason.decode() or None) if reason is not None else None,
            outputs={o.name: result.as_numpy(o.name) for o in result.get_response().outputs},
        )

    def _finish(self, reason: str | None) -> None:
        deltas = self._deltas
        first = next((d.time_s for d in deltas if d.text), None)
        self.completion = Completion(
            text="".join(d.text for d in deltas),
            finish_reason=reason,
            num_output_tokens=sum(d.num_tokens for d in deltas),
            ttft_s=first,
            e2e_s=time.perf_counter() - self._t0,
            deltas=list(deltas),
        )
        self.close()

    def collect(self) -> Completion:
        for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def cancel(self) -> None:
        """Cancel on the server (it frees the request's KV blocks at its next step); ends the iteration."""
        if self._cancelled.is_set() or self._closed:
            return
        self._cancelled.set()
        self._closed = True
        try:
            self._client.stop_stream(cancel_requests=True)
        finally:
            self._client.close()
        self._queue.put(_END)

    def close(self) -> None:
        """Release the gRPC stream. Never cancels: a cancel racing the server's own end of the stream
        crashes tritonserver 2.51 (server PR #7840, fixed in 24.12); use cancel() for that."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client.stop_stream(cancel_requests=False)
        finally:
            self._client.close()

    def _abandon(self) -> None:
        """Stop listening before the end: close if the server has already ended the request, else cancel."""
        if self._closed:
            return
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _END:
                break
            result, error = item
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                self.close()
                return
        self.cancel()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._abandon()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self._abandon()


class LLMClient:
    def __init__(
        self, url: str = "localhost:8001", model: str = "llm", timeout_s: float = 600.0, error_codes: bool | None = None
    ) -> None:
        """error_codes: ask for gRPC status codes on errors; None = if the server is new enough (see above)."""
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self._error_codes = error_codes

    @property
    def error_codes(self) -> bool:
        if self._error_codes is None:
            with grpcclient.InferenceServerClient(self.url) as client:
                version = client.get_server_metadata().version
            self._error_codes = _version(version) >= GRPC_ERROR_MIN_VERSION
        return self._error_codes

    def stream(
        self,
        prompt: str,
        sampling_parameters: Mapping[str, Any] | None = None,
        *,
        stream: bool = True,
        exclude_input_in_output: bool = True,
        priority: int | None = None,
    ) -> TextStream:
        tensors: dict[str, np.ndarray] = {
            "text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
            "stream": np.array([stream]),
            "sampling_parameters": np.array([json.dumps(dict(sampling_parameters or {})).encode()], dtype=np.object_),
            "exclude_input_in_output": np.array([exclude_input_in_output]),
            "return_finish_reason": np.array([True]),
            "return_num_output_tokens": np.array([True]),
        }
        if priority is not None:
            tensors["priority"] = np.array([priority], dtype=np.int32)
        return self.stream_tensors(tensors)

    def stream_tensors(self, tensors: Mapping[str, np.ndarray]) -> TextStream:
        """Send exactly these input tensors (e.g. a genai-perf payload, or a malformed one)."""
        return TextStream(self.url, self.model, make_inputs(tensors), self.timeout_s, self.error_codes)

    def generate(self, prompt: str, sampling_parameters: Mapping[str, Any] | None = None, **kwargs) -> Completion:
        return self.stream(prompt, sampling_parameters, **kwargs).collect()


def make_inputs(tensors: Mapping[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in tensors.items():
        array = np.asarray(array)
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _first(result, name: str):
    if result.get_output(name) is None:
        return None
    values = result.as_numpy(name)
    return values.reshape(-1)[0] if values is not None and values.size else None


def _to_error(error: InferenceServerException) -> InferenceError:
    status = error.status()
    code = status.removeprefix("StatusCode.") if status else None
    text = error.message() or str(error)
    tagged = read_tagged(text)  # the model's kind and field ride in a tag before its message
    if tagged is None:
        return InferenceError(code, text)
    return InferenceError(code, tagged.message, tagged.kind.value, tagged.field)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)
