"""The Llama layer stack as one C++ call a step on CPU (`inflight.ops.cpu.llama_forward`): every op of every
layer inside one parallel region, the threads woken once a step instead of once an op. Mixture-of-Experts
models (`MoEForCausalLM` without a shared expert) run there too: the router and the grouped expert GEMM.

The ops are the same machine code as the per-op path (the C++ row and task functions are shared), so a step
gives the same bits either way (tested) and every row still sums in a fixed order whatever the batch or the
thread count. The per-op path stays for what this does not cover (a CPU without AVX-512 or AVX2 + FMA, bf16
without AVX512-BF16, fp16, a linear our GEMM does not run) and as the oracle.
"""

from __future__ import annotations

from typing import Any

import torch

from inflight.executor.attention import AttentionMetadata
from inflight.executor.attention.torch_backend import packed_experts, token_rows
from inflight.models.llama import LlamaForCausalLM
from inflight.models.moe import MoEForCausalLM, SparseMoeBlock
from inflight.models.packed_linear import PackedLinear
from inflight.models.quantized import QuantizedLinear
from inflight.ops import cpu


class CpuForward:
    """`LlamaForCausalLM.forward` (same arguments but `ops`, same result bits) as one C++ call a step."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cfg = model.cfg
        self.model = model
        self.dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps
        self.qk_eps = cfg.rms_norm_eps
        dtype = model.model.norm.weight.dtype
        empty = torch.empty(0, dtype=dtype)
        self.weights: list[torch.Tensor] = []
        # GGUF-quantized GEMMs: their slot holds an empty tensor, their segments go here, one table row each
        self.segments: list[torch.Tensor] = []
        table: list[tuple[int, int, int, int, int]] = []

        def gemm(linear: PackedLinear | QuantizedLinear, layer: int, slot: int) -> list[torch.Tensor]:
            bias = linear.bias if linear.bias is not None else empty
            if isinstance(linear, PackedLinear):
                return [linear.packed, bias]
            for s in linear.segments:
                self.segments.append(s.data)
                table.append((layer, slot, s.qtype, s.start, s.size))
            return [empty, bias]

        # MoE layers: (router, w13, w2 in the grouped GEMM's panels), three empty tensors for a dense MLP
        self.moe: list[torch.Tensor] = []
        self.top_k, self.renormalize = 0, False
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (empty, empty)
            if attn.qk_norm:
                self.qk_eps = attn.q_norm.eps
            self.weights += [layer.input_layernorm.weight, *gemm(attn.qkv_proj, i, 0), *norms]
            self.weights += [*gemm(attn.o_proj, i, 1), layer.post_attention_layernorm.weight]
            if isinstance(mlp, SparseMoeBlock):
                self.weights += [empty] * 4
                self.moe += [mlp.gate.weight, *packed_experts(mlp.experts)]
                self.top_k, self.renormalize = mlp.top_k, mlp.renormalize
            else:
                self.weights += [*gemm(mlp.gate_up_proj, i, 2), *gemm(mlp.down_proj, i, 3)]
                self.moe += [empty] * 3
        self.weights = [w.detach() for w in self.weights]
        self.moe = [w.detach() for w in self.moe] if self.top_k else []
        # Adapter slots (a, b, offsets) per layer and GEMM, three empty tensors where a linear has none: the
        # slots are written in place as adapters load, so these references stay current.
        no_lora = [torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.int64)]
        self.lora: list[torch.Tensor] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for slots in (
                attn.qkv_lora,
                attn.o_lora,
                getattr(mlp, "gate_up_lora", None),
                getattr(mlp, "down_lora", None),
            ):
                self.lora += no_lora if slots is None else [slots.a_t, slots.b_t, slots.offsets]
        self.segment_table = torch.tensor(table, dtype=torch.int64).reshape(-1, 5)
        self.kv_caches = [c for pair in kv_caches for c in pair]
        self.scale = cfg.head_dim**-0.5

    @staticmethod
    def supported(model: LlamaForCausalLM, ops: Any) -> bool:
        """True where every linear of the layer stack runs our GEMM (packed panels or GGUF blocks) and the C++
        ops are in use."""
        if not getattr(ops, "native", False) or model.model.norm.weight.device.type != "cpu":
            return False
        if type(model) not in (LlamaForCausalLM, MoEForCausalLM) or model.cfg.qk_norm == "projection":
            return False  # the Llama decoder with dense or MoE MLPs, per-head q/k norms only
        if model.tp.size > 1:  # one call a step leaves no place for the ranks' all-reduces
            return False
        dtype = model.model.norm.weight.dtype
        for layer in model.model.layers:
            mlp = layer.mlp
            linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if isinstance(mlp, SparseMoeBlock):
                if mlp.shared_expert is not None or mlp.experts.w13.dtype != dtype or mlp.gate.weight.dtype != dtype:
                    return False  # Qwen2-MoE's gated shared expert runs op by op
            else:
                linears += [mlp.gate_up_proj, mlp.down_proj]
            if not all(_runs_here(m, dtype) for m in linears):
                return False
        cfg = model.cfg
        if cfg.head_dim % 2 or cfg.head_dim > 512 or dtype not in (torch.float32, torch.bfloat16):
            return False
        # The layer stack attends over whole contexts: a sliding window (any layer's) takes the per-op path.
        windows = getattr(cfg, "layer_sliding_windows", None) or ()
        if getattr(cfg, "sliding_window", None) is not None or any(w is not None for w in windows):
            return False
        return cpu.gemm_supports(dtype, 2)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.model.model.embed_tokens(input_ids)
        out = torch.empty_like(h)
        rows = meta.cache.get("torch_rows")
        if rows is None:
            rows = meta.cache["torch_rows"] = token_rows(meta, h.device)
        cos, sin = self.model.cos_sin
        return cpu.llama_forward(
            out, h, positions, cos, sin, meta.slot_mapping, *rows, self.weights, self.kv_caches,
            self.model.model.norm.weight, self.dims, self.eps, self.qk_eps, self.scale,
            self.segments, self.segment_table, self.lora, meta.token_lora_slots, self.moe, self.top_k,
            self.renormalize,
        )  # fmt: skip


def _runs_here(linear: Any, dtype: torch.dtype) -> bool:
    if isinstance(linear, PackedLinear):
        return linear.own_gemm and linear.dtype == dtype
    if isinstance(linear, QuantizedLinear):
        return linear.dtype == dtype and all(
            s.data.device.type == "cpu" and cpu.gguf_supports(s.qtype, dtype, linear.in_features)
            for s in linear.segments
        )
    return False
