"""The CPU fast paths of TorchBackend against its reference (gather + SDPA, fp32 math)."""

from __future__ import annotations

import pytest
import torch
from kernel_batches import batch_kinds, make_batch

from inflight.executor.attention import TorchBackend, cpu_paged_attention

# fp32: both sum the same products in fp32, in different orders. bf16: the inputs are identical bf16
# values and both compute in fp32; only the output's rounding to bf16 (8 bits of mantissa: a relative
# step of 2**-8 = 0.0039) can differ by one ulp, so one bf16 step is the bound.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}

needs_op = pytest.mark.skipif(cpu_paged_attention.load() is None, reason="no C++ compiler to build the op")


@needs_op
@pytest.mark.parametrize(
    ("kind", "hq", "hkv", "head_dim", "block_size", "dtype"),
    [
        ("decode", 8, 4, 32, 16, torch.float32),  # the demo model's geometry
        ("decode", 16, 2, 128, 16, torch.bfloat16),
        ("mixed", 8, 2, 64, 32, torch.float32),  # decode rows picked out of a mixed batch
        ("mixed", 4, 4, 64, 16, torch.bfloat16),
        ("chunk_after_prefix", 8, 4, 64, 16, torch.float32),  # cached prefixes: the gather path
    ],
)
def test_native_matches_reference(kind, hq, hkv, head_dim, block_size, dtype):
    # Random (not NaN) garbage: the reference's padded gather multiplies masked rows by 0, and 0 * NaN = NaN.
    batch = make_batch(batch_kinds(block_size)[kind], hq, hkv, head_dim, block_size, dtype, garbage=None)
    scale = head_dim**-0.5
    native = TorchBackend(native=True)
    assert native.native
    ref = TorchBackend(native=False).attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata(), scale)
    meta = batch.metadata()
    out = native.attention(batch.query, batch.k_cache, batch.v_cache, meta, scale, key=batch.key, value=batch.value)
    again = native.attention(batch.query, batch.k_cache, batch.v_cache, meta, scale, key=batch.key, value=batch.value)
    assert torch.equal(out, again)  # the next layer reuses the step's plan
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # The op reads nothing outside each context: NaN everywhere else leaves its rows finite.
    poisoned = make_batch(batch_kinds(block_size)[kind], hq, hkv, head_dim, block_size, dtype)
    rows = torch.from_numpy(poisoned.query_start_loc_np[1:][poisoned.seq_lens_np > 0] - 1).long()
    decode_rows = rows[torch.from_numpy(poisoned.metadata().query_lens_np == 1)]
    out = TorchBackend(native=True).attention(
        poisoned.query,
        poisoned.k_cache,
        poisoned.v_cache,
        poisoned.metadata(),
        scale,
        key=poisoned.key,
        value=poisoned.value,
    )
    assert not out[decode_rows].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_attend_to_their_own_kv_without_the_cache(dtype):
    """seq_len == query length: the fast path reads key/value, never the cache (here: NaN-poisoned)."""
    batch = make_batch(batch_kinds(16)["prefill"], 8, 4, 32, 16, dtype)
    ref = TorchBackend().attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata(), 32**-0.5)
    poisoned = torch.full_like(batch.k_cache, float("nan"))
    out = TorchBackend().attention(
        batch.query, poisoned, poisoned, batch.metadata(), 32**-0.5, key=batch.key, value=batch.value
    )
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: SDPA in bf16 vs the reference's fp32 (2 ulps)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
