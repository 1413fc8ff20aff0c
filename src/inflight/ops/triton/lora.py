"""Multi-LoRA shrink and expand kernels (vLLM's punica ops): out[t, slice s] += B[slot] (A[s, slot] x[t]).

A step's rows are sorted by adapter slot once (`lora_kernel_meta`, on the device, fixed shapes, so it can be
captured in a CUDA graph) and shared by every layer. Each kernel's grid is (row tile x column tile, slice,
slot), sized from the step's token count and `max_loras` only; a program whose slot has no rows in its tile
returns at once, and rows without an adapter are sorted past every slot, so no program looks at them.

Numerics follow `inflight.ops.reference.lora_apply`: the shrink's result is kept in fp32 ([S, T, R]), the
expand adds B's product to out's values in fp32 and rounds once into out's dtype. The dots run in IEEE
fp32 (not TF32), which a GPU computes as a chain of FMAs over K (shrink) or R (expand) in order for each
output element, whatever the row's place in its tile: a row's result is bit for bit the same alone or in
any batch (under the interpreter, whose dot is numpy's, to within an ulp or two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SLICES = 3  # q/k/v, the most output slices of a fused linear (models/lora.py's LORA_LINEARS)
# Steps of at most this many tokens take the small row tile (decode); larger ones the prefill tile.
DECODE_MAX_TOKENS = 64
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64
BLOCK_K = 32  # the shrink's step over in_features: fixed, so every row sums over K in the same order
BLOCK_N = 64  # the expand's tile over out_features
EXPAND_BLOCK_R = 16  # the expand's step over the rank, likewise fixed
# The shrink's tile over the rank (16 up to this): decode's small row tile affords a wider one.
MAX_BLOCK_R = {DECODE_BLOCK_M: 64, PREFILL_BLOCK_M: 32}


@dataclass
class LoRAKernelMeta:
    """One step's rows grouped by adapter slot (vLLM's LoRAKernelMeta), made once and shared by all layers."""

    token_indices_sorted_by_lora_ids: torch.Tensor  # int32 [T]: the rows of slot 0, then slot 1, ..., then none
    num_tokens_per_lora: torch.Tensor  # int32 [max_loras + 1]: rows per slot; the last entry counts slot -1
    lora_token_start_loc: torch.Tensor  # int32 [max_loras + 2]: where each slot's rows start in the sorted rows
    max_loras: int
    num_tokens: int


def lora_kernel_meta(token_slots: torch.Tensor, max_loras: int) -> LoRAKernelMeta:
    """Groups the rows of `token_slots` (int32 [T], -1 = no adapter) by slot with fixed-size device ops only:
    no host sync and no data-dependent shape, so it can run inside a CUDA graph capture."""
    num_tokens = token_slots.shape[0]
    # Rows without an adapter get the key max_loras: they sort after every slot and no program reads them.
    keys = torch.where(token_slots < 0, max_loras, token_slots.long())
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(max_loras + 1, dtype=torch.int64, device=token_slots.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    start = torch.zeros(max_loras + 2, dtype=torch.int32, device=token_slots.device)
    start[1:] = counts.cumsum(0)
    return LoRAKernelMeta(order.to(torch.int32), counts.to(torch.int32), start, max_loras, num_tokens)


@triton.jit
def _slot_rows(sorted_ptr, count_ptr, start_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """This tile's rows of `slot` (row indices, valid mask) and whether the tile has any."""
    count = tl.load(count_ptr + slot)
    m0 = pid_m * BLOCK_M
    offs = m0 + tl.arange(0, BLOCK_M)
    valid = offs < count
    start = tl.load(start_ptr + slot)
    rows = tl.load(sorted_ptr + start + offs, mask=valid, other=0).to(tl.int64)
    return rows, valid, m0 < count


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # fp32 [S, L, R, K]
    buf_ptr,  # fp32 [S, T, R]
    sorted_ptr,
    count_ptr,
    start_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_al,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_bt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.program_id(2)
    num_r = tl.cdiv(R, BLOCK_R)
    pid_m, pid_r = pid // num_r, pid % num_r
    rows, valid, any_rows = _slot_rows(sorted_ptr, count_ptr, start_ptr, slot, pid_m, BLOCK_M)
    if not any_rows:
        return
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xt
    a_rows = a_ptr + s.to(tl.int64) * stride_as + slot.to(tl.int64) * stride_al + r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        xt = tl.load(x_rows + kk[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_rows + kk[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [K, R]
        acc = tl.dot(xt.to(tl.float32), at, acc, input_precision="ieee")
    dst = buf_ptr + s.to(tl.int64) * stride_bs + rows[:, None] * stride_bt + r[None, :]
    tl.store(dst, acc, mask=valid[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    buf_ptr,  # fp32 [S, T, R]
    b_ptr,  # fp32 [L, N, R]
    out_ptr,  # [T, N], added to in place
    sorted_ptr,
    count_ptr,
    start_ptr,
    R,
    max_slice_n,
    end0,  # slice s owns out columns [end(s-1), end(s)); end(-1) = 0
    end1,
    end2,
    stride_bs,
    stride_bt,
    stride_wl,
    stride_wn,
    stride_wr,
    stride_ot,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.program_id(2)
    num_n = tl.cdiv(max_slice_n, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    lo = tl.where(s == 0, 0, tl.where(s == 1, end0, end1))
    hi = tl.where(s == 0, end0, tl.where(s == 1, end1, end2))
    rows, valid, any_rows = _slot_rows(sorted_ptr, count_ptr, start_ptr, slot, pid_m, BLOCK_M)
    if not any_rows or pid_n * BLOCK_N >= hi - lo:
        return
    n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    r = tl.arange(0, BLOCK_R)
    src = buf_ptr + s.to(tl.int64) * stride_bs + rows[:, None] * stride_bt
    w = b_ptr + slot.to(tl.int64) * stride_wl + n[None, :].to(tl.int64) * stride_wn
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + r
        r_ok = rr < R
        h = tl.load(src + rr[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)  # [M, R]
        bt = tl.load(w + rr[:, None] * stride_wr, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R, N]
        delta = tl.dot(h, bt, delta, input_precision="ieee")
    dst = out_ptr + rows[:, None] * stride_ot + n[None, :].to(tl.int64) * stride_on
    ok = valid[:, None] & n_ok[None, :]
    old = tl.load(dst, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst, (old + delta).to(out_ptr.dtype.element_ty), mask=ok)


def _block_m(num_tokens: int) -> int:
    return DECODE_BLOCK_M if num_tokens <= DECODE_MAX_TOKENS else PREFILL_BLOCK_M


def _block_r(rank: int, block_m: int) -> int:
    return min(max(triton.next_power_of_2(rank), 16), MAX_BLOCK_R[block_m])


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """buf[s, t] = A[s, slot(t)] x[t] in fp32 for the rows with a slot: x [T, K], a fp32 [S, L, R, K] ->
    fp32 [S, T, R] (rows without a slot are left unwritten)."""
    num_slices, max_loras, rank, k = a.shape
    t = x.shape[0]
    assert x.shape[1] == k and t == meta.num_tokens and max_loras == meta.max_loras
    assert a.dtype == torch.float32
    buf = torch.empty(num_slices, t, rank, dtype=torch.float32, device=x.device)
    if t == 0:
        return buf
    block_m = _block_m(t)
    block_r = _block_r(rank, block_m)
    grid = (triton.cdiv(t, block_m) * triton.cdiv(rank, block_r), num_slices, max_loras)
    _lora_shrink_kernel[grid](
        x,
        a,
        buf,
        meta.token_indices_sorted_by_lora_ids,
        meta.num_tokens_per_lora,
        meta.lora_token_start_loc,
        k,
        rank,
        x.stride(0),
        x.stride(1),
        *a.stride(),
        buf.stride(0),
        buf.stride(1),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return buf


def lora_expand(
    buf: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, meta: LoRAKernelMeta, out: torch.Tensor
) -> None:
    """out[t, offsets[s]:offsets[s+1]] += B[slot(t), that slice] buf[s, t] for the rows with a slot, summed
    in fp32 with out's value and rounded once into out's dtype. buf fp32 [S, T, R], b fp32 [L, N, R],
    offsets int64 [S+1] on the CPU, out [T, N]."""
    num_slices, t, rank = buf.shape
    max_loras, n, _ = b.shape
    bounds = [int(v) for v in offsets.tolist()]  # a CPU tensor: no device sync
    assert 1 <= num_slices <= MAX_SLICES and len(bounds) == num_slices + 1 and bounds[0] == 0
    assert bounds[-1] == n and out.shape == (t, n) and max_loras == meta.max_loras and b.shape[2] == rank
    assert b.dtype == torch.float32 and buf.stride(2) == 1
    if t == 0:
        return
    ends = bounds[1:] + [n] * (MAX_SLICES - num_slices)
    max_slice_n = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    block_m = _block_m(t)
    grid = (triton.cdiv(t, block_m) * triton.cdiv(max_slice_n, BLOCK_N), num_slices, max_loras)
    _lora_expand_kernel[grid](
        buf,
        b,
        out,
        meta.token_indices_sorted_by_lora_ids,
        meta.num_tokens_per_lora,
        meta.lora_token_start_loc,
        rank,
        max_slice_n,
        *ends,
        buf.stride(0),
        buf.stride(1),
        *b.stride(),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_R=EXPAND_BLOCK_R,
        num_warps=4,
    )


def lora_apply(
    out: torch.Tensor,  # [T, N]: the base linear's output, added to in place
    x: torch.Tensor,  # [T, K]: the linear's input
    lora_a: torch.Tensor,  # fp32 [S, L, R, K]
    lora_b: torch.Tensor,  # fp32 [L, N, R], scale folded in
    offsets: torch.Tensor,  # int64 [S+1] on the CPU: slice s owns outputs offsets[s]:offsets[s+1]
    token_slots: torch.Tensor,  # int32 [T]: each row's slot, -1 for none
    meta: LoRAKernelMeta | None = None,
) -> None:
    """`reference.lora_apply` as one shrink and one expand. `meta` is the step's
    `lora_kernel_meta(token_slots, L)`, shared by its layers; made here when not given."""
    if meta is None:
        meta = lora_kernel_meta(token_slots, lora_a.shape[1])
    lora_expand(lora_shrink(x, lora_a, meta), lora_b, offsets, meta, out)
