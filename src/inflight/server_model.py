"""The `llm` model's TritonPythonModel: Triton requests in, engine, streamed Triton responses out.

The request/response format is Triton's vLLM backend's (see model_repository/llm/config.pbtxt), so
genai-perf, Triton's OpenAI-compatible frontend and vLLM-backend clients work unchanged.

execute() only decodes and validates; the engine thread (engine_loop.py) owns the engine and calls
back into a `ResponseWriter` per request, which sends every response from that thread. Imported by
model_repository/llm/1/model.py inside Triton's Python-backend stub only (needs
`triton_python_backend_utils`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from inflight.config import ConfigError, EngineConfig
from inflight.demo_model import cached_demo_model
from inflight.engine import LLMEngine
from inflight.engine_loop import EngineLoop, ErrorKind, Submission
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.sampling_params import InvalidRequestError, SamplingParams
from inflight.triton_metrics import TritonMetrics

log = logging.getLogger("inflight.server")

RETURN_FLAGS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
SERVER_PARAMETERS = ("model", "step_log")  # the rest of config.pbtxt's parameters are EngineConfig fields
_ERROR_CODES = {
    ErrorKind.INVALID: "INVALID_ARG",
    ErrorKind.INTERNAL: "INTERNAL",
    ErrorKind.UNAVAILABLE: "UNAVAILABLE",
    ErrorKind.CANCELLED: "CANCELLED",
}


# ---- model settings (config.pbtxt parameters) --------------------------------------------------------


@dataclass
class ServerSettings:
    model_dir: str
    engine_config: EngineConfig
    step_log: str | None = None

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> ServerSettings:
        """Raise ConfigError naming the parameter for anything unknown or unparsable."""
        engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
        known = set(engine_fields) | set(SERVER_PARAMETERS)
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise ConfigError(f"config.pbtxt parameter(s) {unknown} unknown; known: {', '.join(sorted(known))}")
        kwargs = {}
        for name, raw in parameters.items():
            if name in engine_fields and raw.strip() != "":
                kwargs[name] = _parse(name, raw.strip(), engine_fields[name].type)
        config = EngineConfig.from_kwargs(kwargs)
        model = parameters.get("model", "").strip()
        return cls(model or str(cached_demo_model()), config, parameters.get("step_log", "").strip() or None)


def _parse(name: str, raw: str, type_name: str) -> object:
    base = type_name.split("|")[0].strip()
    try:
        if base == "int":
            return int(raw)
        if base == "float":
            return float(raw)
        if base == "bool":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        return raw
    except ValueError:
        article = "an" if base == "int" else "a"
        raise ConfigError(f"config.pbtxt parameter {name}={raw!r} is invalid: must be {article} {base}") from None


# ---- requests ------------------------------------------------------------------------------------


@dataclass
class DecodedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    prepend_prompt: bool
    returns: frozenset[str]  # names of the optional outputs asked for
    priority: int = 0


def decode_request(request) -> DecodedRequest:
    """Read a vLLM-backend-style request; raise InvalidRequestError naming the field."""
    prompt = _text(request, "text_input", required=True)
    if prompt == "":
        raise InvalidRequestError("text_input is empty: give a prompt of at least one character")
    stream = _flag(request, "stream", False)
    exclude = _flag(request, "exclude_input_in_output", None)
    if stream and exclude is False:
        raise InvalidRequestError(
            "exclude_input_in_output=false is not allowed with stream=true (a stream carries only new text)"
        )
    params = _sampling_params(request)
    returns = frozenset(out for flag, out in RETURN_FLAGS.items() if _flag(request, flag, False))
    priority_tensor = pb_utils.get_input_tensor_by_name(request, "priority")
    priority = int(priority_tensor.as_numpy().reshape(-1)[0]) if priority_tensor is not None else 0
    return DecodedRequest(prompt, params, stream, not stream and not exclude, returns, priority)


def _sampling_params(request) -> SamplingParams:
    sampling = _text(request, "sampling_parameters", required=False)
    try:
        if sampling is not None:
            return SamplingParams.from_json(sampling)
        # The vLLM backend's fallback: sampling parameters as request parameters (BLS cannot send tensors).
        raw = json.loads(request.parameters() or "{}")
        return SamplingParams.from_dict({k: v for k, v in raw.items() if not k.startswith("triton_")})
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as e:  # a value of a shape the field checks did not expect
        raise InvalidRequestError(f"sampling_parameters is invalid: {e}") from None


def _text(request, name: str, required: bool) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if required:
            raise InvalidRequestError(f"{name} is missing: it is required (a STRING tensor of shape [1])")
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{name} has {values.size} elements: it must have exactly 1")
    value = values[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(
            f"{name} is not valid UTF-8: byte {bytes(value)[e.start : e.start + 1]!r} at offset {e.start}"
        ) from None


def _flag(request, name: str, default: bool | None) -> bool | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else bool(tensor.as_numpy().reshape(-1)[0])


def _error_response(kind: ErrorKind, message: str):
    code = getattr(pb_utils.TritonError, _ERROR_CODES[kind])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _tensor(name: str, values: list, dtype) -> object:
    return pb_utils.Tensor(name, np.array(values, dtype=dtype))


class ResponseWriter:
    """Turns one request's engine outputs into Triton responses (engine thread only).

    Streaming sends each non-empty text delta at once and never an empty intermediate response; the
    final response carries whatever is left (possibly "") and the FINAL flag. Non-streaming sends one
    response with the whole text. Optional outputs are per-response deltas, as in the vLLM backend.
    """

    def __init__(self, request, req: DecodedRequest, tokenizer, metrics: TritonMetrics | None, arrival: float):
        self.request = request  # keep the Triton request alive until its final response
        self.sender = request.get_response_sender()
        self.req = req
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.done = False
        self._text: list[str] = []
        self._num_tokens = 0
        self._logprobs: list[TokenLogprob] = []

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def on_output(self, out: RequestOutput) -> None:
        if self.done:
            return
        now = time.monotonic()
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self._text.append(out.new_text)
        self._num_tokens += len(out.new_token_ids)
        self._logprobs += out.new_logprobs or []
        if out.finished:
            self._send(out, final=True)
            self._observe(out, now)
        elif self.req.stream and out.new_text:
            self._send(out, final=False)

    def on_error(self, kind: ErrorKind, message: str) -> None:
        if self.done:
            return
        self.done = True
        self.sender.send(_error_response(kind, message), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.request = None

    def _send(self, out: RequestOutput, final: bool) -> None:
        text = "".join(self._text)
        if final and self.req.prepend_prompt:
            text = self.req.prompt + text
        tensors = [_tensor("text_output", [text.encode("utf-8")], np.object_)]
        returns = self.req.returns
        if "finish_reason" in returns:
            reason = (out.finish_reason or "") if final else ""
            tensors.append(_tensor("finish_reason", [reason.encode()], np.object_))
        if "cumulative_logprob" in returns:
            tensors.append(_tensor("cumulative_logprob", [out.cumulative_logprob], np.float32))
        if "logprobs" in returns:
            tensors.append(_tensor("logprobs", [self._logprobs_json().encode()], np.object_))
        if "num_input_tokens" in returns:
            tensors.append(_tensor("num_input_tokens", [len(out.prompt_token_ids)], np.uint32))
        if "num_output_tokens" in returns:
            tensors.append(_tensor("num_output_tokens", [self._num_tokens], np.uint32))
        self._text, self._num_tokens, self._logprobs = [], 0, []
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if final:
            self.done = True
            self.request = None
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def _logprobs_json(self) -> str:
        if self.req.params.logprobs is None:
            return "null"  # as the vLLM backend: logprobs were not asked for in sampling_parameters
        entries = []
        for lp in self._logprobs:
            ranked = sorted(lp.top.items(), key=lambda kv: -kv[1])
            entry = {str(t): self._logprob_entry(t, v, r) for r, (t, v) in enumerate(ranked, start=1)}
            entry.setdefault(str(lp.token_id), self._logprob_entry(lp.token_id, lp.logprob, None))
            entries.append(entry)
        return json.dumps(entries)

    def _logprob_entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        decoded = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"logprob": logprob, "rank": rank, "decoded_token": decoded}

    def _observe(self, out: RequestOutput, now: float) -> None:
        if self.metrics is None:
            return
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        tpot = None
        if self.first_token_time is not None and out.num_output_tokens > 1:
            tpot = (now - self.first_token_time) / (out.num_output_tokens - 1)
        self.metrics.observe_request(ttft, tpot, now - self.arrival)


# ---- the model -----------------------------------------------------------------------------------


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _setup_logging()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError("config.pbtxt must set model_transaction_policy { decoupled: true }")
        parameters = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        settings = ServerSettings.from_parameters(parameters)
        if settings.engine_config.device == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on a CPU run interpreted
        log.info("loading %s with %s", settings.model_dir, settings.engine_config)
        self.engine = LLMEngine(settings.model_dir, settings.engine_config)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = _make_metrics(labels)
        on_iteration = self.metrics.update if self.metrics is not None else None
        self.loop = EngineLoop(self.engine, on_iteration, settings.step_log).start()
        self._ids = itertools.count()
        log.info(
            "engine ready: max_model_len=%d, %d KV blocks of %d tokens",
            self.engine.max_model_len,
            self.engine.num_kv_blocks,
            self.engine.config.block_size,
        )

    def execute(self, requests: list) -> None:
        for request in requests:
            arrival = time.monotonic()
            try:
                decoded = decode_request(request)
            except InvalidRequestError as e:
                self._reject(request, ErrorKind.INVALID, str(e))
                continue
            except Exception as e:  # a decoding bug must not take down the whole batch of requests
                log.exception("decoding a request failed")
                self._reject(request, ErrorKind.INTERNAL, f"could not decode the request: {e!r}")
                continue
            writer = ResponseWriter(request, decoded, self.engine.tokenizer, self.metrics, arrival)
            request_id = f"{next(self._ids)}-{request.request_id()}"
            self.loop.submit(Submission(request_id, decoded.prompt, decoded.params, writer, decoded.priority, arrival))
        return None

    @staticmethod
    def _reject(request, kind: ErrorKind, message: str) -> None:
        request.get_response_sender().send(
            _error_response(kind, message), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def finalize(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.stop(timeout_s=10.0):
            log.warning("engine thread still busy after 10 s; leaving it behind")


def _make_metrics(labels: dict[str, str]) -> TritonMetrics | None:
    try:
        return TritonMetrics(pb_utils, labels)
    except pb_utils.TritonModelException as e:  # the server runs with --allow-metrics=false
        log.warning("metrics disabled: %s", e)
        return None


def _setup_logging() -> None:
    logger = logging.getLogger("inflight")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
