"""Engine arguments: what a user tunes (the checkpoint's own architecture is `inflight.models.config`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCHEDULING_POLICIES = ("continuous", "static")
KV_RESERVATIONS = ("paged", "max_length")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
WEIGHT_FORMATS = ("auto", "packed", "dequantized")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed values of max_lora_rank


class ConfigError(ValueError):
    """A bad engine argument or checkpoint: the message names the field or file."""


def _default_kv_bytes() -> int:
    # A quarter of RAM, capped at 4 GiB: the CPU has to hold weights, activations and the OS too.
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    return min(ram // 4, 4 << 30)


def cpu_bf16_feature() -> str | None:
    """The CPU feature that makes bf16 pay on this machine (AMX or AVX512-BF16 GEMMs), or None.

    With either, the GEMMs run bf16 natively (our own with AVX512-BF16, oneDNN's elsewhere) and faster than fp32.
    Without them bf16 is emulated through fp32 conversions and is slower than plain fp32.
    """
    caps = torch.cpu.get_capabilities()  # cpuinfo's CPUID flags: /proc/cpuinfo's amx_bf16, avx512_bf16
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if caps.get(flag)), None)


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


SPEC_METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16  # a verification chunk of k+1 tokens; more costs compute that is rarely accepted
MAX_PROMPT_LOOKUP = 64
MAX_SUFFIX_TREE_DEPTH = 64  # proposing costs up to this many token comparisons per occurrence
MAX_SUFFIX_CACHED_REQUESTS = 1 << 20
# vLLM's defaults for method "suffix"; the fields stay None with method "ngram"
SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}


@dataclass
class SpeculativeConfig:
    """Draft-free speculative decoding (vLLM's `speculative_config` names).

    ngram: `prompt_lookup_min/max` default to each other, both to 5 when neither is given (as vLLM).
    suffix: drafts from the request's own tokens and earlier requests' outputs (spec_decode/suffix.py);
    `num_speculative_tokens` is the longest draft, min(suffix_decoding_max_tree_depth, 16) when not given
    (vLLM: the tree depth); the `suffix_decoding_*` fields take vLLM's defaults.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Suffix decoding: the depth of its trees (a match plus its draft), how many finished requests' outputs
    # the global cache keeps (0: none, FIFO beyond), the longest draft per matched token, and the least
    # estimated probability of a draft token.
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    # No drafts while more than this many sequences run: a large step is compute-bound, drafts cost more
    # than they save there.
    disable_by_batch_size: int = 16

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(f"speculative_config.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        if self.method not in SPEC_METHODS:
            raise bad("method", " or ".join(repr(m) for m in SPEC_METHODS))
        ints = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests")  # fmt: skip
        for name in ints:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(name, "an integer")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise bad(name, "a number")
        other = ("prompt_lookup_max", "prompt_lookup_min") if self.method == "suffix" else tuple(SUFFIX_DEFAULTS)
        for name in other:
            if getattr(self, name) is not None:
                raise bad(name, f"unset with method {self.method!r}: it belongs to the other method")
        if self.method == "suffix":
            self._check_suffix(bad)
        else:
            self._check_ngram(bad)
        if self.disable_by_batch_size < 1:
            raise bad("disable_by_batch_size", ">= 1")

    def _check_ngram(self, bad: Callable[[str, str], ConfigError]) -> None:
        if self.num_speculative_tokens is None:
            raise ConfigError("speculative_config.num_speculative_tokens is required")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None and not 1 <= getattr(self, name) <= MAX_PROMPT_LOOKUP:
                raise bad(name, f"in [1, {MAX_PROMPT_LOOKUP}]")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"<= prompt_lookup_max={self.prompt_lookup_max}")

    def _check_suffix(self, bad: Callable[[str, str], ConfigError]) -> None:
        for name, default in SUFFIX_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if not 1 <= self.suffix_decoding_max_tree_depth <= MAX_SUFFIX_TREE_DEPTH:
            raise bad("suffix_decoding_max_tree_depth", f"in [1, {MAX_SUFFIX_TREE_DEPTH}]")
        if not 0 <= self.suffix_decoding_max_cached_requests <= MAX_SUFFIX_CACHED_REQUESTS:
            raise bad("suffix_decoding_max_cached_requests", f"in [0, {MAX_SUFFIX_CACHED_REQUESTS}]")
        if not 0 <= self.suffix_decoding_max_spec_factor < float("inf"):
            raise bad("suffix_decoding_max_spec_factor", ">= 0 and finite")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise bad("suffix_decoding_min_token_prob", "in [0, 1]")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(self.suffix_decoding_max_tree_depth, MAX_SPECULATIVE_TOKENS)
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"in [1, {MAX_SPECULATIVE_TOKENS}]")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the CLI flag, the config.pbtxt parameter); None, "" or {} is off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", {f.name for f in fields(cls)})
        if not value:
            return None
        return cls(**value)


