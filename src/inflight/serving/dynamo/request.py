"""Dynamo's preprocessed request (token ids, `sampling_options`, `stop_conditions`, `output_options`) ->
the `llm` model's `sampling_parameters`; the model's responses -> Dynamo's response chunks. Pure functions:
no Dynamo import, so the mapping is tested without Dynamo installed."""

from __future__ import annotations

from typing import Any

# Dynamo sampling option -> our SamplingParams field (same names as vLLM's).
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_STOP_KEYS = ("max_tokens", "min_tokens", "ignore_eos")


def sampling_parameters(request: dict[str, Any], default_max_tokens: int | None = None) -> dict[str, Any]:
    """The model's `sampling_parameters` for one Dynamo request. Stop strings stay with Dynamo (its
    backend decoder matches them on the detokenized stream, as for vLLM and SGLang workers), which also makes
    the text: the model sends token ids only (`detokenize` false). The hidden stop token ids (the model's EOS
    variants from its generation config) become `stop_token_ids`."""
    sampling = request.get("sampling_options") or {}
    stops = request.get("stop_conditions") or {}
    params: dict[str, Any] = {"detokenize": False}
    for key in _SAMPLING_KEYS:
        value = sampling.get(key)
        if value is not None:
            params[key] = value
    if (sampling.get("n") or 1) != 1:
        raise ValueError(f"n={sampling['n']} is not supported: the engine returns one sequence per request")
    for key in _STOP_KEYS:
        value = stops.get(key)
        if value is not None:
            params[key] = value
    if "max_tokens" not in params and default_max_tokens is not None:
        params["max_tokens"] = max(1, default_max_tokens - len(request.get("token_ids") or []))
    stop_ids = set(stops.get("stop_token_ids") or []) | set(stops.get("stop_token_ids_hidden") or [])
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    logprobs = (request.get("output_options") or {}).get("logprobs")
    if logprobs is not None:
        params["logprobs"] = int(logprobs)
    return params


def finish_reason(reason: str | None) -> str | None:
    """Ours (vLLM's: stop, length, abort) -> Dynamo's (stop, length, cancelled, error...)."""
    if reason is None or reason == "":
        return None
    if reason.startswith("abort") or reason == "cancelled":
        return "cancelled"
    return reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def router_endpoint(kv_events_config: str | dict | None) -> tuple[str, str] | None:
    """The (connect endpoint, topic) of a replica's KV-event PUB socket from its `kv_events_config`, or None
    when events are off. A wildcard bind ("tcp://*:5557") is reached on loopback: the worker runs beside its
    replica (the same host, or the same pod)."""
    import json

    if not kv_events_config:
        return None
    config = json.loads(kv_events_config) if isinstance(kv_events_config, str) else dict(kv_events_config)
    if not config.get("enable_kv_cache_events") or (config.get("publisher") or "zmq") != "zmq":
        return None
    endpoint = config.get("endpoint") or "tcp://*:5557"
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            endpoint = "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint, config.get("topic") or ""
