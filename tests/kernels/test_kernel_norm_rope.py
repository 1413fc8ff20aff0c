"""RMSNorm, fused residual add + RMSNorm and RoPE kernels against their torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_batches import dev

from inflight.ops import reference
from inflight.ops.triton.rms_norm import fused_add_rms_norm, rms_norm
from inflight.ops.triton.rope import rotary_embedding

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize(("hidden", "dtype"), [(256, torch.float32), (96, torch.float16), (4096, torch.float16)])
def test_rms_norm(hidden, dtype):
    gen = torch.Generator().manual_seed(0)
    x = dev((torch.randn(7, hidden, generator=gen) * 3).to(dtype))
    w = dev(torch.randn(hidden, generator=gen).to(dtype))
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(("hidden", "dtype"), [(256, torch.float32), (80, torch.float16)])
def test_fused_add_rms_norm(hidden, dtype):
    gen = torch.Generator().manual_seed(1)
    x = dev(torch.randn(5, hidden, generator=gen).to(dtype))
    residual = dev(torch.randn(5, hidden, generator=gen).to(dtype))
    w = dev(torch.randn(hidden, generator=gen).to(dtype))
    x_before, r_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, w, 1e-5)
    ref_normed, ref_residual = reference.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(new_residual, ref_residual)  # same rounding of the sum, bit for bit
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # inputs untouched


def test_rms_norm_per_head_on_a_strided_view():
    # Qwen3's q/k norm: normalize every head of q (a slice of a fused qkv output) over head_dim.
    gen = torch.Generator().manual_seed(2)
    qkv = dev(torch.randn(6, (4 + 2 + 2) * 64, generator=gen))
    q = qkv[:, : 4 * 64].view(6, 4, 64)
    w = dev(torch.randn(64, generator=gen))
    out = rms_norm(q.reshape(-1, 64), w, 1e-6).view(6, 4, 64)
    torch.testing.assert_close(out, reference.rms_norm(q, w, 1e-6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rms_norm(q, w, 1e-6), out)  # any leading shape works


def _cos_sin(head_dim: int, max_pos: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq
    return dev(freqs.cos(), freqs.sin())


@pytest.mark.parametrize(
    ("hq", "hkv", "head_dim", "dtype"),
    [(8, 2, 64, torch.float32), (4, 4, 80, torch.float16), (12, 2, 128, torch.float32), (8, 4, 32, torch.float16)],
)
def test_rope(hq, hkv, head_dim, dtype):
    gen = torch.Generator().manual_seed(3)
    q = dev(torch.randn(9, hq, head_dim, generator=gen).to(dtype))
    k = dev(torch.randn(9, hkv, head_dim, generator=gen).to(dtype))
    positions = dev(torch.tensor([0, 1, 2, 511, 17, 16, 15, 300, 3]))
    cos, sin = _cos_sin(head_dim)
    ref_q, ref_k = reference.rope(q, k, positions, cos, sin)
    out_q, out_k = rotary_embedding(q, k, positions, cos, sin)
    torch.testing.assert_close(out_q, ref_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert not torch.allclose(out_q[3].float(), out_q[3].float().roll(1, -1))  # sanity: not trivial


def test_rope_position_zero_is_identity_and_views_are_rotated_in_place():
    gen = torch.Generator().manual_seed(4)
    qkv = dev(torch.randn(3, 4 + 2 + 2, 64, generator=gen))
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided views, as cut from a fused projection
    before = qkv.clone()
    cos, sin = _cos_sin(64)
    positions = dev(torch.tensor([0, 7, 100]))
    ref_q, ref_k = reference.rope(q, k, positions, cos, sin)
    out_q, out_k = rotary_embedding(q, k, positions, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(out_q[0], before[0, :4])
    torch.testing.assert_close(qkv[:, :4], ref_q) and torch.testing.assert_close(qkv[:, 4:6], ref_k)
    assert torch.equal(qkv[:, 6:], before[:, 6:])  # v untouched