def json_object(value: dict[str, Any] | str | None, name: str, known: set[str]) -> dict[str, Any] | None:
    """An engine argument given as a dict or its JSON text (a flag, a config.pbtxt parameter), its keys
    checked against `known`; None for None or blank text."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON ({e}): {value[:200]!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object (a dict), not {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name} has unknown key(s) {unknown}; known: {', '.join(sorted(known))}")
    return value


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `kv_events_config` names: `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    "tcp://*:5557", "topic": ""}`. Off unless `enable_kv_cache_events`."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict | None) -> KVEventsConfig:
        known = {f.name for f in fields(cls)}
        config = cls(**(json_object(value, "kv_events_config", known) or {}))
        if config.publisher not in ("zmq", "null"):
            raise ConfigError(f"kv_events_config.publisher={config.publisher!r} is invalid: must be zmq or null")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit capacity; overrides the memory budget
    kv_cache_memory_bytes: int | None = None  # CPU budget (default: min(RAM/4, 4 GiB))
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    dtype: str = "auto"  # auto = checkpoint dtype on GPU; on CPU bfloat16 with AMX / AVX512-BF16, else float32
    device: str = "auto"
    # GGUF files: keep quantized weights as the file's blocks (packed), dequantize them at load, or auto: packed
    # where a kernel computes the format on this device (the start-up log says which)
    weight_format: str = "auto"
    scheduling_policy: str = "continuous"
    kv_reservation: str = "paged"
    attention_backend: str = "auto"
    enforce_eager: bool = False  # GPU: launch every step's kernels from Python instead of replaying CUDA graphs
    # Ranks one model is split over (vLLM's name): GPUs from `device` on, or processes sharing this host's cores
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (hashed full blocks)
    seed: int = 0  # draws the seeds of requests that bring none
    # vLLM's kv_events_config (a dict or its JSON text): publish the prefix cache's changes for KV-aware routers
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    # Speculative decoding (off when None): a dict or its JSON text, held as a SpeculativeConfig once checked.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Multi-LoRA (vLLM's names): adapters resident at once in the device's slots (LRU), their largest rank,
    # adapters kept read in host memory (LRU; default max_loras), and the adapters known at start-up: name ->
    # PEFT adapter directory (Triton's multi_lora.json), a dict or its JSON text.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | str | None = None
    # Bounds on what one request may cost (errors name the field and the limit).
    max_logprobs: int = 20  # most top logprobs per token a request may ask for (vLLM's default)
    max_stop_strings: int = 64
    max_logit_bias: int = 1024  # entries of a request's logit_bias
    max_stop_str_len: int = 1024  # characters; the detokenizer holds back max_stop_str_len - 1 at most
    max_prompt_bytes: int | None = None  # UTF-8 bytes; default: 16 per token of max_model_len
    max_sampling_parameters_bytes: int = 256 << 10  # the sampling_parameters JSON text
    max_json_depth: int = 64  # nesting of the sampling_parameters JSON (a JSON schema nests ~2 per level)
    # Structured outputs: a constraint's complexity before compiling (its text's bytes, its nesting), the bytes
    # the cached compiled grammars may hold, and the engine time one request's grammar matcher (bitmask fill +
    # accept) may take for one token and in all.
    max_grammar_spec_bytes: int = 64 << 10
    max_grammar_depth: int = 32
    max_grammar_cache_bytes: int = 256 << 20
    max_grammar_step_time_s: float = 0.2
    max_grammar_time_s: float = 5.0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1")
        check(self.block_size in (8, 16, 32, 64, 128), "block_size", "one of 8, 16, 32, 64, 128")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1")
        check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes",
            "> 0",
        )
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1")
        check(self.dtype in ("auto", *DTYPES), "dtype", f"one of auto, {', '.join(DTYPES)}")
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", " or ".join(SCHEDULING_POLICIES))
        check(self.kv_reservation in KV_RESERVATIONS, "kv_reservation", " or ".join(KV_RESERVATIONS))
        for name in (
            "max_stop_strings",
            "max_stop_str_len",
            "max_sampling_parameters_bytes",
            "max_json_depth",
            "max_grammar_spec_bytes",
            "max_grammar_depth",
            "max_grammar_cache_bytes",
        ):
            check(getattr(self, name) >= 1, name, ">= 1")
        for name in ("max_grammar_step_time_s", "max_grammar_time_s"):
            check(getattr(self, name) > 0, name, "> 0")
        check(self.max_logprobs >= 0, "max_logprobs", ">= 0")
        check(self.max_logit_bias >= 0, "max_logit_bias", ">= 0")
        check(self.max_prompt_bytes is None or self.max_prompt_bytes >= 1, "max_prompt_bytes", ">= 1")
        check(self.weight_format in WEIGHT_FORMATS, "weight_format", ", ".join(WEIGHT_FORMATS))
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", ", ".join(ATTENTION_BACKENDS))
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_lora(check)
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.attention_backend == "triton" and not self.device.startswith("cuda") and not _triton_interpreted():
            raise ConfigError(
                f"attention_backend='triton' needs a CUDA device (device={self.device!r}); use 'torch' or 'auto' "
                "on a CPU (the kernels run on a CPU only in tests, under TRITON_INTERPRET=1)"
            )
        if self.dtype != "auto":
            self._check_interpreted_dtype(DTYPES[self.dtype])
        if self.kv_cache_memory_bytes is None and self.num_kv_blocks is None and self.device == "cpu":
            self.kv_cache_memory_bytes = _default_kv_bytes()

    def _check_lora(self, check: Callable[[bool, str, str], None]) -> None:
        check(self.max_loras >= 1, "max_loras", ">= 1")
        check(self.max_lora_rank in LORA_RANKS, "max_lora_rank", f"one of {', '.join(map(str, LORA_RANKS))}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", f">= max_loras={self.max_loras}")
        modules = self.lora_modules
        if isinstance(modules, str):
            if not modules.strip():
                modules = None
            else:
                try:
                    modules = json.loads(modules)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"lora_modules is not valid JSON ({e}): {modules[:200]!r}") from None
        modules = modules or {}
        pairs = modules.items() if isinstance(modules, dict) else ()
        if not isinstance(modules, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
            raise ConfigError('lora_modules must map adapter names to adapter directories: {"name": "/path", ...}')
        if modules and not self.enable_lora:
            raise ConfigError(f"lora_modules names {len(modules)} adapter(s) but enable_lora is off")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"enable_lora with tensor_parallel_size={self.tensor_parallel_size} is not supported (adapters are not "
                "split across ranks): use tensor_parallel_size=1, or turn enable_lora off"
            )
        self.lora_modules = modules

    def _check_interpreted_dtype(self, dtype: torch.dtype) -> None:
        # The Triton interpreter computes bf16 through numpy, which has no bf16: the results are garbage.
        if dtype == torch.bfloat16 and self.resolved_attention_backend() == "triton" and _triton_interpreted():
            raise ConfigError(
                "attention_backend='triton' cannot run bfloat16 under TRITON_INTERPRET=1 (the interpreter's bf16 "
                "arithmetic is wrong): pass dtype='float32' or 'float16', or attention_backend='torch' (the CPU ops)"
            )

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        return self.resolve_dtype(checkpoint_dtype)[0]

    def resolve_dtype(
        self, checkpoint_dtype: torch.dtype, bf16_speedup: Callable[[], float | None] | None = None
    ) -> tuple[torch.dtype, str]:
        """The dtype the engine runs in, and why (for the startup log). On a CPU with native bf16, `auto`
        follows `bf16_speedup()` (fp32 time ÷ bf16 time of the model's GEMMs here) where it is given."""
        dtype, why = self._resolve_dtype(checkpoint_dtype, bf16_speedup)
        self._check_interpreted_dtype(dtype)
        return dtype, why

    def _resolve_dtype(
        self, checkpoint_dtype: torch.dtype, bf16_speedup: Callable[[], float | None] | None
    ) -> tuple[torch.dtype, str]:
        if self.dtype != "auto":
            return DTYPES[self.dtype], "set explicitly"
        if torch.device(self.device).type != "cpu":
            return checkpoint_dtype, "auto: the checkpoint's dtype on an accelerator"
        feature = cpu_bf16_feature()
        if feature is None:
            return torch.float32, "auto: this CPU has neither amx_bf16 nor avx512_bf16"
        speedup = bf16_speedup() if bf16_speedup is not None else None
        if speedup is None:
            return torch.bfloat16, f"auto: this CPU has {feature}"
        if speedup >= 1.0:
            return torch.bfloat16, f"auto: this CPU has {feature}, and bf16 GEMMs ran {speedup:.2f}x fp32's speed here"
        return torch.float32, f"auto: this CPU has {feature}, but bf16 GEMMs ran only {speedup:.2f}x fp32's speed here"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"
