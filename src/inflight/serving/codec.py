"""The wire format of the `llm` model: Triton's vLLM backend's, so genai-perf, AIPerf, Triton's OpenAI
frontend and vLLM-backend clients work unchanged.

Request decode (tensors -> `DecodedRequest`, raising InvalidRequestError naming the field) and response
encode (text delta + optional outputs -> `InferenceResponse`; an error's kind and field as the tag of its
message, `inflight.errors.tag_message`). Needs `triton_python_backend_utils`, so it
is imported inside Triton's Python-backend stub only.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from inflight.errors import ErrorKind, InvalidRequestError, tag_message
from inflight.lora_request import MAX_LORA_NAME
from inflight.outputs import TokenLogprob
from inflight.sampling_params import SamplingParams, parse_json

RETURN_FLAGS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
    "return_num_cached_tokens": "num_cached_tokens",
    "return_token_ids": "token_ids",
}


@dataclass
class DecodedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    prepend_prompt: bool
    returns: frozenset[str]  # names of the optional outputs asked for
    priority: int = 0
    # `input_ids` instead of `text_input`: a client that tokenized already (NVIDIA Dynamo's frontend, whose
    # KV router hashes the same ids the engine caches); `prompt` is then "".
    prompt_token_ids: list[int] | None = None
    lora_name: str | None = None  # sampling_parameters' "lora_name" (Triton's vLLM backend): the adapter to run with


def decode_request(request, max_json_bytes: int = 256 << 10, max_json_depth: int = 64) -> DecodedRequest:
    """Read a vLLM-backend-style request; raise InvalidRequestError naming the field. The sampling
    parameters' JSON is bounded in size (before parsing) and nesting."""
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    prompt_token_ids = None
    if ids_tensor is not None:
        if pb_utils.get_input_tensor_by_name(request, "text_input") is not None:
            raise InvalidRequestError("input_ids and text_input are both given: send one prompt", "input_ids")
        prompt_token_ids = [int(t) for t in ids_tensor.as_numpy().reshape(-1)]
        if not prompt_token_ids:
            raise InvalidRequestError("input_ids is empty: give at least one token id", "input_ids")
        prompt = ""
    else:
        prompt = _text(request, "text_input", required=True)
        if prompt == "":
            raise InvalidRequestError("text_input is empty: give a prompt of at least one character", "text_input")
    stream = _flag(request, "stream", False)
    exclude = _flag(request, "exclude_input_in_output", None)
    if stream and exclude is False:
        raise InvalidRequestError(
            "exclude_input_in_output=false is not allowed with stream=true (a stream carries only new text)",
            "exclude_input_in_output",
        )
    params, lora_name = _sampling_params(request, max_json_bytes, max_json_depth)
    returns = frozenset(out for flag, out in RETURN_FLAGS.items() if _flag(request, flag, False))
    priority_tensor = pb_utils.get_input_tensor_by_name(request, "priority")
    priority = int(priority_tensor.as_numpy().reshape(-1)[0]) if priority_tensor is not None else 0
    prepend = not stream and not exclude
    return DecodedRequest(prompt, params, stream, prepend, returns, priority, prompt_token_ids, lora_name)


LORA_ADMIN_KEY_ENV = "INFLIGHT_LORA_ADMIN_KEY"
MAX_LORA_ADMIN_BYTES = 16 << 10


def lora_admin_request(request, admin_key: str | None) -> dict:
    """The `lora_admin` input's JSON, checked: its action, the adapter's name (and directory to load), and for
    load and unload the admin key (none set: runtime LoRA updating is off)."""
    text = _text(request, "lora_admin", required=True)
    if len(text) > MAX_LORA_ADMIN_BYTES:
        raise InvalidRequestError(f"lora_admin is {len(text)} bytes: the limit is {MAX_LORA_ADMIN_BYTES}", "lora_admin")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"lora_admin is not valid JSON: {e}", "lora_admin") from None
    if not isinstance(body, dict) or body.get("action") not in ("list", "load", "unload"):
        raise InvalidRequestError('lora_admin must be a JSON object with "action": list, load or unload', "lora_admin")
    if body["action"] == "list":
        return body
    if admin_key is None:
        raise InvalidRequestError(
            "runtime LoRA updating is off on this server (start it with inflight serve --allow-runtime-lora-updating "
            "or an OpenAI API key)",
            "lora_admin",
            ErrorKind.UNAVAILABLE,
        )
    if not hmac.compare_digest(str(body.get("key", "")).encode(), admin_key.encode()):
        raise InvalidRequestError("lora_admin: the admin key is wrong", "lora_admin")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
        raise InvalidRequestError(f"lora_name must be a string of 1 to {MAX_LORA_NAME} characters", "lora_name")
    if body["action"] == "load" and (not isinstance(path, str) or not path):
        raise InvalidRequestError("lora_path (the adapter's directory) is required to load an adapter", "lora_path")
    return body


def admin_response(text: str):
    return pb_utils.InferenceResponse(output_tensors=[_tensor("text_output", [text], np.object_)])


