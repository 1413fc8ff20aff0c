"""TritonBackend against TorchBackend through the engine's seam (`inflight.executor.attention`)."""

from __future__ import annotations

import pytest
import torch
from kernel_batches import batch_kinds, dev, make_batch

from inflight.executor.attention import TorchBackend, get_backend
from inflight.executor.attention.triton_backend import TritonBackend

TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def test_get_backend_returns_the_triton_backend():
    backend = get_backend("triton")
    assert isinstance(backend, TritonBackend) and backend.name == "triton"


@pytest.mark.parametrize(
    ("kind", "hq", "hkv", "head_dim", "block_size", "dtype"),
    [
        ("mixed", 8, 4, 32, 16, torch.float32),  # the demo model's geometry
        ("mixed", 8, 2, 80, 32, torch.float16),
        ("decode", 16, 2, 128, 16, torch.float32),
        ("chunk_after_prefix", 4, 4, 64, 32, torch.float32),
    ],
)
def test_layer_step_matches_torch_backend(kind, hq, hkv, head_dim, block_size, dtype):
    """One attention layer's step: RoPE, KV write of the new tokens, paged attention."""
    batch = make_batch(batch_kinds(block_size)[kind], hq, hkv, head_dim, block_size, dtype, garbage=None)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(1024).float()[:, None] * inv_freq
    cos_sin = dev(freqs.cos(), freqs.sin())
    gen = torch.Generator().manual_seed(5)
    new_k = dev(torch.randn(batch.key.shape, generator=gen).to(dtype))  # differs from the cached rows
    new_v = dev(torch.randn(batch.value.shape, generator=gen).to(dtype))
    scale = head_dim**-0.5

    results = []
    for backend in (TorchBackend(), TritonBackend()):
        meta = batch.metadata()
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        q, k = backend.rope(batch.query.clone(), new_k.clone(), batch.positions, cos_sin)
        backend.write_kv(k, new_v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attention(q, k_cache, v_cache, meta, scale)
        out2 = backend.attention(q, k_cache, v_cache, meta, scale)  # next layer: plan reused from meta.cache
        assert torch.equal(out, out2)
        results.append((q, k, k_cache, v_cache, out))

    (q0, k0, kc0, vc0, out0), (q1, k1, kc1, vc1, out1) = results
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(q1, q0, **tol)
    torch.testing.assert_close(k1, k0, **tol)
    torch.testing.assert_close(kc1, kc0, **tol)
    torch.testing.assert_close(vc1, vc0, **tol)
    torch.testing.assert_close(out1, out0, **tol)
    assert not torch.allclose(out0.float(), batch.query.float(), atol=0.1)  # attention did something


def test_norms_match_torch_backend():
    gen = torch.Generator().manual_seed(6)
    x, residual = dev(torch.randn(2, 5, 256, generator=gen), torch.randn(2, 5, 256, generator=gen))
    weight = dev(torch.randn(256, generator=gen))
    ref, tri = TorchBackend(), TritonBackend()
    torch.testing.assert_close(tri.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    normed, new_residual = tri.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_residual = ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(normed, ref_normed)
    torch.testing.assert_close(new_residual, ref_residual)


def test_torch_write_kv_never_reads_a_value_back_to_the_host():
    """On CUDA a host read (`bool(t)`, `.item()`, a boolean-mask index) syncs every layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from inflight.ops import reference

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    slots = torch.tensor([3, 9, 31, 16, 0])
    with Ops() as ops:
        TorchBackend().write_kv(key, value, k_cache, v_cache, slots)
    host_reads = [op for op in ops.seen if "_local_scalar_dense" in op or "nonzero" in op or "is_nonzero" in op]
    assert not host_reads, ops.seen
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
