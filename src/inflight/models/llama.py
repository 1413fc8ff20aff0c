"""The Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with per-head q/k norm), and the decoder the
Mixture-of-Experts families share (models/moe.py gives each layer its own MLP).

Module names mirror the HF checkpoints so loading is a strict name-for-name copy; after loading,
`fuse_projections` stacks q/k/v and gate/up into one GEMM each (fewer, bigger ops). Every op that
touches the paged cache, norms or RoPE goes through the attention backend (`ops`), the one seam
between the torch reference and the Triton kernels. Built with a `tp` (models/parallel.py), each rank holds
its heads and MLP columns, and the layers' outputs are all-reduced; at one rank nothing differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from inflight.models.config import ModelConfig
from inflight.models.lora import LoRASlots
from inflight.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    TensorParallel,
    VocabParallelEmbedding,
)


class StepMetadata(Protocol):
    """What a layer reads of the executor's AttentionMetadata; the rest it hands on to the backend's ops."""

    slot_mapping: torch.Tensor  # [T] int64: the cache slot of each new token's K/V
    token_lora_slots: torch.Tensor | None  # [T] int32: each token's adapter slot (-1: none); None: no adapter


class RMSNormWeight(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        windows = cfg.layer_sliding_windows
        self.sliding_window = windows[layer] if windows else None  # keys older than this many tokens are masked
        h, d = cfg.hidden_size, cfg.head_dim
        # This rank's heads: its rows of q/k/v and its columns of o_proj
        self.num_heads, self.head_dim = cfg.num_attention_heads // tp.size, d
        self.num_kv_heads, first_kv_head = tp.kv_heads(cfg.num_key_value_heads)
        q_rows = tp.split(cfg.num_attention_heads * d)
        kv_rows = Shard(0, first_kv_head * d, self.num_kv_heads * d, cfg.num_key_value_heads * d)
        self.q_proj = ColumnParallelLinear(h, q_rows, bias=cfg.attention_bias)
        self.k_proj = ColumnParallelLinear(h, kv_rows, bias=cfg.attention_bias)
        self.v_proj = ColumnParallelLinear(h, kv_rows, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(q_rows, h, bias=False, tp=tp)
        self.tp = tp
        if cfg.qk_norm:  # per head, or over the whole q and k projections (OLMoE)
            whole = cfg.qk_norm == "projection"
            self.q_norm = RMSNormWeight(self.num_heads * d if whole else d, cfg.rms_norm_eps)
            self.k_norm = RMSNormWeight(self.num_kv_heads * d if whole else d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = d**-0.5
        # Adapter slots of the fused projections (models/lora.py), set where LoRA is enabled
        self.qkv_lora: LoRASlots | None = None
        self.o_lora: LoRASlots | None = None

    def fuse(self) -> None:
        """q/k/v as one [Hq + 2 Hkv] * D projection: one GEMM reads x once (vLLM's QKVParallelLinear)."""
        if hasattr(self, "qkv_proj"):  # built fused from a file's blocks (models/quantized.py)
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_proj = _stacked(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, positions, meta, kv_cache, cos_sin, ops) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = _with_lora(self.qkv_proj(x), x, self.qkv_lora, meta, ops)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        if self.qk_norm == "projection":
            q = ops.rms_norm(q.contiguous(), self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k.contiguous(), self.k_norm.weight, self.k_norm.eps)
        q, k, v = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        if self.qk_norm == "head":
            q = ops.rms_norm(q.reshape(-1, d), self.q_norm.weight, self.q_norm.eps).view(t, -1, d)
            k = ops.rms_norm(k.reshape(-1, d), self.k_norm.weight, self.k_norm.eps).view(t, -1, d)
        q, k = ops.rope(q, k, positions, cos_sin)
        k_cache, v_cache = kv_cache
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.sliding_window is None:
            out = ops.attention(q, k_cache, v_cache, meta, self.scale, key=k, value=v)
        else:
            out = ops.attention(
                q, k_cache, v_cache, meta, self.scale, key=k, value=v, sliding_window=self.sliding_window
            )
        out = out.reshape(t, self.num_heads * d)
        return self.tp.all_reduce(_with_lora(self.o_proj(out), out, self.o_lora, meta, ops))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        columns = tp.split(i)  # this rank's share of the MLP's width
        self.gate_proj = ColumnParallelLinear(h, columns, bias=False)
        self.up_proj = ColumnParallelLinear(h, columns, bias=False)
        self.down_proj = RowParallelLinear(columns, h, bias=False, tp=tp)
        self.tp = tp
        self.gate_up_lora: LoRASlots | None = None
        self.down_lora: LoRASlots | None = None

    def fuse(self) -> None:
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = _stacked((self.gate_proj, self.up_proj))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, meta: StepMetadata, ops: Any) -> torch.Tensor:
        act = ops.silu_and_mul(_with_lora(self.gate_up_proj(x), x, self.gate_up_lora, meta, ops))
        return self.tp.all_reduce(_with_lora(self.down_proj(act), act, self.down_lora, meta, ops))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(
        self, cfg: ModelConfig, make_mlp: Callable[[ModelConfig, int], nn.Module], tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        layers = (DecoderLayer(cfg, i, make_mlp(cfg, i), tp) for i in range(cfg.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    supports_tensor_parallel = True

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.model = Backbone(cfg, self.make_mlp, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s MLP (a dense SwiGLU here; an MoE family's router and experts)."""
        return MLP(cfg, tp=self.tp)

    def fuse_projections(self) -> None:
        """Called once the HF-named weights are loaded; forward runs the fused layout only."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos_sin = (freqs.cos().to(device), freqs.sin().to(device))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: StepMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ops: Any,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            ln = layer.input_layernorm
            if residual is None:
                residual, x = h, ops.rms_norm(h, ln.weight, ln.eps)
            else:
                x, residual = ops.fused_add_rms_norm(h, residual, ln.weight, ln.eps)
            x = layer.self_attn(x, positions, meta, kv_cache, self.cos_sin, ops)
            ln = layer.post_attention_layernorm
            x, residual = ops.fused_add_rms_norm(x, residual, ln.weight, ln.eps)
            h = layer.mlp(x, meta, ops)
        h, _ = ops.fused_add_rms_norm(h, residual, self.model.norm.weight, self.model.norm.eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, V] float32 logits (on rank 0; None on the other ranks of a tensor-parallel group)."""
        return self.tp.gather_logits(self.lm_head(hidden).float(), self.cfg.vocab_size)


def _with_lora(y: torch.Tensor, x: torch.Tensor, lora: LoRASlots | None, meta: StepMetadata, ops: Any) -> torch.Tensor:
    """The base linear's output `y` plus its adapters' deltas for the rows that have one (in place)."""
    if lora is not None and meta.token_lora_slots is not None:
        ops.lora_apply(y, x, lora, meta.token_lora_slots)
    return y


def _stacked(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One Linear whose output rows are the parts' rows, in order (biases likewise)."""
    w = parts[0].weight
    with torch.device("meta"):  # parameters come from the parts; no init of a throwaway weight
        fused = nn.Linear(w.shape[1], sum(p.out_features for p in parts), bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between (as HF does).
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
