"""Builds paged-attention batches for the kernel tests: shuffled blocks, garbage everywhere else."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from inflight.executor.attention import AttentionMetadata

# The kernels run on the GPU where there is one, else on the CPU under TRITON_INTERPRET=1 (conftest).
# Inputs are drawn on the CPU (a CPU generator gives the same numbers on both) and then moved.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dev(*tensors: torch.Tensor):
    """The tensors on DEVICE (one tensor, or a tuple of them)."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D]: this step's new keys (already in the cache)
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, a non-contiguous view
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            query_start_loc_np=self.query_start_loc_np,
            seq_lens_np=self.seq_lens_np,
        )


def make_batch(
    specs: list[tuple[int, int]],  # per sequence: (tokens already cached, tokens queried this step)
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    garbage: float | None = float("nan"),  # fill of every cache slot outside a context; None = random
    seed: int = 0,
) -> PagedBatch:
    """Contexts live in randomly permuted physical blocks of a larger pool; block 0 is left to padding.

    NaN garbage makes any read outside a context (or any unmasked padding) poison the output.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + q for cached, q in specs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq) + 2
    wide = torch.zeros(len(specs), max_blocks + 3, dtype=torch.int32)
    block_tables = wide[:, :max_blocks]  # row stride != max_blocks, as a slice of a bigger table
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if garbage is None:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    else:
        k_cache = torch.full(shape, garbage, dtype=dtype)
        v_cache = torch.full(shape, garbage, dtype=dtype)
    slots, positions = [], []
    used = 0
    for b, ((cached, _), seq_len) in enumerate(zip(specs, seq_lens)):
        row = perm[used : used + blocks_per_seq[b]]
        used += len(row)
        block_tables[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        for pos in range(seq_len):
            blk, off = row[pos // block_size], pos % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            if pos >= cached:
                slots.append(blk * block_size + off)
                positions.append(pos)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    k_cache, v_cache, slot_mapping = dev(k_cache, v_cache, slot_mapping)
    block_tables = dev(wide)[:, :max_blocks]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    qsl = np.concatenate([[0], np.cumsum([q for _, q in specs])]).astype(np.int32)
    sl = np.array(seq_lens, dtype=np.int32)
    return PagedBatch(
        query=dev(torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=gen).to(dtype)),
        key=flat_k[slot_mapping].clone(),
        value=flat_v[slot_mapping].clone(),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
        positions=dev(torch.tensor(positions, dtype=torch.int64)),
        query_start_loc=dev(torch.from_numpy(qsl)),
        seq_lens=dev(torch.from_numpy(sl)),
        block_tables=block_tables,
        query_start_loc_np=qsl,
        seq_lens_np=sl,
    )


def batch_kinds(block_size: int) -> dict[str, list[tuple[int, int]]]:
    """Named batch shapes as (cached, queried) per sequence."""
    bs = block_size
    return {
        # context lengths 1, block boundary -1/0/+1, a few hundred tokens
        "decode": [(0, 1), (bs - 2, 1), (bs - 1, 1), (bs, 1), (299, 1)],
        "prefill": [(0, 37), (0, bs), (0, bs + 1)],
        "chunk_after_prefix": [(bs, 20), (2 * bs + 3, bs - 1), (bs - 1, 2)],
        "mixed": [(0, 17), (40, 1), (bs - 1, bs + 1), (0, 1), (250, 1), (33, 9)],
    }


# For sliding windows (HF's: the query at i sees keys i - W < j <= i): contexts 1, 40, 150, a fresh 37-token
# prompt, a 20-token chunk after 50 cached tokens (its queries' windows straddle block edges), a chunk after 15.
WINDOW_BATCH = [(0, 1), (39, 1), (149, 1), (0, 37), (50, 20), (15, 17)]


def poison_outside_window(batch: PagedBatch, window: int) -> tuple[PagedBatch, int]:
    """A copy whose cache blocks wholly before every query's window hold NaN (a server may free and reuse
    them): a kernel that reads none of them gives exactly the clean batch's output. Returns (copy, blocks)."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    block_size, poisoned = k_cache.shape[1], 0
    for b, seq_len in enumerate(batch.seq_lens_np.tolist()):
        first_query = seq_len - int(batch.query_start_loc_np[b + 1] - batch.query_start_loc_np[b])
        blocks = batch.block_tables[b, : max(0, first_query - window + 1) // block_size].long()
        k_cache[blocks] = float("nan")
        v_cache[blocks] = float("nan")
        poisoned += len(blocks)
    return replace(batch, k_cache=k_cache, v_cache=v_cache), poisoned
