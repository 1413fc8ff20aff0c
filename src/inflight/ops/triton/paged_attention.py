"""Unified paged attention: one kernel for prefill chunks, decode and mixed batches.

Queries are flattened and unpadded (`query_start_loc` [B+1]); sequence b's queries are the LAST
q_len of its `seq_lens[b]` positions, so a prefill chunk with a cached prefix, a whole prompt and a
single decode token are the same case. Attention is causal by absolute position and reads keys and
values only through `block_tables`. With a sliding window (HF's: the query at i sees keys i - W < j <= i)
the KV loop starts at the tile's first visible key, and keys before it are never loaded.

One program = one tile of BLOCK_Q query tokens of one sequence x every query head of one KV head's
group (GQA): its rows are (token, head-in-group) pairs, so each KV tile is loaded once for the whole
group. The KV loop is flash-attention's online softmax in fp32 (base 2, the scale folded into
log2(e)). Rows are padded to powers of two and to >= 16 for `tl.dot`, and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from inflight.ops.triton.split_k_decode import device_sm_count, merge_splits, num_kv_splits

LOG2E = 1.4426950408889634
# Rows (token x head-in-group) per program: a decode tile needs only the group but tl.dot needs
# >= 16; prefill tiles are larger so one KV tile serves more queries.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
# Keys per loop iteration. Independent of the cache block size: each key looks up its own block, so
# block sizes 8..128 all work and a tile may span several blocks.
TILE_N = 64


# The block table's row stride changes with the batch's longest context: specializing on it (== 1,
# divisible by 16) would recompile the kernel mid-serving when a step crosses those values. The window is
# a runtime value (one binary for every window size); SLIDING alone picks the binary.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _unified_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, Hq, D], or [S, T, Hq, D] float32 when split
    lse_ptr,  # [S, T, Hq] float32 when split (unused otherwise)
    tile_seq_ptr,  # [num_tiles] int32: the sequence of each program's query tile
    tile_q_ptr,  # [num_tiles] int32: the tile's first query, relative to its sequence
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_o_split,
    stride_o_tok,
    stride_o_head,
    stride_l_split,
    stride_l_tok,
    stride_bt,
    window,  # sliding window in tokens (read only when SLIDING)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = tl.load(tile_seq_ptr + tile)
    q_tile = tl.load(tile_q_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (head_in_group < GROUP)
    token = (q_begin + q_idx).to(tl.int64)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Causal: no query of this tile sees past the tile's last position, nor (sliding) before its first
    # query's window: keys kv_lo..kv_len - 1. Split s takes an equal share of the KV tiles that hold
    # them (an empty share leaves lse = -inf and weight 0 in the merge).
    kv_len = tl.minimum(seq_len, context_len + q_tile + BLOCK_Q)
    if SLIDING:
        kv_lo = tl.maximum(context_len + q_tile - window + 1, 0)
    else:
        kv_lo = 0
    first_kv_tile = kv_lo // TILE_N
    num_kv_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_kv_tiles - first_kv_tile, num_splits)
    tile_lo = first_kv_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    for j in range(tile_lo, tile_hi):
        kv_pos = j * TILE_N + tl.arange(0, TILE_N)
        kv_ok = kv_pos < kv_len
        if SLIDING:  # keys before every query's window are never loaded
            kv_ok = kv_ok & (kv_pos >= kv_lo)
        block = tl.load(block_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot = kv_pos % BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_PAD, TILE_N]
            k_head + block[None, :] * stride_k_block + slot[None, :] * stride_k_slot + dims[:, None],
            mask=kv_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet (padding, or an early query in a late split) keeps
        # m = -inf; shift by 0 instead so exp2 gives 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(  # [TILE_N, HEAD_DIM_PAD]
            v_head + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot + dims[None, :],
            mask=kv_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr
        + split.to(tl.int64) * stride_o_split
        + token[:, None] * stride_o_tok
        + head[:, None] * stride_o_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))
        tl.store(lse_ptr + split.to(tl.int64) * stride_l_split + token * stride_l_tok + head, lse, mask=row_ok)


@dataclass
class QueryTiles:
    """One kernel launch's programs: tiles of `block_q` query tokens."""

    block_q: int  # query tokens per program
    tile_seq: torch.Tensor  # [num_tiles] int32: the sequence of each tile
    tile_q: torch.Tensor  # [num_tiles] int32: the tile's first query, relative to its sequence


