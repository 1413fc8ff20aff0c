"""One request of the `llm` model over Triton's gRPC stream, with the async tritonclient.

Every request gets its own gRPC stream on one shared channel (HTTP/2 multiplexes them), so cancelling
one never touches another. The request side is half-closed right after the request is sent; Triton then
ends the stream after the final response. Cancelling the call before the final response makes Triton
cancel the request, and the engine gives its KV blocks back at its next step.

A streamed request whose stream stays silent for `stream_timeout_s` (a stalled or dead model process: the
model may stay READY) ends with TritonTimeout and is cancelled. A non-streamed request has no such bound:
its one response comes at the end of its generation, however long that takes.

A failed request's error names its kind and field in the tag the model puts on its message
(`inflight.errors`): the user's (ModelError with the field), the model's own failure (ModelError), or
unavailable (TritonUnavailable). An untagged error is Triton's own (the model is not loaded, not ready, or its
stub process died): unavailable too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from inflight.errors import ErrorKind, read_tagged
from inflight.limits import ModelLimits
from inflight.serving.health import HEALTH_MODEL_PARAMETER, health_model_name


class TritonUnavailable(RuntimeError):
    """Triton cannot be reached, or the model is not ready / shutting down (HTTP 503)."""


class TritonTimeout(TritonUnavailable):
    """A streamed request's Triton stream sent nothing for `stream_timeout_s` (HTTP 504)."""


