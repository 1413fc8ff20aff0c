"""Fused-MoE kernel against `reference.fused_moe`, the block alignment, batch invariance, the Triton backend's
hook (its sm_80/sm_90 compile: tests/kernels/test_kernel_compile.py)."""

from __future__ import annotations

import pytest
import torch
import triton
from kernel_batches import DEVICE, dev

from inflight.executor.attention.triton_backend import TritonBackend
from inflight.models.moe import FusedExperts
from inflight.ops import reference
from inflight.ops.triton import fused_moe as moe_ops
from inflight.ops.triton.fused_moe import MoEKernelConfig, fused_moe, get_config, moe_align_block_size

# fp32: the kernel and the reference sum the same products in different orders; fp16: one rounding each,
# so at most an ulp apart where the fp32 sums straddle a rounding boundary.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
HIDDEN, INTER = 40, 24  # multiples of no block size
# Small tiles: several M-blocks per expert, N tiles and K steps, and a grouped order over few M-blocks.
SMALL_TILES = MoEKernelConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


def make_experts(num_experts: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    return dev(w13.to(dtype), w2.to(dtype))


def make_step(
    tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int = 1, allowed: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x and the router's choice for it; with `allowed`, only those experts can be picked."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    if allowed is not None:
        barred = torch.ones(num_experts, dtype=torch.bool)
        barred[allowed] = False
        logits[:, barred] = float("-inf")
    topk_weights, topk_ids = reference.select_experts(logits, top_k, renormalize=True)
    return dev(x, topk_weights, topk_ids)


def test_align_groups_pairs_by_expert_in_order():
    topk_ids = dev(torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2]], dtype=torch.int32))
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m=4, num_experts=5)
    pad = 8  # T*k: past every pair
    assert sorted_ids.tolist() == [1, 2, 6, pad, 0, 4, 7, pad, 3, 5, pad, pad] + [pad] * 11
    assert expert_ids.tolist() == [0, 2, 3, -1, -1, -1]  # experts 1 and 4 have no pair, so no block
    assert num_post.tolist() == [12]
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32


@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "block_m"), [(1, 1, 8, 16), (7, 4, 32, 16), (64, 2, 8, 64)])
def test_align_invariants(tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    sorted_ids, expert_ids, num_post = (t.cpu() for t in moe_align_block_size(dev(topk_ids), block_m, num_experts))
    numel, flat = tokens * top_k, topk_ids.flatten()
    assert sorted_ids.shape == (numel + num_experts * (block_m - 1),)
    assert expert_ids.shape == (triton.cdiv(sorted_ids.shape[0], block_m),)
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(num_post)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()) and used % block_m == 0
    body = sorted_ids[:used]
    assert sorted(body[body < numel].tolist()) == list(range(numel))  # every pair once
    assert (sorted_ids[used:] == numel).all()  # the rest is padding
    blocks = used // block_m
    assert (expert_ids[blocks:] == -1).all()
    assert (expert_ids[:blocks].diff() >= 0).all()  # each expert's blocks together, in expert order
    assert set(expert_ids[:blocks].tolist()) == set(flat.tolist())  # no block for an expert without pairs
    for b in range(blocks):
        ids = body[b * block_m : (b + 1) * block_m]
        ids = ids[ids < numel]
        assert len(ids) and (flat[ids.long()] == expert_ids[b]).all(), b
        assert (ids.diff() > 0).all()  # token order within an expert


