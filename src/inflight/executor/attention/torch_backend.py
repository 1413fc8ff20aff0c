"""`TorchBackend`: the ops seam on CPU. Natively (the default on CPU) every op is one of `inflight.ops.cpu`'s
C++ ops and attention takes every query token as a row of one paged op; the plain-torch path (gather + SDPA,
`inflight.ops.reference`'s elementwise ops) is the fallback without a compiler."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from inflight.executor.attention.metadata import AttentionMetadata
from inflight.ops import cpu, reference

if TYPE_CHECKING:
    from inflight.models.lora import LoRASlots
    from inflight.models.moe import FusedExperts


class TorchBackend:
    """Reference implementations in plain torch; vectorized over the batch (decode rows in one shot)."""

    name = "torch"

    def __init__(self, native: bool = False) -> None:
        # native: the C++ ops for CPU tensors (when they build); False = the plain-torch path.
        self.native = native and cpu.available()
        # Per-token RoPE tables of this step, one entry per cos/sin table (a model may have one per layer kind)
        self._rope_steps: dict[int, tuple[torch.Tensor, ...]] = {}

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T], every slot >= 0 (the runner asserts it on the host)
    ) -> None:
        if self.native and key.device.type == "cpu":
            cpu.write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        # No filtering of negative slots here: a mask test would sync host and device every layer on CUDA.
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))

    def attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,  # [T, Hkv, D]: this step's K/V, already written to the cache
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,  # HF's: the query at i sees keys i - W < j <= i; None: all j <= i
    ) -> torch.Tensor:  # [T, Hq, D]
        sliding_window = sliding_window or None  # 0 means none, as for the C++ op
        native = self.native and query.device.type == "cpu"
        if native:
            rows = meta.cache.get("torch_rows")
            if rows is None:
                rows = meta.cache["torch_rows"] = token_rows(meta, query.device)
            return cpu.paged_attention(query, k_cache, v_cache, *rows, scale, sliding_window)
        plan_key = f"torch_plan:{sliding_window}"  # layers with and without a window share a step
        plan = meta.cache.get(plan_key)
        if plan is None:
            plan = meta.cache[plan_key] = _plan(meta, k_cache.shape[1], query.device, sliding_window)
        decode, prefill = plan
        out = torch.empty_like(query)
        for tokens, blocks, lens, first in decode:
            out[tokens] = _decode_attention(query[tokens], k_cache, v_cache, blocks, lens, scale, sliding_window, first)
        for start, end, seq_len, blocks, first in prefill:
            if seq_len == end - start and key is not None and value is not None:
                # A fresh prompt (no cached prefix): its context is exactly this chunk's K/V, no gather.
                q, k, v = query[start:end], key[start:end], value[start:end]
                out[start:end] = _causal_attention(q, k, v, scale, sliding_window)
            else:
                q = query[start:end]
                out[start:end] = _prefill_attention(q, k_cache, v_cache, blocks, seq_len, scale, sliding_window, first)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.native and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1:
            return cpu.rms_norm(x, weight, eps)
        return reference.rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual), x + residual) — the new residual stream. The native op works in
        place on x and residual (the caller's own activations, never read again)."""
        if self.native and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
            return cpu.fused_add_rms_norm(x, residual, weight, eps)
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rope(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        positions: torch.Tensor,  # [T]
        cos_sin_cache: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [max_pos, D/2] float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF rotate-half RoPE: x * cos + rotate_half(x) * sin, cos/sin repeated over both halves.

        Like HF, cos/sin are cast to the activations' dtype before the multiply. Every layer of a step
        passes the same `positions` tensor, so the per-token tables are built once per step and cos/sin table,
        not per layer.
        """
        if self.native and query.device.type == "cpu":  # in place, like the Triton kernel
            return cpu.rope(query, key, positions, *cos_sin_cache)
        table = cos_sin_cache[0]
        step = self._rope_steps.get(id(table))
        if step is None or step[0] is not positions or step[1] is not table or step[2].dtype != query.dtype:
            tables = reference.rope_tables(positions, *cos_sin_cache, query.dtype)
            step = self._rope_steps[id(table)] = (positions, table, *tables)
        _, _, cos, sin = step
        return reference.apply_rope(query, cos, sin), reference.apply_rope(key, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, up halves of the fused projection) -> silu(gate) * up, [T, I]."""
        if self.native and x.device.type == "cpu" and x.stride(-1) == 1:
            return cpu.silu_and_mul(x)
        return reference.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, up halves) -> gelu_tanh(gate) * up, [T, I] (plain torch on every device)."""
        return reference.gelu_tanh_and_mul(x)

    def lora_apply(self, out: torch.Tensor, x: torch.Tensor, lora: LoRASlots, token_slots: torch.Tensor) -> None:
        """out += each row's adapter delta (models/lora.py's LoRASlots), in place."""
        if (
            self.native
            and out.device.type == "cpu"
            and out.dtype in (torch.float32, torch.bfloat16)
            and x.dtype == out.dtype
            and out.stride(-1) == 1
            and x.stride(-1) == 1
        ):
            cpu.lora_apply(out, x, lora.a, lora.b, lora.offsets, token_slots)
            return
        reference.lora_apply(out, x, lora.a, lora.b, lora.offsets, token_slots)

    def select_experts(
        self, x: torch.Tensor, gate: torch.nn.Module, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 [T, k] weights, int32 [T, k] ids
        """The router (`gate`, a linear over the experts) and `reference.select_experts`: one C++ pass a row on CPU
        where the gate holds a plain weight in x's dtype; otherwise the gate's linear, then the torch reference."""
        weight = getattr(gate, "weight", None)
        if (
            self.native
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and isinstance(weight, torch.Tensor)
            and weight.dtype == x.dtype
            and getattr(gate, "bias", None) is None
            and x.dim() == 2
            and x.stride(-1) == 1
        ):
            return cpu.moe_route(x, weight, top_k, renormalize)
        return reference.select_experts(gate(x), top_k, renormalize)

    def fused_moe(
        self,
        x: torch.Tensor,  # [T, H]
        experts: FusedExperts,
        topk_weights: torch.Tensor,  # fp32 [T, k]
        topk_ids: torch.Tensor,  # int32 [T, k]
    ) -> torch.Tensor:  # [T, H], x's dtype
        """Each token through its k experts, weighted: the C++ grouped GEMM on CPU (fp32, bf16), the experts
        packed into its panels on first use; otherwise the per-expert torch loop."""
        if (
            self.native
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and experts.w13.dtype == x.dtype
            and x.stride(-1) == 1
        ):
            return cpu.fused_moe(x, packed_experts(experts), topk_weights, topk_ids)
        return reference.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids)


def packed_experts(experts: FusedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts in the C++ grouped GEMM's panels (`cpu.moe_pack`), made on first use and kept on the module."""
    packed = experts.cpu_packed
    if packed is None or packed[0].dtype != experts.w13.dtype:
        packed = experts.cpu_packed = cpu.moe_pack(experts.w13, experts.w2)
    return packed


