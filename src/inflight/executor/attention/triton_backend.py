"""The attention backend that runs the Triton-language kernels of `inflight.ops.triton`.

Same methods and semantics as `inflight.executor.attention.TorchBackend`. On CUDA the kernels are compiled;
on a CPU they run only under `TRITON_INTERPRET=1` (slow, for tests). The per-step attention plan
(query tiles, split-K choice) is made once per step from host arrays and shared by all layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from inflight.executor.attention.metadata import AttentionMetadata
from inflight.ops import reference
from inflight.ops.triton.fused_moe import fused_moe
from inflight.ops.triton.kv_write import write_kv
from inflight.ops.triton.lora import LoRAKernelMeta, lora_apply, lora_kernel_meta
from inflight.ops.triton.paged_attention import AttentionPlan, paged_attention, plan_attention
from inflight.ops.triton.rms_norm import fused_add_rms_norm, rms_norm
from inflight.ops.triton.rope import rotary_embedding
from inflight.ops.triton.split_k_decode import device_sm_count, num_kv_splits

if TYPE_CHECKING:
    from inflight.models.lora import LoRASlots
    from inflight.models.moe import FusedExperts


class TritonBackend:
    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]; negative = skip
    ) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,  # unused: the kernel reads every context token from the cache
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,  # HF's: the query at i sees keys i - W < j <= i; None: all j <= i
    ) -> torch.Tensor:  # [T, Hq, D]
        plan = self.plan(meta, query.shape[1], k_cache.shape[2], query.device, sliding_window=sliding_window)
        return paged_attention(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, plan, sliding_window
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual), x + residual) — the new residual stream."""
        return fused_add_rms_norm(x, residual, weight, eps)

    def rope(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        positions: torch.Tensor,  # [T]
        cos_sin_cache: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [max_pos, D/2] float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query and key in place and returns them."""
        cos, sin = cos_sin_cache
        return rotary_embedding(query, key, positions, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, up halves of the fused projection) -> silu(gate) * up, [T, I]."""
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, up halves) -> gelu_tanh(gate) * up, [T, I]."""
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def lora_apply(self, out: torch.Tensor, x: torch.Tensor, lora: LoRASlots, token_slots: torch.Tensor) -> None:
        """out += each row's adapter delta (models/lora.py's LoRASlots), in place. The rows' grouping by slot
        is made on the step's first call and reused while the same `token_slots` tensor comes back unchanged
        (its version counter) and the stream is in the same capture state: a CUDA graph capture makes its own,
        inside the graph, rather than reusing the warm-up's."""
        max_loras = lora.a.shape[1]
        key = (token_slots._version, max_loras, torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        cached: tuple[torch.Tensor, tuple, LoRAKernelMeta] | None = getattr(self, "_lora_meta", None)
        if cached is not None and cached[0] is token_slots and cached[1] == key:
            meta = cached[2]
        else:
            meta = lora_kernel_meta(token_slots, max_loras)
            self._lora_meta = (token_slots, key, meta)
        lora_apply(out, x, lora.a, lora.b, lora.offsets, token_slots, meta)

    @staticmethod
    def plan(
        meta: AttentionMetadata,
        num_q_heads: int,
        num_kv_heads: int,
        device: torch.device,
        num_splits: int | None = None,
        sliding_window: int | None = None,
    ) -> AttentionPlan:
        """The step's plan, made on its first layer and kept in `meta.cache` for the others (a CUDA graph
        makes it before capturing, with the split-K count of its key). A sliding window's layers share its
        query tiles (no new tensors: safe inside a capture) with a split count for at most the window's keys."""
        key = f"triton_plan:{num_q_heads}:{num_kv_heads}"
        plan = meta.cache.get(key)
        if plan is None:
            plan = meta.cache[key] = plan_attention(
                meta.query_start_loc_np, meta.seq_lens_np, num_q_heads, num_kv_heads, device, num_splits
            )
        if not sliding_window or plan.num_splits == 1:
            return plan
        window_key = f"{key}:{sliding_window}"
        windowed = meta.cache.get(window_key)
        if windowed is None:
            max_keys = min(int(meta.seq_lens_np.max(initial=0)), sliding_window)
            max_q = int(meta.query_lens_np.max(initial=0))
            splits = num_kv_splits(len(meta.seq_lens_np), num_kv_heads, max_keys, max_q, device_sm_count(device))
            windowed = meta.cache[window_key] = replace(plan, num_splits=min(splits, plan.num_splits))
        return windowed

    @staticmethod
    def num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, max_query_len: int, device: torch.device) -> int:
        """The split-K count `plan` would pick for such a step."""
        return num_kv_splits(num_seqs, num_kv_heads, max_seq_len, max_query_len, device_sm_count(device))

    def select_experts(
        self, x: torch.Tensor, gate: torch.nn.Module, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 [T, k] weights, int32 [T, k] ids
        """The router's linear, then HF's softmax and top-k in torch."""
        return reference.select_experts(gate(x), top_k, renormalize)

    def fused_moe(
        self,
        x: torch.Tensor,  # [T, H]
        experts: FusedExperts,
        topk_weights: torch.Tensor,  # fp32 [T, k]
        topk_ids: torch.Tensor,  # int32 [T, k]
    ) -> torch.Tensor:  # [T, H], x's dtype
        """Each token through its k experts, weighted: the fused-MoE kernel, block sizes per `get_config`."""
        return fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids)
