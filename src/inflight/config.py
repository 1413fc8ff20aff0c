"""Engine arguments (what a user tunes) and the model's architecture (what a checkpoint says)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCHEDULING_POLICIES = ("continuous", "static")
KV_RESERVATIONS = ("paged", "max_length")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


class ConfigError(ValueError):
    """A bad engine argument or checkpoint: the message names the field or file."""


def _default_kv_bytes() -> int:
    # A quarter of RAM, capped at 4 GiB: the CPU has to hold weights, activations and the OS too.
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    return min(ram // 4, 4 << 30)


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit capacity; overrides the memory budget
    kv_cache_memory_bytes: int | None = None  # CPU budget (default: min(RAM/4, 4 GiB))
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    dtype: str = "auto"  # auto = checkpoint dtype on GPU, float32 on CPU
    device: str = "auto"
    scheduling_policy: str = "continuous"
    kv_reservation: str = "paged"
    attention_backend: str = "auto"
    seed: int = 0  # draws the seeds of requests that bring none

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be {allowed}")

        check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
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
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", ", ".join(ATTENTION_BACKENDS))
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kv_cache_memory_bytes is None and self.num_kv_blocks is None and self.device == "cpu":
            self.kv_cache_memory_bytes = _default_kv_bytes()

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return checkpoint_dtype if self.device != "cpu" else torch.float32

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: missing (a model directory needs config.json, *.safetensors, tokenizer.json)")
        return cls.from_hf_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: architectures={archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("default", None):
            rope_scaling = None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "llama3":
            raise ConfigError(f"{source}: rope_scaling={rope_scaling} is not supported; supported: llama3")
        eos = cfg.get("eos_token_id")
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=rope_scaling,
            torch_dtype=DTYPES.get(str(dtype_name), torch.float32),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )
