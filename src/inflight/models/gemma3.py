"""Gemma 3 text models (`Gemma3ForCausalLM`) on the Llama family's attention and MLP modules.

What Gemma changes, as HF's modeling_gemma3.py computes it: embeddings scaled by sqrt(hidden); RMSNorm scales by
(1 + w); four norms a layer (each sublayer's output is normed before it joins the residual stream); a GeGLU MLP;
per-head q/k norms; attention scaled by `query_pre_attn_scalar ** -0.5`; local layers attend within a sliding
window with their own RoPE base, global layers see the whole context with the global base (and its linear
scaling); logits soft-capped by `final_logit_softcapping`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inflight.config import ConfigError
from inflight.models.config import ModelConfig
from inflight.models.llama import MLP, Attention, RMSNormWeight, StepMetadata, _with_lora
from inflight.models.parallel import (
    SINGLE,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)

LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    factor: float  # linear scaling: positions divided by it (1: none)


@dataclass(frozen=True)
class Gemma3Config:
    """What Gemma 3's config.json adds to the Llama fields (read from `hf_config`)."""

    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    layer_types: tuple[str, ...]  # LOCAL or GLOBAL per layer
    rope: dict[str, RopeSpec]  # per layer kind

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> Gemma3Config:
        hf, arch = cfg.hf_config, cfg.architecture
        if hf.get("attn_logit_softcapping") is not None:
            raise ConfigError(f"{arch}: attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported")
        if hf.get("use_bidirectional_attention"):
            raise ConfigError(f"{arch}: use_bidirectional_attention=true is not supported (causal attention only)")
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"{arch}: hidden_activation={act!r} is not supported; supported: gelu_pytorch_tanh")
        types = tuple(hf.get("layer_types") or ())
        if len(types) != cfg.num_hidden_layers or not set(types) <= {LOCAL, GLOBAL}:
            raise ConfigError(
                f"{arch}: layer_types={list(types)} must name {LOCAL!r} or {GLOBAL!r} for each of the "
                f"{cfg.num_hidden_layers} layers"
            )
        cap = hf.get("final_logit_softcapping")
        return cls(
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=float(cap) if cap else None,
            layer_types=types,
            rope={kind: _rope_spec(hf, kind, arch) for kind in (LOCAL, GLOBAL)},
        )


def _rope_spec(hf: dict[str, Any], kind: str, arch: str) -> RopeSpec:
    """HF5 nests each kind's parameters under `rope_parameters`; older configs give the global base as
    `rope_theta` (scaled by `rope_scaling`) and the local one as `rope_local_base_freq`."""
    nested = hf.get("rope_parameters") or {}
    if nested.get("rope_type"):  # one flat set: the global layers'
        nested = {GLOBAL: nested}
    params = dict(nested.get(kind) or {})
    field = f"rope_parameters[{kind!r}]"
    if kind == GLOBAL and hf.get("rope_scaling"):
        params.update(hf["rope_scaling"])
        field = "rope_scaling"
    default_theta = hf.get("rope_theta", 1e6) if kind == GLOBAL else hf.get("rope_local_base_freq", 1e4)
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{arch}: {field} partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    if rope_type == "default":
        return RopeSpec(theta, 1.0)
    if rope_type == "linear":
        return RopeSpec(theta, float(params["factor"]))
    raise ConfigError(f"{arch}: {field} rope_type={rope_type!r} is not supported; supported: default, linear")


class Gemma3Attention(Attention):
    """Llama's attention (its per-head q/k norm path, the layer's sliding window) with Gemma's scale; `kind`
    picks the layer's RoPE table."""

    def __init__(self, cfg: ModelConfig, gemma: Gemma3Config, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, layer, tp)
        d = cfg.head_dim
        self.q_norm = RMSNormWeight(d, cfg.rms_norm_eps)
        self.k_norm = RMSNormWeight(d, cfg.rms_norm_eps)
        self.qk_norm = "head"
        if cfg.attention_bias:  # Gemma's o_proj follows attention_bias too
            columns = tp.split(cfg.num_attention_heads * d)
            self.o_proj = RowParallelLinear(columns, cfg.hidden_size, bias=True, tp=tp)
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.kind = gemma.layer_types[layer]


class GeGLU(MLP):
    """Llama's MLP module with gelu (tanh approximation) on the gate in place of silu."""

    def forward(self, x: torch.Tensor, meta: StepMetadata, ops: Any) -> torch.Tensor:
        act = ops.gelu_tanh_and_mul(_with_lora(self.gate_up_proj(x), x, self.gate_up_lora, meta, ops))
        return self.tp.all_reduce(_with_lora(self.down_proj(act), act, self.down_lora, meta, ops))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, gemma: Gemma3Config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, gemma, layer, tp)
        self.mlp = GeGLU(cfg, tp=tp)
        self.input_layernorm = RMSNormWeight(h, eps)
        self.post_attention_layernorm = RMSNormWeight(h, eps)
        self.pre_feedforward_layernorm = RMSNormWeight(h, eps)
        self.post_feedforward_layernorm = RMSNormWeight(h, eps)


class Gemma3Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, gemma: Gemma3Config, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, gemma, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(nn.Module):
    """`LlamaForCausalLM`'s interface (forward, compute_logits, init_rope, fuse_projections, tp) for Gemma 3."""

    supports_tensor_parallel = True

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.gemma = Gemma3Config.from_model_config(cfg)
        self.model = Gemma3Backbone(cfg, self.gemma, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.norm_scales_ready = False

    def fuse_projections(self) -> None:
        """Called once the HF-named weights are loaded: fuses q/k/v and gate/up, and stores every norm's weight
        as its scale 1 + w, so the backends' rms_norm ops compute Gemma's norm. In fp32 that is HF's computation
        as is; in bf16, 1 + w is rounded to bf16 and the normalised x is rounded before the multiply, where
        HF multiplies both in fp32 and rounds once."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.norm_scales_ready:
            return
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNormWeight):
                    module.weight.copy_(module.weight.float() + 1.0)
        self.norm_scales_ready = True

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        d = self.cfg.head_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        for kind, spec in self.gemma.rope.items():
            inv_freq = 1.0 / (spec.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)) / spec.factor
            freqs = torch.outer(positions, inv_freq)
            self.cos_sin[kind] = (freqs.cos().to(device), freqs.sin().to(device))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: StepMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: Any,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        h = h * embed_scale(self.cfg.hidden_size, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            ln = layer.input_layernorm
            if residual is None:
                residual, x = h, ops.rms_norm(h, ln.weight, ln.eps)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, ln.weight, ln.eps)
            attn = layer.self_attn
            x = attn(x, positions, meta, kv_cache, self.cos_sin[attn.kind], ops)
            x = ops.rms_norm(x, layer.post_attention_layernorm.weight, ln.eps)
            x, residual = ops.fused_add_rms_norm(x, residual, layer.pre_feedforward_layernorm.weight, ln.eps)
            x = layer.mlp(x, meta, ops)
            h = ops.rms_norm(x, layer.post_feedforward_layernorm.weight, ln.eps)
        h, _ = ops.fused_add_rms_norm(h, residual, self.model.norm.weight, self.model.norm.eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_logits(self.lm_head(hidden), self.cfg.vocab_size)
        if logits is None:  # a tensor-parallel worker rank: rank 0 has them
            return None
        cap = self.gemma.final_logit_softcapping
        if cap:  # in the activations' dtype, as HF does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


@functools.cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to the activations' dtype, as HF multiplies it (55.4256 is 55.5 in bf16)."""
    return float(torch.tensor(math.sqrt(hidden_size), dtype=torch.float32).to(dtype))