@dataclass
class AttentionPlan:
    """Host-side decisions for one step, shared by every layer (no device sync to make them)."""

    launches: list[QueryTiles]  # one kernel launch each, over disjoint sequences
    num_splits: int


def _tiles(q_lens: np.ndarray, seqs: np.ndarray, block_m: int, group_pad: int, device: torch.device) -> QueryTiles:
    block_q = max(1, block_m // group_pad)
    tiles_per_seq = -(-q_lens[seqs] // block_q)
    tile_seq = np.repeat(seqs, tiles_per_seq)
    first_tile = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
    tile_q = (np.arange(len(tile_seq)) - first_tile) * block_q
    return QueryTiles(
        block_q=block_q,
        tile_seq=torch.from_numpy(tile_seq.astype(np.int32)).to(device),
        tile_q=torch.from_numpy(tile_q.astype(np.int32)).to(device),
    )


def plan_attention(
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    num_q_heads: int,
    num_kv_heads: int,
    device: torch.device,
    num_splits: int | None = None,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Cut every sequence's queries into tiles and pick single pass or split-K (None = automatic;
    with a sliding window a decode row streams at most its window's keys).

    Single-token (decode) queries get decode-sized tiles and longer ones prefill-sized tiles, in
    two launches when a step mixes both: a decode row in a 64-row prefill tile would compute 60
    empty rows (GQA 4) against its whole context.
    """
    q_lens = np.diff(query_start_loc_np).astype(np.int64)
    max_query_len = int(q_lens.max(initial=0))
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    seqs = np.arange(len(q_lens))
    decode, prefill = seqs[q_lens == 1], seqs[q_lens > 1]  # a sequence with no query gets no tile
    launches = [
        _tiles(q_lens, part, block_m, group_pad, device)
        for part, block_m in ((decode, DECODE_BLOCK_M), (prefill, PREFILL_BLOCK_M))
        if len(part)
    ]
    if num_splits is None:
        max_keys = int(seq_lens_np.max(initial=0))
        if sliding_window:
            max_keys = min(max_keys, sliding_window)
        num_splits = num_kv_splits(len(q_lens), num_kv_heads, max_keys, max_query_len, device_sm_count(device))
    return AttentionPlan(launches=launches, num_splits=num_splits)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, including this step's queries
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    plan: AttentionPlan,
    sliding_window: int | None = None,  # HF's: the query at i sees keys i - W < j <= i; None (or 0): all j <= i
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = query.shape
    assert (sliding_window or 0) >= 0, "sliding_window: a number of tokens"
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0 or not plan.launches:
        return out
    split = plan.num_splits > 1
    if split:
        dst = torch.empty((plan.num_splits, *query.shape), dtype=torch.float32, device=query.device)
        lse = torch.empty((plan.num_splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device)
    else:
        dst, lse = out, out  # lse is never touched by the single-pass kernel
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    fp32 = query.dtype == torch.float32
    for tiles in plan.launches:
        # With 4 warps a 64-row prefill tile spills registers at head_dim 128 or in fp32 (ptxas for
        # sm_80/sm_90, `tools.kernel_resources`); 8 warps hold it. Decode tiles never spill.
        wide = tiles.block_q * group_pad >= PREFILL_BLOCK_M and (head_dim_pad >= 128 or fp32)
        _unified_attention_kernel[(tiles.tile_seq.numel(), num_kv_heads, plan.num_splits)](
            query,
            k_cache,
            v_cache,
            dst,
            lse,
            tiles.tile_seq,
            tiles.tile_q,
            query_start_loc,
            seq_lens,
            block_tables,
            scale * LOG2E,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            dst.stride(0) if split else 0,
            dst.stride(-3),
            dst.stride(-2),
            lse.stride(0) if split else 0,
            lse.stride(1) if split else 0,
            block_tables.stride(0),
            sliding_window or 0,
            GROUP=group,
            GROUP_PAD=group_pad,
            BLOCK_Q=tiles.block_q,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=k_cache.shape[1],
            TILE_N=TILE_N,
            SPLIT=split,
            SLIDING=bool(sliding_window),
            # fp32 caches are the CPU/reference dtype: keep full precision instead of TF32.
            DOT_PRECISION="ieee" if fp32 else "tf32",
            # fp32 K/V tiles are twice the bytes: two pipeline stages keep them within shared memory.
            num_stages=2 if fp32 else 3,
            num_warps=8 if wide else 4,
        )
    if split:
        merge_splits(dst, lse, out)
    return out
