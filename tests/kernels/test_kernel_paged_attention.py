"""Unified paged attention and split-K decode against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_batches import (
    DEVICE,
    WINDOW_BATCH,
    PagedBatch,
    batch_kinds,
    dev,
    make_batch,
    poison_outside_window,
)

from inflight.executor.attention.metadata import AttentionMetadata
from inflight.executor.attention.triton_backend import TritonBackend
from inflight.ops import reference as oracles
from inflight.ops.triton.paged_attention import paged_attention, plan_attention
from inflight.ops.triton.split_k_decode import MAX_SPLITS, merge_splits, num_kv_splits

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype): GQA ratios 1/2/4/8 and 6 (not a power of
# two), head dims 32/64/80/96/128 (80 and 96 are padded to 128), both block sizes, fp32 and fp16.
GEOMETRIES = [
    pytest.param(4, 4, 64, 16, torch.float32, id="mha-d64-bs16-fp32"),
    pytest.param(8, 4, 80, 32, torch.float32, id="gqa2-d80-bs32-fp32"),
    pytest.param(8, 2, 128, 16, torch.float16, id="gqa4-d128-bs16-fp16"),
    pytest.param(8, 1, 64, 32, torch.float16, id="gqa8-d64-bs32-fp16"),
    pytest.param(12, 2, 96, 16, torch.float32, id="gqa6-d96-bs16-fp32"),
    pytest.param(8, 4, 32, 16, torch.float16, id="gqa2-d32-bs16-fp16"),
]
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def run(batch: PagedBatch, num_splits: int | None = None, window: int | None = None) -> torch.Tensor:
    plan = plan_attention(
        batch.query_start_loc_np,
        batch.seq_lens_np,
        batch.query.shape[1],
        batch.k_cache.shape[2],
        batch.query.device,
        num_splits=num_splits,
    )
    scale = batch.query.shape[-1] ** -0.5
    return paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        plan,
        window,
    )


def reference(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    return oracles.paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        window,
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "a read outside the context (NaN garbage) leaked into the output"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kind", ["decode", "prefill", "chunk_after_prefix", "mixed"])
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size", "dtype"), GEOMETRIES)
def test_matches_reference(kind, hq, hkv, head_dim, block_size, dtype):
    batch = make_batch(batch_kinds(block_size)[kind], hq, hkv, head_dim, block_size, dtype)
    assert_close(run(batch, num_splits=1), reference(batch), dtype)


def test_reference_is_causal_attention():
    # Guards the reference itself: one sequence, no paging tricks, against SDPA with is_causal.
    batch = make_batch([(0, 20)], 4, 2, 32, 16, garbage=None)
    pos = torch.arange(20, device=DEVICE)
    slots = batch.block_tables[0].long()[pos // 16]
    k = batch.k_cache[slots, pos % 16].repeat_interleave(2, dim=1)
    v = batch.v_cache[slots, pos % 16].repeat_interleave(2, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        batch.query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(reference(batch), sdpa, atol=1e-5, rtol=1e-5)


def test_context_beyond_the_query_changes_the_output():
    # The cached prefix must be attended to: same query, different prefix values -> different output.
    a = make_batch([(40, 1)], 4, 2, 64, 16, seed=1)
    b = make_batch([(40, 1)], 4, 2, 64, 16, seed=1)
    b.v_cache[b.block_tables[0, 0]] += 1.0  # positions 0..15 only
    assert not torch.allclose(run(a, 1), run(b, 1))


@pytest.mark.parametrize(
    ("hq", "hkv", "head_dim", "block_size", "dtype"),
    [GEOMETRIES[1], GEOMETRIES[2], GEOMETRIES[3]],
)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_matches_single_pass(num_splits, hq, hkv, head_dim, block_size, dtype):
    # Context 1 leaves most splits empty; 300 and 517 cross several splits and block boundaries.
    batch = make_batch([(0, 1), (299, 1), (516, 1), (block_size, 1)], hq, hkv, head_dim, block_size, dtype)
    single, split = run(batch, 1), run(batch, num_splits)
    assert_close(split, single, dtype)
    assert_close(split, reference(batch), dtype)


def test_split_k_on_a_mixed_batch():
    # The rule only splits decode batches, but the kernel is general: early query rows of a prefill
    # chunk see no key in late splits, which must merge with weight 0.
    batch = make_batch(batch_kinds(16)["mixed"], 8, 2, 64, 16)
    assert_close(run(batch, 3), reference(batch), torch.float32)


def test_split_rule():
    sms = 132
    assert num_kv_splits(1, 8, 8192, 1, sms) == MAX_SPLITS  # Llama-3-8B, batch 1, long context
    assert num_kv_splits(8, 8, 8192, 1, sms) == 3  # 64 programs: 3 slices fill 132 SMs
    assert num_kv_splits(32, 8, 8192, 1, sms) == 1  # 256 programs already fill the GPU
    assert num_kv_splits(1, 8, 1100, 1, sms) == 2  # short context: slices of >= 512 tokens only
    assert num_kv_splits(1, 8, 1000, 1, sms) == 1
    assert num_kv_splits(1, 8, 8192, 7, sms) == 1  # a batch with a prefill chunk: never split


def test_plan_picks_split_automatically_and_tiles_every_query():
    one = np.array([0, 1], dtype=np.int32)
    plan = plan_attention(one, np.array([8192], dtype=np.int32), 32, 8, torch.device("cpu"))
    assert plan.num_splits == MAX_SPLITS
    two = np.array([0, 1, 2], dtype=np.int32)  # 16 programs: 9 slices would fill 132 SMs, 4096 tokens allow 8
    assert plan_attention(two, np.array([4096, 30], dtype=np.int32), 32, 8, torch.device("cpu")).num_splits == 8
    qsl = np.array([0, 37, 38, 38, 58], dtype=np.int32)  # includes a sequence with no query
    plan = plan_attention(qsl, np.array([37, 90, 12, 80], dtype=np.int32), 32, 8, torch.device("cpu"))
    assert plan.num_splits == 1
    # The decode token gets a decode tile (16 rows / group of 4), the prefills 64-row tiles.
    decode, prefill = plan.launches
    assert (decode.block_q, decode.tile_seq.tolist()) == (4, [1])
    assert prefill.block_q == 16 and set(prefill.tile_seq.tolist()) == {0, 3}
    covered = {
        (s, q)
        for tiles in plan.launches
        for s, t in zip(tiles.tile_seq.tolist(), tiles.tile_q.tolist())
        for q in range(t, t + tiles.block_q)
    }
    for b, (lo, hi) in enumerate(zip(qsl[:-1], qsl[1:])):
        assert all((b, q) in covered for q in range(hi - lo))
    decode_only = plan_attention(np.array([0, 1, 2]), np.array([5, 9]), 32, 8, torch.device("cpu"))
    assert [t.block_q for t in decode_only.launches] == [4]


def test_merge_splits_matches_reference():
    gen = torch.Generator().manual_seed(0)
    part = dev(torch.randn(5, 3, 4, 80, generator=gen))
    lse = dev(torch.randn(5, 3, 4, generator=gen) * 4)
    lse[1:, 0, 0] = float("-inf")  # rows that only one slice saw
    lse[0, 2, :] = float("-inf")
    out = merge_splits(part, lse, torch.empty(3, 4, 80, device=DEVICE))
    torch.testing.assert_close(out, oracles.merge_splits(part, lse), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0], part[0, 0, 0])


# Sliding windows over WINDOW_BATCH: of one token, under a block, not a multiple of it, equal to a context (40),
# a whole KV tile (64), longer than every context. Few KV heads: the interpreter's time grows with the programs.


@pytest.mark.parametrize(
    ("window", "hq", "hkv", "head_dim", "block_size", "dtype"),
    [
        (1, 8, 1, 64, 32, torch.float16),
        (7, 4, 1, 32, 16, torch.float32),
        (17, 6, 2, 48, 16, torch.float32),
        (40, 8, 2, 128, 16, torch.float16),
        (64, 6, 1, 96, 16, torch.float32),
        (1000, 8, 1, 64, 32, torch.float16),
    ],
)
def test_sliding_window_matches_reference(window, hq, hkv, head_dim, block_size, dtype):
    # Blocks wholly before every query's window hold NaN: the kernel must not load them.
    batch = make_batch(WINDOW_BATCH, hq, hkv, head_dim, block_size, dtype)
    poisoned, blocks = poison_outside_window(batch, window)
    assert blocks or window == 1000
    assert_close(run(poisoned, num_splits=1, window=window), reference(batch, window), dtype)


@pytest.mark.parametrize(("window", "num_splits"), [(17, 5), (100, 5), (500, 2)])
def test_split_k_with_a_sliding_window(window, num_splits):
    # The splits share the window's KV tiles: 100 keys of 517 leave most of five splits empty.
    batch = make_batch([(0, 1), (299, 1), (516, 1), (16, 1)], 8, 1, 64, 16, torch.float16)
    poisoned, blocks = poison_outside_window(batch, window)
    assert blocks
    assert_close(run(poisoned, num_splits, window), reference(batch, window), torch.float16)


def test_split_k_with_a_sliding_window_on_a_mixed_batch():
    # Early rows of a prefill chunk see no key in late splits; a decode row's window starts mid-tile.
    batch = make_batch([(0, 17), (80, 1), (33, 9)], 4, 1, 32, 16)
    assert_close(run(batch, 3, window=21), reference(batch, 21), torch.float32)


def test_reference_is_sliding_window_attention():
    # Guards the reference itself: a fresh prompt and a chunk after a prefix, against SDPA with a band mask.
    for cached, queried, window in ((0, 40, 7), (30, 10, 16)):
        batch = make_batch([(cached, queried)], 4, 2, 32, 16, garbage=None)
        pos = torch.arange(cached + queried, device=DEVICE)
        slots = batch.block_tables[0].long()[pos // 16]
        k = batch.k_cache[slots, pos % 16].repeat_interleave(2, dim=1)
        v = batch.v_cache[slots, pos % 16].repeat_interleave(2, dim=1)
        back = pos[cached:, None] - pos[None, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            batch.query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=(back >= 0) & (back < window)
        ).transpose(0, 1)
        torch.testing.assert_close(reference(batch, window), sdpa, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(reference(batch, window), reference(batch))


def test_a_sliding_window_caps_the_split_count():
    one, lens = np.array([0, 1], dtype=np.int32), np.array([8192], dtype=np.int32)
    cpu = torch.device("cpu")
    assert plan_attention(one, lens, 32, 8, cpu).num_splits == MAX_SPLITS
    assert plan_attention(one, lens, 32, 8, cpu, sliding_window=1024).num_splits == 2  # 1024 keys: 2 x 512
    # The backend's windowed layers reuse the step's query tiles with their own split count.
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        query_start_loc=torch.from_numpy(one),
        seq_lens=torch.from_numpy(lens),
        block_tables=torch.zeros(1, 512, dtype=torch.int32),
        query_start_loc_np=one,
        seq_lens_np=lens,
    )
    full = TritonBackend.plan(meta, 32, 8, cpu)
    windowed = TritonBackend.plan(meta, 32, 8, cpu, sliding_window=1024)
    assert (full.num_splits, windowed.num_splits) == (MAX_SPLITS, 2) and windowed.launches is full.launches
    assert TritonBackend.plan(meta, 32, 8, cpu, sliding_window=1024) is windowed
