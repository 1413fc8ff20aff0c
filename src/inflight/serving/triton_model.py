"""The `llm` model's TritonPythonModel: Triton requests in, engine, streamed Triton responses out.

execute() decodes, validates and tokenizes (`codec.py`); the engine runs in its own process, and the
responder thread of `engine_loop.py` calls back into a `ResponseWriter` per request, which sends every
response from that thread.
Imported by model_repository/llm/1/model.py inside Triton's Python-backend stub only (needs
`triton_python_backend_utils`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import triton_python_backend_utils as pb_utils

from inflight.coerce import field_types, parse_scalar, type_name
from inflight.config import ConfigError, EngineConfig
from inflight.engine.core import CoreSpec
from inflight.engine.core_messages import LoRAAdmin
from inflight.errors import ErrorKind, InvalidRequestError
from inflight.log import setup as log_setup
from inflight.model_source import ModelSourceError, resolve_model
from inflight.outputs import RequestOutput, TokenLogprob
from inflight.serving.codec import (
    LORA_ADMIN_KEY_ENV,
    DecodedRequest,
    ResponseDelta,
    admin_response,
    decode_request,
    encode_response,
    error_response,
    lora_admin_request,
)
from inflight.serving.engine_loop import EngineLoop, Submission
from inflight.serving.health import HEALTH_MODEL_PARAMETER, HealthModel, health_model_name
from inflight.serving.metrics import TritonMetrics

log = logging.getLogger("inflight.server")

# The rest of config.pbtxt's parameters are EngineConfig fields.
SERVER_PARAMETERS = ("model", "step_log", "stream_interval", HEALTH_MODEL_PARAMETER)


# ---- model settings (config.pbtxt parameters) --------------------------------------------------------


@dataclass
class ServerSettings:
    model_dir: str
    engine_config: EngineConfig
    step_log: str | None = None
    # vLLM's stream_interval: a stream's intermediate responses carry at least this many tokens (its first
    # response goes out with its first token, its last whenever it ends). Fewer, larger responses cost the
    # server, the Python backend's IPC and the client less per token; 1 sends every token at once.
    stream_interval: int = 1
    health_model: str = ""  # the readiness companion's name ("" = `<model>_health`, "none": none; health.py)

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], multi_lora: Path | None = None) -> ServerSettings:
        """Raise ConfigError naming the parameter for anything unknown or unparsable. `multi_lora`: the version
        directory's multi_lora.json (Triton's vLLM backend: `{"adapter name": "/path/to/adapter", ...}`)."""
        engine_fields = field_types(EngineConfig)
        known = set(engine_fields) | set(SERVER_PARAMETERS)
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise ConfigError(f"config.pbtxt parameter(s) {unknown} unknown; known: {', '.join(sorted(known))}")
        kwargs = {}
        for name, raw in parameters.items():
            if name in engine_fields and raw.strip() != "":
                kwargs[name] = _parse(name, raw.strip(), engine_fields[name])
        if multi_lora is not None:
            kwargs["lora_modules"] = _merge_lora_modules(kwargs.get("lora_modules"), multi_lora)
        config = EngineConfig.from_kwargs(kwargs)
        model = parameters.get("model", "").strip()
        interval = parameters.get("stream_interval", "").strip()
        stream_interval = _parse("stream_interval", interval, int) if interval else 1
        if stream_interval < 1:
            raise ConfigError(f"config.pbtxt parameter stream_interval={stream_interval} is invalid: must be >= 1")
        step_log = parameters.get("step_log", "").strip() or None
        try:
            model_path = str(resolve_model(model))  # "" = the default model, "demo" = the demo checkpoint
        except ModelSourceError as e:
            raise ConfigError(f"config.pbtxt parameter model={model!r}: {e}") from None
        return cls(model_path, config, step_log, stream_interval, parameters.get(HEALTH_MODEL_PARAMETER, ""))


def read_multi_lora(path: Path) -> dict[str, str]:
    """multi_lora.json's adapters, relative directories taken from the file's own directory."""
    try:
        modules = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a JSON object of adapter names to directories ({e})") from None
    if not isinstance(modules, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in modules.items()):
        raise ConfigError(f'{path}: must map adapter names to adapter directories: {{"name": "/path", ...}}')
    return {name: str((path.parent / adapter).resolve()) for name, adapter in modules.items()}


def _merge_lora_modules(parameter: object, multi_lora: Path) -> dict[str, str]:
    modules = EngineConfig(lora_modules=parameter, enable_lora=True).lora_modules if parameter else {}
    from_file = read_multi_lora(multi_lora)
    both = sorted(set(modules) & set(from_file))
    if both:
        raise ConfigError(f"adapter(s) {both} are named both in multi_lora.json and in the lora_modules parameter")
    return {**modules, **from_file}


def _parse(name: str, raw: str, kind: type) -> object:
    try:
        return parse_scalar(raw, kind)
    except ValueError:
        article = "an" if kind is int else "a"
        raise ConfigError(
            f"config.pbtxt parameter {name}={raw!r} is invalid: must be {article} {type_name(kind)}"
        ) from None


class ResponseWriter:
    """Turns one request's engine outputs into Triton responses (called from the responder thread only).

    Streaming sends the first non-empty text delta at once, then one once `stream_interval` tokens have
    gathered since the last response, and never an empty intermediate response; the final response carries
    whatever is left (possibly "") and the FINAL flag. Non-streaming sends one response with the whole text.
    Optional outputs are per-response deltas, as in the vLLM backend.
    """

    def __init__(
        self,
        request,
        req: DecodedRequest,
        tokenizer,
        metrics: TritonMetrics | None,
        arrival: float,
        stream_interval: int = 1,
    ):
        self.request = request  # keep the Triton request alive until its final response
        self.stream_interval = stream_interval
        self._sent = False
        self.sender = request.get_response_sender()
        self.req = req
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.done = False
        self._text: list[str] = []
        self._num_tokens = 0
        self._token_ids: list[int] = []
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
        self._token_ids += out.new_token_ids
        self._logprobs += out.new_logprobs or []
        if out.finished:
            self._send(out, final=True)
            self._observe(out, now)
        elif self.req.stream and out.new_text and (not self._sent or self._num_tokens >= self.stream_interval):
            self._send(out, final=False)

    def on_error(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.sender.send(error_response(kind, message, field), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.request = None

    def _send(self, out: RequestOutput, final: bool) -> None:
        text = "".join(self._text)
        if final and self.req.prepend_prompt:
            text = self.req.prompt + text
        delta = ResponseDelta(
            text=text,
            finish_reason=(out.finish_reason or "") if final else "",
            cumulative_logprob=out.cumulative_logprob,
            logprobs=self._logprobs if self.req.params.logprobs is not None else None,
            num_input_tokens=len(out.prompt_token_ids),
            num_output_tokens=self._num_tokens,
            num_cached_tokens=out.num_cached_tokens,
            token_ids=self._token_ids,
        )
        response = encode_response(delta, self.req.returns, self._decode_token)
        self._text, self._num_tokens, self._token_ids, self._logprobs = [], 0, [], []
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(response, flags=flags)
        self._sent = True
        if final:  # only once it went out: if send raised, on_error still owes the client a final response
            self.done = True
            self.request = None

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
    # "module:Class" of the engine the core process builds (tests name one with injected faults).
    engine_class = "inflight.engine.engine:LLMEngine"

    def initialize(self, args: dict) -> None:
        log_setup()
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError("config.pbtxt must set model_transaction_policy { decoupled: true }")
        parameters = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        multi_lora = Path(args["model_repository"]) / str(args["model_version"]) / "multi_lora.json"
        settings = ServerSettings.from_parameters(parameters, multi_lora if multi_lora.is_file() else None)
        log.info("loading %s with %s", settings.model_dir, settings.engine_config)
        self.stream_interval = settings.stream_interval
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = _make_metrics(labels)
        on_iteration = self.metrics.update if self.metrics is not None else None  # (state, counts)
        self.model_name = args["model_name"]
        health = health_model_name(self.model_name, settings.health_model)
        self.health = HealthModel(pb_utils, self.model_name, health) if health else None
        spec = CoreSpec(settings.model_dir, settings.engine_config, self.engine_class, settings.step_log)
        self.loop = EngineLoop(
            spec,
            on_iteration,
            on_broken=self._on_broken,
            on_core_start=self._on_core_start,
            on_unavailable=self._on_unavailable,
        ).start()
        self.tokenizer = self.loop.tokenizer  # the front's own: prompts and logprob text
        self._ids = itertools.count()
        info = self.loop.info
        log.info(
            "engine ready: dtype=%s, max_model_len=%d, %d KV blocks of %d tokens (engine core process %d)",
            info.dtype,
            info.max_model_len,
            info.num_kv_blocks,
            info.block_size,
            info.pid,
        )
        if self.health is not None:
            self.health.initialized()

    def execute(self, requests: list) -> None:
        cfg = self.loop.spec.config
        for request in requests:
            arrival = time.monotonic()
            if pb_utils.get_input_tensor_by_name(request, "lora_admin") is not None:
                self._lora_admin(request)
                continue
            try:
                decoded = decode_request(request, cfg.max_sampling_parameters_bytes, cfg.max_json_depth)
                self.loop.check_params(decoded.params)
                # Tokenized here, on Triton's thread: the engine core only computes.
                if decoded.prompt_token_ids is not None:
                    prompt_token_ids = decoded.prompt_token_ids  # the engine checks length and vocabulary
                else:
                    prompt_token_ids = self.loop.tokenize(decoded.prompt)
            except InvalidRequestError as e:
                self._reject(request, e.kind, str(e), e.field)
                continue
            except Exception as e:  # a decoding bug must not take down the whole batch of requests
                log.exception("decoding a request failed")
                self._reject(request, ErrorKind.INTERNAL, f"could not decode the request: {e!r}")
                continue
            writer = ResponseWriter(request, decoded, self.tokenizer, self.metrics, arrival, self.stream_interval)
            request_id = f"{next(self._ids)}-{request.request_id()}"
            self.loop.submit(
                Submission(
                    request_id, prompt_token_ids, decoded.params, writer, decoded.priority, arrival, decoded.lora_name
                )
            )
        return None

    def _lora_admin(self, request) -> None:
        """`lora_admin` (JSON): {"action": "list"} answers the adapters a request may name; "load" (with
        "lora_name", "lora_path") and "unload" (with "lora_name") need "key" = the server's LoRA admin key
        (INFLIGHT_LORA_ADMIN_KEY, set by the launcher: the OpenAI API's load/unload endpoints hold it)."""
        sender = request.get_response_sender()
        try:
            body = lora_admin_request(request, os.environ.get(LORA_ADMIN_KEY_ENV))
        except InvalidRequestError as e:
            self._reject(request, e.kind, str(e), e.field)
            return
        if body["action"] == "list":
            text = json.dumps({"lora_names": self.loop.lora_names()})
            sender.send(admin_response(text), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        message = LoRAAdmin(f"{next(self._ids)}-lora", body["action"], body["lora_name"], body.get("lora_path"))
        self.loop.lora_admin(message, _AdminWriter(request, sender, message))

    def _on_core_start(self, ready) -> None:
        if self.metrics is not None:
            self.metrics.core_started(ready)
        if self.health is not None:
            self.health.serving()  # loaded once this model is READY (at start: once the server runs)

    def _on_unavailable(self, reason: str) -> None:
        """The engine stopped serving: the readiness probe turns false before the requests in flight are failed
        (bounded: a stuck unload must not keep them waiting)."""
        if self.health is not None and not self.health.unavailable(wait_s=2.0):
            log.warning("%r is still loaded 2 s after the engine stopped serving", self.health.name)

    def _on_broken(self, reason: str) -> None:
        """The engine cannot serve again: unload the model so that Triton reports it not ready (a load
        balancer then routes elsewhere). 2.51's Python backend has no other way for a model to change its
        readiness; unloading needs --model-control-mode=explicit, which the launcher sets. From its own
        thread: unload calls finalize(), which joins the responder thread that calls us."""

        def unload() -> None:
            try:
                pb_utils.unload_model(self.model_name)
            except Exception as e:  # e.g. the server runs with --model-control-mode=none
                log.error("could not unload the broken model %r (it stays READY): %s", self.model_name, e)

        log.error("the engine is broken (%s); unloading %r so that it reports not ready", reason, self.model_name)
        threading.Thread(target=unload, name="inflight-unload", daemon=True).start()

    @staticmethod
    def _reject(request, kind: ErrorKind, message: str, field: str | None = None) -> None:
        request.get_response_sender().send(
            error_response(kind, message, field), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def finalize(self) -> None:
        started = time.monotonic()
        log.info("unloading: stopping the engine")
        health = getattr(self, "health", None)
        if health is not None and not health.stop(wait_s=10.0):
            log.warning("the readiness companion's thread is still in a Triton call after 10 s")
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.stop(timeout_s=10.0):
            log.warning("the responder thread is still busy after 10 s; leaving it behind")
        log.info("engine stopped in %.1f s", time.monotonic() - started)


class _AdminWriter:
    """A LoRA admin request's one response: {"lora_name", "action", "status": "ok"}, or the core's refusal."""

    def __init__(self, request, sender, message: LoRAAdmin) -> None:
        self.request, self.sender, self.message = request, sender, message  # the request lives until answered

    def is_cancelled(self) -> bool:
        return False

    def on_output(self, out: RequestOutput) -> None:
        if out.finished:
            text = json.dumps({"lora_name": self.message.lora_name, "action": self.message.action, "status": "ok"})
            self.sender.send(admin_response(text), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def on_error(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        self.sender.send(error_response(kind, message, field), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _make_metrics(labels: dict[str, str]) -> TritonMetrics | None:
    try:
        return TritonMetrics(pb_utils, labels)
    except pb_utils.TritonModelException as e:  # the server runs with --allow-metrics=false
        log.warning("metrics disabled: %s", e)
        return None