def test_align_needs_no_values_on_the_host():
    """Shapes follow from T, k, E and block_m alone: it runs on meta tensors, as a CUDA graph capture needs."""
    aligned = moe_align_block_size(torch.empty(5, 2, dtype=torch.int32, device="meta"), 16, num_experts=4)
    assert [tuple(t.shape) for t in aligned] == [(10 + 4 * 15,), (5,), (1,)]


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "dtype"),
    [
        (1, 8, 1, torch.float32),
        (1, 32, 4, torch.float32),
        (7, 8, 2, torch.float32),
        (7, 32, 4, torch.float32),  # 28 pairs over 32 experts: some experts get none
        (64, 8, 2, torch.float32),
        (64, 32, 4, torch.float32),
        (1, 8, 2, torch.float16),
        (7, 32, 4, torch.float16),
        (64, 8, 4, torch.float16),
    ],
)
def test_fused_moe_matches_reference(tokens, num_experts, top_k, dtype):
    w13, w2 = make_experts(num_experts, dtype)
    x, topk_weights, topk_ids = make_step(tokens, num_experts, top_k, dtype)
    got = fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == x.shape and got.dtype == dtype
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_tiles_and_experts_without_tokens(dtype):
    """Several M-blocks per expert, N tiles and K steps; experts no token picks hold NaN, which no tile reads."""
    w13, w2 = make_experts(8, dtype)
    idle = [1, 3, 5, 7]
    w13[idle], w2[idle] = float("nan"), float("nan")
    x, topk_weights, topk_ids = make_step(37, 8, 2, dtype, allowed=[0, 2, 4, 6])
    got = fused_moe(x, w13, w2, topk_weights, topk_ids, SMALL_TILES)
    assert torch.isfinite(got).all()
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_a_rows_result_is_the_same_alone_and_in_a_batch():
    """Bit for bit on a GPU: block sizes never depend on the batch and an fp32 `tl.dot` there is a chain of
    FMAs over K in order for each output element, whatever the row's place in its tile. The interpreter's dot
    is numpy's (OpenBLAS), whose order depends on that place: there a row is bit-equal where it keeps its place
    (the first token is first in each of its experts' blocks, alone or not) and within an ulp or two elsewhere."""
    w13, w2 = make_experts(8, torch.float32)
    x, topk_weights, topk_ids = make_step(64, 8, 2, torch.float32)
    batch = fused_moe(x, w13, w2, topk_weights, topk_ids)
    for t in (0, 5, 31, 63):
        alone = fused_moe(x[t : t + 1], w13, w2, topk_weights[t : t + 1], topk_ids[t : t + 1])
        if DEVICE.type == "cuda" or t == 0:
            assert torch.equal(alone[0], batch[t]), t
        else:
            torch.testing.assert_close(alone[0], batch[t], atol=1e-6, rtol=1e-6)


def test_empty_step():
    w13, w2 = make_experts(4, torch.float32)
    x, topk_weights, topk_ids = make_step(0, 4, 2, torch.float32)
    assert fused_moe(x, w13, w2, topk_weights, topk_ids).shape == (0, HIDDEN)


def test_config_comes_from_the_table_by_shape_and_device(monkeypatch):
    cpu = torch.device("cpu")
    assert get_config(128, 768, torch.float32, cpu) == moe_ops.FP32_CONFIG
    assert get_config(128, 768, torch.float16, cpu) == moe_ops.DEFAULT_CONFIG
    monkeypatch.setattr(moe_ops, "_device_name", lambda device: "NVIDIA H200")
    assert get_config(128, 768, torch.bfloat16, cpu) == moe_ops.CONFIGS[(128, 768, "NVIDIA H200")]
    assert get_config(128, 1024, torch.bfloat16, cpu) == moe_ops.DEFAULT_CONFIG
    for config in moe_ops.CONFIGS.values():
        # one config serves both GEMMs and every step: the sizes the kernel's tiles need
        assert all(v & (v - 1) == 0 for v in (config.block_m, config.block_n, config.block_k))
        assert config.block_m >= 16 and config.block_n >= 16 and config.block_k >= 16


def test_bad_inputs_are_refused():
    w13, w2 = make_experts(4, torch.float32)
    x, topk_weights, topk_ids = make_step(3, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        fused_moe(x[:, :-1], w13, w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="share"):
        fused_moe(x.half(), w13, w2, topk_weights, topk_ids)
    if triton.knobs.runtime.interpret:
        with pytest.raises(ValueError, match="bf16"):
            fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), topk_weights, topk_ids)


def test_triton_backend_runs_the_layers_experts():
    experts = FusedExperts(8, HIDDEN, INTER).to(DEVICE)
    experts.w13.data, experts.w2.data = make_experts(8, torch.float32)
    x, topk_weights, topk_ids = make_step(9, 8, 2, torch.float32)
    got = TritonBackend().fused_moe(x, experts, topk_weights, topk_ids)
    want = reference.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is computed wrongly by the interpreter")
def test_bf16_on_a_gpu():
    w13, w2 = make_experts(32, torch.bfloat16)
    x, topk_weights, topk_ids = make_step(64, 32, 4, torch.bfloat16)
    batch = fused_moe(x, w13, w2, topk_weights, topk_ids)
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(batch, want, atol=2e-2, rtol=2e-2)
    for t in (0, 17, 63):
        alone = fused_moe(x[t : t + 1], w13, w2, topk_weights[t : t + 1], topk_ids[t : t + 1])
        assert torch.equal(alone[0], batch[t]), t