def _sampling_params(request, max_bytes: int, max_depth: int) -> tuple[SamplingParams, str | None]:
    sampling = _text(request, "sampling_parameters", required=False)
    try:
        if sampling is None:
            # The vLLM backend's fallback: sampling parameters as request parameters (BLS cannot send tensors).
            raw = json.loads(request.parameters() or "{}")
            sampling = json.dumps({k: v for k, v in raw.items() if not k.startswith("triton_")})
        data = parse_json(sampling, max_bytes, max_depth)
        lora_name = data.pop("lora_name", None) if isinstance(data, dict) else None
        if lora_name is not None and (not isinstance(lora_name, str) or not 0 < len(lora_name) <= MAX_LORA_NAME):
            raise InvalidRequestError(
                f"lora_name must be an adapter's name: a string of 1 to {MAX_LORA_NAME} characters", "lora_name"
            )
        return SamplingParams.from_dict(data), lora_name
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as e:  # a value of a shape the field checks did not expect
        raise InvalidRequestError(f"sampling_parameters is invalid: {e}", "sampling_parameters") from None


def _text(request, name: str, required: bool) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if required:
            raise InvalidRequestError(f"{name} is missing: it is required (a STRING tensor of shape [1])", name)
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{name} has {values.size} elements: it must have exactly 1", name)
    value = values[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(
            f"{name} is not valid UTF-8: byte {bytes(value)[e.start : e.start + 1]!r} at offset {e.start}", name
        ) from None


def _flag(request, name: str, default: bool | None) -> bool | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else bool(tensor.as_numpy().reshape(-1)[0])


# ---- responses -----------------------------------------------------------------------------------


_TRITON_CODES = {
    ErrorKind.INVALID: "INVALID_ARG",
    ErrorKind.LIMIT: "INVALID_ARG",
    ErrorKind.UNAVAILABLE: "UNAVAILABLE",
    ErrorKind.INTERNAL: "INTERNAL",
    ErrorKind.CANCELLED: "CANCELLED",
}


def error_response(kind: ErrorKind, message: str, field: str | None = None):
    """A Triton error of the kind's code whose message carries the kind and the field as its tag."""
    code = getattr(pb_utils.TritonError, _TRITON_CODES[kind])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(tag_message(kind, field, message), code))


def _tensor(name: str, values: list, dtype) -> object:
    return pb_utils.Tensor(name, np.array(values, dtype=dtype))


@dataclass
class ResponseDelta:
    """What one response carries: text and counts since the previous response of the same request."""

    text: str
    finish_reason: str  # "" until the final response
    cumulative_logprob: float
    logprobs: list[TokenLogprob] | None  # None: logprobs were not asked for in sampling_parameters
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the same in every response)
    token_ids: list[int] | None = None  # the output token ids this response carries


def encode_response(delta: ResponseDelta, returns: frozenset[str], decode_token: Callable[[int], str]):
    tensors = [_tensor("text_output", [delta.text.encode("utf-8")], np.object_)]
    if "finish_reason" in returns:
        tensors.append(_tensor("finish_reason", [delta.finish_reason.encode()], np.object_))
    if "cumulative_logprob" in returns:
        tensors.append(_tensor("cumulative_logprob", [delta.cumulative_logprob], np.float32))
    if "logprobs" in returns:
        tensors.append(_tensor("logprobs", [logprobs_json(delta.logprobs, decode_token).encode()], np.object_))
    if "num_input_tokens" in returns:
        tensors.append(_tensor("num_input_tokens", [delta.num_input_tokens], np.uint32))
    if "num_output_tokens" in returns:
        tensors.append(_tensor("num_output_tokens", [delta.num_output_tokens], np.uint32))
    if "num_cached_tokens" in returns:
        tensors.append(_tensor("num_cached_tokens", [delta.num_cached_tokens], np.uint32))
    if "token_ids" in returns:
        tensors.append(_tensor("token_ids", delta.token_ids or [], np.int32))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def logprobs_json(logprobs: list[TokenLogprob] | None, decode_token: Callable[[int], str]) -> str:
    """The vLLM backend's shape: one {token_id: {logprob, rank, decoded_token}} per generated token, the
    sampled token first (as vLLM orders it: readers tell it from the top-N that way), then the top-N by rank."""
    if logprobs is None:
        return "null"
    entries = []
    for lp in logprobs:
        ranked = sorted(lp.top.items(), key=lambda kv: -kv[1])
        rank = next((r for r, (t, _) in enumerate(ranked, start=1) if t == lp.token_id), None)
        entry = {str(lp.token_id): _logprob_entry(lp.token_id, lp.logprob, rank, decode_token)}
        for r, (t, v) in enumerate(ranked, start=1):
            entry.setdefault(str(t), _logprob_entry(t, v, r, decode_token))
        entries.append(entry)
    return json.dumps(entries)


def _logprob_entry(token_id: int, logprob: float, rank: int | None, decode_token: Callable[[int], str]) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": decode_token(token_id)}
