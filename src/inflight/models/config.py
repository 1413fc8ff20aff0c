"""ModelConfig: the architecture a checkpoint's config.json describes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inflight.config import DTYPES, ConfigError
from inflight.models.registry import supported_architectures

SUPPORTED_ARCHITECTURES = supported_architectures()
# RMSNorm of q and k: over each head (Qwen3, Qwen3-MoE) or over the whole projection (OLMoE)
QK_NORM = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "projection"}
# Families that read their RoPE (per layer kind, own scalings) from `hf_config` themselves
OWN_ROPE = ("Gemma3ForCausalLM",)


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
    qk_norm: str | None  # QK_NORM's kinds; None: no norm
    rope_scaling: dict[str, Any] | None = None
    # Tokens each position attends back to, where the checkpoint limits it (Mistral's `sliding_window`; Qwen's
    # only with `use_sliding_window`); None: the whole context. `layer_sliding_windows`: each layer's (None for
    # a layer with full attention).
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict)  # the whole config: a family reads its own fields
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, model: str | Path) -> ModelConfig:
        """From an HF directory's config.json or a GGUF file's metadata (a .gguf, or a directory holding one)."""
        from inflight.model_source import find_gguf, gguf_metadata

        with config_errors():
            gguf_file = find_gguf(model)
            if gguf_file is None:
                return cls.from_dir(model)
            return cls.from_hf_dict(gguf_metadata(gguf_file).hf_config(), source=str(gguf_file))

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

        cfg = _family_defaults(cfg, arch)
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None)
        if arch in OWN_ROPE:
            rope_scaling = None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("default", None):
            rope_scaling = None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "llama3":
            raise ConfigError(f"{source}: rope_scaling={rope_scaling} is not supported; supported: llama3")
        eos = cfg.get("eos_token_id")
        layers = need("num_hidden_layers")
        windows = _layer_windows(cfg, arch, layers)
        window = next((w for w in windows if w is not None), None)
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch.startswith("Qwen2")))),
            qk_norm=QK_NORM.get(arch),
            rope_scaling=rope_scaling,
            sliding_window=window,
            layer_sliding_windows=windows,
            hf_config=cfg,
            torch_dtype=DTYPES.get(str(dtype_name), torch.float32),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )


def _family_defaults(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 3's config.json may leave out fields whose HF defaults differ from the generic ones: tied
    embeddings, the window, and `layer_types` (every `sliding_window_pattern`-th layer global)."""
    if arch != "Gemma3ForCausalLM":
        return cfg
    cfg = {"tie_word_embeddings": True, "sliding_window": 4096, "head_dim": 256, **cfg}
    if not cfg.get("layer_types") and isinstance(cfg.get("num_hidden_layers"), int):
        pattern = cfg.get("sliding_window_pattern") or 6
        cfg["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])
        ]
    return cfg


def _layer_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's window as HF builds its masks: `layer_types` where the config lists them; else Mistral and
    Mixtral window every layer, and Qwen's only with `use_sliding_window`, from layer `max_window_layers` on."""
    window = cfg.get("sliding_window")
    if not window:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if arch.startswith("Qwen"):
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        first = cfg.get("max_window_layers", 28)  # HF Qwen2Config's default
        return tuple(int(window) if i >= first else None for i in range(layers))
    return (int(window),) * layers


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """A model source's error (inflight.model_source, torch-free) as the engine's ConfigError."""
    from inflight.model_source import ModelSourceError

    try:
        yield
    except ModelSourceError as e:
        raise ConfigError(str(e)) from None
