"""The C++ MoE router (csrc/cpu/moe_router.cpp) against the gate's linear and `reference.select_experts`, its
batch invariance, and TorchBackend's hook."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.executor.attention import TorchBackend
from inflight.models.moe import Router
from inflight.ops import cpu, reference

needs_op = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler to build the ops")


def make_router(tokens: int, experts: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """x as a column slice of a wider tensor (rows further apart than H) and a router weight."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + 5, generator=gen).to(dtype)[:, 1 : 1 + hidden]
    weight = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype)
    return x, weight


@needs_op
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden"), [(1, 8, 2, 64), (37, 32, 4, 130), (300, 60, 8, 48)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_linear_and_reference(tokens, experts, top_k, hidden, renormalize, dtype):
    x, weight = make_router(tokens, experts, hidden, dtype)
    weights, ids = cpu.moe_route(x, weight, top_k, renormalize)
    logits = F.linear(x.float(), weight.float()).to(dtype)  # fp32 sums rounded once, as the op
    want_weights, want_ids = reference.select_experts(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, top_k)
    # Other summation orders may swap two near-equal experts (in bf16 the rounded logits often tie): every expert
    # chosen is within rounding of the reference's k-th, and where the choices agree the weights match.
    probs = torch.softmax(logits.float(), dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (probs.gather(1, ids.long()) >= probs.topk(top_k).values[:, -1:] * (1 - tol)).all()
    same = (ids == want_ids).all(dim=1)
    assert same.float().mean() > (0.97 if dtype == torch.float32 else 0.8)
    torch.testing.assert_close(weights[same], want_weights[same], atol=1e-5, rtol=1e-5)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(dtype):
    x, weight = make_router(300, 32, 512, dtype)
    together = cpu.moe_route(x, weight, 4, True)
    for i in (0, 7, 299):
        alone = cpu.moe_route(x[i : i + 1], weight, 4, True)
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i]), f"row {i}"


@needs_op
def test_ties_go_to_the_lower_expert():
    x = torch.ones(1, 16)
    weight = torch.zeros(6, 16)
    weight[[1, 4]] = 1.0  # experts 1 and 4 tie, above the rest
    _, ids = cpu.moe_route(x, weight, 3, False)
    assert ids.tolist() == [[1, 4, 0]]


@needs_op
def test_torch_backend_uses_the_op_on_cpu():
    router = Router(67, 8)
    x, weight = make_router(9, 8, 67, torch.float32)
    router.weight.data.copy_(weight)
    got = TorchBackend(native=True).select_experts(x, router, 2, True)
    want = cpu.moe_route(x, weight, 2, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = TorchBackend(native=False).select_experts(x, router, 2, True)
    want = reference.select_experts(router(x), 2, True)
    assert torch.equal(ref[0], want[0]) and torch.equal(ref[1], want[1])
