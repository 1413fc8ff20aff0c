"""The C++ MoE op (csrc/cpu/moe.cpp) against `reference.fused_moe`, its batch and thread invariance, and
TorchBackend's hook."""

from __future__ import annotations

import pytest
import torch

from inflight.executor.attention import TorchBackend
from inflight.models.moe import FusedExperts
from inflight.ops import cpu, reference

needs_op = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler to build the ops")


def make_experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2


def make_step(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 1):
    """x as a column slice of a wider tensor (rows further apart than H), and HF's routing of random logits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + 7, generator=gen).to(dtype)[:, 2 : 2 + hidden]
    topk_weights, topk_ids = reference.select_experts(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, topk_weights, topk_ids


@needs_op
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [
        (1, 8, 1, 64, 32),  # decode of one token: most experts idle
        (5, 8, 2, 67, 45),  # widths that are no multiple of any vector
        (37, 32, 4, 130, 77),
        (128, 8, 2, 48, 40),  # many rows an expert: several row tiles
        (128, 32, 4, 96, 200),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(tokens, experts, top_k, hidden, inter, dtype):
    w13, w2 = make_experts(experts, hidden, inter, dtype)
    x, topk_weights, topk_ids = make_step(tokens, experts, top_k, hidden, dtype)
    got = cpu.fused_moe(x, cpu.moe_pack(w13, w2), topk_weights, topk_ids)
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if dtype == torch.float32:  # the same products in other orders
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # rounded where HF rounds: a sum that straddles a rounding boundary lands a step or two away
        torch.testing.assert_close(got.float(), want.float(), atol=2**-6, rtol=2**-6)
        assert (got != want).float().mean() < 0.02


@needs_op
def test_idle_experts_and_repeated_ones():
    """Experts with no token are skipped; a token may name one expert twice (each slot counts); no tokens at all."""
    w13, w2 = make_experts(6, 40, 24, torch.float32)
    packed = cpu.moe_pack(w13, w2)
    x, _, _ = make_step(3, 6, 2, 40, torch.float32)
    topk_ids = torch.tensor([[4, 4], [1, 4], [4, 1]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])
    got = cpu.fused_moe(x, packed, topk_weights, topk_ids)
    torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, topk_weights, topk_ids), atol=1e-5, rtol=1e-5)
    empty = cpu.fused_moe(x[:0], packed, topk_weights[:0], topk_ids[:0])
    assert empty.shape == (0, 40)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_bits_alone_in_any_batch_on_any_thread_count(dtype):
    """37 rows on 8 experts (2 each): an expert's rows run in tiles of every size, a row alone in a tile of one."""
    w13, w2 = make_experts(8, 256, 200, dtype)
    packed = cpu.moe_pack(w13, w2)
    x, topk_weights, topk_ids = make_step(37, 8, 2, 256, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.fused_moe(x, packed, topk_weights, topk_ids)
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(cpu.fused_moe(x, packed, topk_weights, topk_ids), one), f"{n} threads"
    finally:
        torch.set_num_threads(threads)
    for i in range(37):
        alone = cpu.fused_moe(x[i : i + 1], packed, topk_weights[i : i + 1], topk_ids[i : i + 1])
        assert torch.equal(alone[0], one[i]), f"row {i}"
    # Every other row moved onto row 5's experts (its tiles fill up), or onto other experts: row 5 keeps its bits
    for ids in (topk_ids[5].expand(37, -1), (topk_ids + 1) % 8):
        crowded = ids.contiguous().clone()
        crowded[5] = topk_ids[5]
        assert torch.equal(cpu.fused_moe(x, packed, topk_weights, crowded)[5], one[5])


@needs_op
def test_torch_backend_uses_the_op_on_cpu():
    experts = FusedExperts(8, 67, 45)
    w13, w2 = make_experts(8, 67, 45, torch.float32)
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    x, topk_weights, topk_ids = make_step(9, 8, 2, 67, torch.float32)
    got = TorchBackend(native=True).fused_moe(x, experts, topk_weights, topk_ids)
    assert experts.cpu_packed is not None  # packed on first use, kept
    assert torch.equal(got, cpu.fused_moe(x, experts.cpu_packed, topk_weights, topk_ids))
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert torch.equal(TorchBackend(native=False).fused_moe(x, experts, topk_weights, topk_ids), want)
    half = experts.half()  # fp16: no C++ kernel, the reference runs
    got = TorchBackend(native=True).fused_moe(x.half(), half, topk_weights, topk_ids)
    assert torch.equal(got, reference.fused_moe(x.half(), half.w13, half.w2, topk_weights, topk_ids))


@needs_op
def test_bad_inputs_are_refused():
    w13, w2 = make_experts(4, 40, 24, torch.float32)
    packed = cpu.moe_pack(w13, w2)
    x, topk_weights, topk_ids = make_step(3, 4, 2, 40, torch.float32)
    with pytest.raises(RuntimeError, match="expert outside"):
        cpu.fused_moe(x, packed, topk_weights, torch.tensor([[0, 4], [1, 2], [3, 0]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="topk_ids"):
        cpu.fused_moe(x, packed, topk_weights, topk_ids.long())
    with pytest.raises(RuntimeError, match="moe_pack"):
        cpu.fused_moe(x[:, :32], packed, topk_weights, topk_ids)
    with pytest.raises(RuntimeError, match="moe_pack"):
        cpu.fused_moe(x.bfloat16(), packed, topk_weights, topk_ids)