def token_rows(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query token as its own row of the decode op: (its sequence's block table, its context length).

    A prompt token at position p attends to tokens 0..p exactly as a decode step at p would, through the
    same op: a token's attention is then the same bits whether it arrives in a prompt, a chunk, after a
    cached prefix or after preemption (SDPA's results depend on the chunk's length and split).
    """
    qlens = meta.query_lens_np
    if (qlens == 1).all():
        return meta.block_tables, meta.seq_lens
    seq_of_token = np.repeat(np.arange(len(qlens)), qlens)
    qsl = meta.query_start_loc_np
    # Context length of each token: its sequence's length minus the query tokens that come after it.
    lens = meta.seq_lens_np[seq_of_token] - (qsl[1:][seq_of_token] - 1 - np.arange(int(qsl[-1])))
    tables = meta.block_tables.index_select(0, torch.from_numpy(seq_of_token).to(device))
    return tables, torch.from_numpy(lens.astype(np.int32)).to(device)


# The reference gathers decode rows padded to their bucket's longest context; sorting by length and cutting
# into buckets of this many rows keeps the padding (memory traffic, its main cost) small.
DECODE_BUCKET_ROWS = 16


def _plan(meta: AttentionMetadata, block_size: int, device: torch.device, window: int | None = None):
    """The reference's split of the batch, once per step: decode rows (1 query token) sorted by length in
    buckets of DECODE_BUCKET_ROWS, each (tokens, blocks, lens, first); prefill chunks alone, each (start, end,
    seq_len, blocks, first); a fresh prompt (seq_len == its query length, nothing cached before it) needs no
    blocks. With a sliding window the blocks start at each row's first block inside it (position `first`, per
    row for decode; None when no row reaches past its window): earlier blocks are never gathered.
    """
    qlens = meta.query_lens_np
    qsl = meta.query_start_loc_np
    is_decode = qlens == 1
    rows = np.nonzero(is_decode)[0]
    decode = []
    if len(rows):
        rows = rows[np.argsort(meta.seq_lens_np[rows], kind="stable")]
        for bucket in np.array_split(rows, -(-len(rows) // DECODE_BUCKET_ROWS)):
            lens = meta.seq_lens_np[bucket].astype(np.int64)
            idx = torch.from_numpy(bucket).to(device)
            tokens = torch.from_numpy(qsl[bucket].astype(np.int64)).to(device)
            if window is None or lens[-1] <= window:
                blocks, first = meta.block_tables[idx, : -(-int(lens[-1]) // block_size)].long(), None
            else:
                # Each row's window blocks; a shorter span repeats its last block (masked) rather than read
                # another row's or an unused table entry.
                lo, hi = np.maximum(lens - window, 0) // block_size, (lens - 1) // block_size
                cols = np.minimum(lo[:, None] + np.arange(int((hi - lo).max()) + 1), hi[:, None])
                blocks = meta.block_tables[idx[:, None], torch.from_numpy(cols).to(device)].long()
                first = torch.from_numpy(lo * block_size).to(device)
            decode.append((tokens, blocks, meta.seq_lens[idx], first))
    prefill = []
    for r in np.nonzero(~is_decode & (qlens > 0))[0]:
        seq_len = int(meta.seq_lens_np[r])
        nblk = -(-seq_len // block_size)
        lo = max(0, seq_len - int(qlens[r]) - window + 1) // block_size if window else 0
        prefill.append((int(qsl[r]), int(qsl[r + 1]), seq_len, meta.block_tables[r, lo:nblk].long(), lo * block_size))
    return decode, prefill


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, nblk] block ids -> [B, nblk * block_size, Hkv, D] contiguous context."""
    b, nblk = blocks.shape
    return cache.index_select(0, blocks.reshape(-1)).view(b, nblk * cache.shape[1], *cache.shape[2:])


def _decode_attention(q, k_cache, v_cache, blocks, seq_lens, scale, window=None, first=None):
    # q [B, Hq, D]; blocks [B, nblk]; one query per sequence attends to its whole context (its window: the
    # blocks then start at each row's position `first`). A KV head's query heads share one mask, so they ride
    # in SDPA's query-length slot: each K/V tile serves its group.
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    # index_select, not k_cache[blocks]: on CPU it gathers faster than advanced indexing.
    k = _gather(k_cache, blocks).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather(v_cache, blocks).transpose(1, 2)
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    if first is None:
        valid = pos < seq_lens[:, None]
    else:
        pos = pos + first[:, None]
        valid = (pos < seq_lens[:, None]) & (pos >= seq_lens[:, None] - window)
    out = F.scaled_dot_product_attention(
        q.view(b, hkv, hq // hkv, d).float(),
        k.float(),
        v.float(),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return out.reshape(b, hq, d).to(q.dtype)


def _causal_attention(q, k, v, scale, window=None):
    # q [L, Hq, D], k/v [L, Hkv, D]: a whole context of L tokens, causal; SDPA's flash path, no mask tensor,
    # unless a sliding window shorter than the context needs a band mask.
    hq, hkv = q.shape[1], k.shape[1]
    mask = None
    if window is not None and window < q.shape[0]:
        pos = torch.arange(q.shape[0], device=q.device)
        back = pos[:, None] - pos[None, :]  # how far each key lies behind each query
        mask = (back >= 0) & (back < window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=hq != hkv,
    )
    return out.transpose(0, 1)


def _prefill_attention(q, k_cache, v_cache, blocks, seq_len, scale, window=None, first=0):
    # q [Lq, Hq, D] are the last Lq positions of a context of seq_len tokens (a cached prefix may precede);
    # blocks start at position `first` (0, or the first query's window's first block).
    lq, hq, d = q.shape
    hkv = k_cache.shape[2]
    k = _gather(k_cache, blocks[None])[0, : seq_len - first]  # [L, Hkv, D]
    v = _gather(v_cache, blocks[None])[0, : seq_len - first]
    q_pos = torch.arange(seq_len - lq, seq_len, device=q.device)
    k_pos = torch.arange(first, seq_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=hq != hkv,
    )
    return out.transpose(0, 1).to(q.dtype)