class ModelError(RuntimeError):
    """The model failed the request: the user's request (kind INVALID or LIMIT; `field` names the request
    field at fault, if one is) or the engine (INTERNAL)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.field = field


@dataclass
class ModelOutput:
    """One response of the model: text and counts since the previous response of the same request."""

    text: str
    final: bool
    finish_reason: str | None  # on the final response
    num_input_tokens: int  # the prompt's length (every response repeats it)
    num_output_tokens: int  # tokens this response carries
    logprobs: list[dict[str, dict]] | None  # the vLLM backend's per-token {token_id: {logprob, rank, decoded_token}}
    token_ids: list[int] | None = None  # this response's output token ids (when asked for: return_token_ids)
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache (when asked for: return_token_ids)


def classify_error(text: str) -> ModelError | TritonUnavailable:
    """A Triton error of a request -> ModelError (kind and field from the model's tag) or TritonUnavailable."""
    tagged = read_tagged(text)
    if tagged is None:  # Triton's own: no model answered the request
        return TritonUnavailable(text)
    if tagged.kind in (ErrorKind.UNAVAILABLE, ErrorKind.CANCELLED):
        return TritonUnavailable(tagged.message)
    return ModelError(tagged.message, tagged.kind, tagged.field)


def _admin_error(text: str) -> ModelError | TritonUnavailable:
    """A lora_admin refusal: the tagged kind and field as they are (an in-use adapter's UNAVAILABLE included)."""
    tagged = read_tagged(text)
    if tagged is not None:
        return ModelError(tagged.message, tagged.kind, tagged.field)
    if "lora_admin" in text:  # Triton's own complaint: the model's config has no such input
        return ModelError(f"the model does not take LoRA admin requests: {text}", ErrorKind.INVALID, "lora_admin")
    return TritonUnavailable(text)


def _input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _flag(name: str, value: bool) -> grpcclient.InferInput:
    return _input(name, np.array([value]))


CONNECT_GRACE_S = 2.0
# tritonclient's own options (messages of any size, its keepalive), and reconnects at most 1 s apart (gRPC's
# default backoff grows to 120 s while the server is down, and calls fail at once in between).
_KEEPALIVE = grpcclient.KeepAliveOptions()
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),  # tritonclient's MAX_GRPC_MESSAGE_SIZE
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.keepalive_time_ms", _KEEPALIVE.keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE.keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", _KEEPALIVE.keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", _KEEPALIVE.http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class TritonLLM:
    """The `llm` model at `url`, as an async generator of ModelOutputs per request."""

    def __init__(self, url: str, model: str = "llm", stream_timeout_s: float = 0) -> None:
        self.url = url
        self.model = model
        self.stream_timeout_s = stream_timeout_s  # 0: none
        self._client: grpcaio.InferenceServerClient | None = None
        self._draining: set[asyncio.Task] = set()
        self._probed: list[str] | None = None  # the models whose readiness says the engine serves

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        # Created lazily inside the running event loop: grpc.aio channels belong to the loop that made them.
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url, channel_args=_CHANNEL_ARGS)
        return self._client

    async def close(self) -> None:
        if self._draining:
            await asyncio.wait(self._draining, timeout=5)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def parameters(self) -> dict[str, str]:
        """The model's config.pbtxt `parameters` (engine settings, e.g. `model`, `max_model_len`)."""
        deadline = asyncio.get_running_loop().time() + CONNECT_GRACE_S
        while True:
            try:
                config = await self.client.get_model_config(self.model, as_json=True, client_timeout=10)
                break
            except InferenceServerException as e:
                # A channel that failed to connect (the server was not up yet) fails calls at once until its next
                # attempt: retried for a moment, a request right after the server came up is served.
                if e.status() == "StatusCode.UNAVAILABLE" and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.1)
                    continue
                raise TritonUnavailable(f"cannot read the config of model '{self.model}' at {self.url}: {e}") from None
        params = config.get("config", {}).get("parameters", {})
        return {k: v.get("string_value", "") for k, v in params.items()}

    async def limits(self, native_max_model_len: int | None = None) -> ModelLimits:
        """The model's limits as its config publishes them (`native_max_model_len`: the checkpoint's context)."""
        return ModelLimits.from_parameters(await self.parameters(), native_max_model_len)

    async def ready(self) -> bool:
        """The model is READY and its engine serves: its readiness companion (`inflight.serving.health`, named
        in its config) is loaded too. The model alone stays READY while its engine core restarts."""
        try:
            if self._probed is None:
                health = health_model_name(self.model, (await self.parameters()).get(HEALTH_MODEL_PARAMETER))
                self._probed = [self.model] + ([health] if health else [])
            answers = await asyncio.gather(*(self.client.is_model_ready(m, client_timeout=5) for m in self._probed))
            return all(answers)
        except (InferenceServerException, TritonUnavailable):
            return False

    async def generate(
        self,
        prompt: str | list[int],
        sampling_parameters: Mapping[str, Any],
        *,
        stream: bool,
        logprobs: bool = False,
        request_id: str = "",
        token_ids: bool = False,
    ) -> AsyncIterator[ModelOutput]:
        """Yield the model's responses; raise ModelError / TritonUnavailable. Leaving the iteration before
        the final response (an exception, a cancelled task, `aclose()`) cancels the request on the server.
        A prompt of token ids goes as `input_ids`; `token_ids=True` returns the output token ids and the
        cached prompt token count too."""
        if isinstance(prompt, str):
            prompt_input = _input("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_))
        else:
            prompt_input = _input("input_ids", np.asarray(prompt, dtype=np.int32))
        inputs = [
            prompt_input,
            _flag("stream", stream),
            _input("sampling_parameters", np.array([json.dumps(dict(sampling_parameters)).encode()], dtype=np.object_)),
            _flag("exclude_input_in_output", True),
            _flag("return_finish_reason", True),
            _flag("return_num_input_tokens", True),
            _flag("return_num_output_tokens", True),
        ]
        if logprobs:
            inputs.append(_flag("return_logprobs", True))
        if token_ids:
            inputs += [_flag("return_token_ids", True), _flag("return_num_cached_tokens", True)]

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        call = self.client.stream_infer(requests())
        timeout = self.stream_timeout_s if stream and self.stream_timeout_s > 0 else None
        responses = aiter(call)
        finished = False
        try:
            while True:
                try:
                    result, error = await _next(responses, timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise TritonTimeout(
                        f"model '{self.model}' at {self.url} sent nothing for {timeout:g} s (stream_timeout_s): "
                        "the request is cancelled"
                    ) from None
                if error is not None:
                    finished = True  # an error response is the request's last
                    raise classify_error(error.message() or str(error))
                output = self._output(result)
                finished = output.final
                yield output
                if finished:
                    return
            raise TritonUnavailable(f"Triton at {self.url} ended the stream before the final response")
        except grpc.RpcError as e:
            finished = True
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
            raise TritonUnavailable(f"Triton at {self.url}: {code.name if code else ''} {e.details()}") from None
        finally:
            if finished:
                # Let the server end the stream itself: a cancel racing that end crashes tritonserver 2.51
                # (server PR #7840), and grpc.aio cancels calls that are garbage-collected unfinished.
                task = asyncio.get_running_loop().create_task(_drain(call))
                self._draining.add(task)
                task.add_done_callback(self._draining.discard)
            else:
                call.cancel()

    async def lora_admin(self, body: Mapping[str, Any], request_id: str = "") -> dict[str, Any]:
        """Send the model's `lora_admin` input (JSON: list, load or unload adapters) and return its one JSON
        answer. A refusal raises ModelError with the tagged kind and field, whatever the kind (the caller
        maps each); an untagged error (Triton's own) raises TritonUnavailable, except that a model without
        the `lora_admin` input raises ModelError naming it."""
        inputs = [_input("lora_admin", np.array([json.dumps(dict(body)).encode()], dtype=np.object_))]

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        call = self.client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise _admin_error(error.message() or str(error))
                output = self._output(result)
                if output.final or output.text:
                    try:
                        answer = json.loads(output.text)
                    except json.JSONDecodeError:
                        text = output.text[:200]
                        raise ModelError(f"model '{self.model}' answered lora_admin with {text!r}") from None
                    return answer
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
            raise TritonUnavailable(f"Triton at {self.url}: {code.name if code else ''} {e.details()}") from None
        finally:
            task = asyncio.get_running_loop().create_task(_drain(call))  # the server ends the stream itself
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        raise TritonUnavailable(f"Triton at {self.url} ended the lora_admin stream without an answer")

    @staticmethod
    def _output(result) -> ModelOutput:
        response = result.get_response()
        # Read the raw tensors directly: InferResult.as_numpy builds numpy arrays per output, a visible part
        # of this front's CPU time per token.
        raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents))
        logprobs = _bytes_scalar(raw.get("logprobs"))
        reason = _bytes_scalar(raw.get("finish_reason"))
        return ModelOutput(
            text=(_bytes_scalar(raw.get("text_output")) or b"").decode("utf-8"),
            final=response.parameters["triton_final_response"].bool_param,
            finish_reason=(reason.decode() or None) if reason is not None else None,
            num_input_tokens=_uint32_scalar(raw.get("num_input_tokens")),
            num_output_tokens=_uint32_scalar(raw.get("num_output_tokens")),
            logprobs=json.loads(logprobs) if logprobs is not None else None,
            token_ids=np.frombuffer(raw["token_ids"], dtype="<i4").tolist() if "token_ids" in raw else None,
            num_cached_tokens=_uint32_scalar(raw.get("num_cached_tokens")),
        )


def _bytes_scalar(raw: bytes | None) -> bytes | None:
    """The first element of a serialized BYTES tensor (4-byte little-endian length, then the bytes)."""
    if not raw or len(raw) < 4:
        return None
    n = int.from_bytes(raw[:4], "little")
    return raw[4 : 4 + n]


def _uint32_scalar(raw: bytes | None) -> int:
    return int.from_bytes(raw[:4], "little") if raw and len(raw) >= 4 else 0


async def _next(responses, timeout: float | None):
    """The next response, or asyncio.TimeoutError after `timeout` s of silence (None: no bound)."""
    if timeout is None:
        return await anext(responses)
    if sys.version_info >= (3, 11):  # cheaper than wait_for, which makes a task per message
        async with asyncio.timeout(timeout):
            return await anext(responses)
    return await asyncio.wait_for(anext(responses), timeout)


async def _drain(call) -> None:
    with contextlib.suppress(StopAsyncIteration, grpc.RpcError, asyncio.TimeoutError, asyncio.CancelledError):
        while True:
            await asyncio.wait_for(call.__anext__(), timeout=30)
