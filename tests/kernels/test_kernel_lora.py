"""Multi-LoRA shrink/expand kernels against `reference.lora_apply`, the step metadata, batch invariance, the
Triton backend's hook (their sm_80/sm_90 compile: tests/kernels/test_kernel_compile.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_batches import DEVICE, dev

from inflight.executor.attention.triton_backend import TritonBackend
from inflight.models.lora import LoRASlots
from inflight.ops import reference
from inflight.ops.triton import lora as lora_ops
from inflight.ops.triton.lora import lora_apply, lora_expand, lora_kernel_meta, lora_shrink

# fp32: the kernels and the reference sum the same products in different orders; fp16: one rounding each,
# so at most an ulp apart where the fp32 sums straddle a rounding boundary.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
IN_FEATURES = 40  # not a multiple of the kernels' K step


def make_slots(slices: tuple[int, ...], max_loras: int, max_rank: int, seed: int = 0) -> LoRASlots:
    """Random adapters in every slot, of rank max_rank and (slot 1) a smaller one zero-padded, as installed."""
    gen = torch.Generator().manual_seed(seed)
    slots = LoRASlots.empty(slices, IN_FEATURES, max_loras, max_rank, torch.device("cpu"))
    slots.a.copy_(torch.randn(slots.a.shape, generator=gen) / IN_FEATURES**0.5)
    slots.b.copy_(torch.randn(slots.b.shape, generator=gen) / max_rank**0.5)
    if max_loras > 1 and max_rank > 8:
        slots.a[:, 1, 8:] = 0
        slots.b[1, :, 8:] = 0
    return LoRASlots(*dev(slots.a_t, slots.b_t), slots.offsets)


def make_step(tokens: int, width: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dev(
        torch.randn(tokens, IN_FEATURES, generator=gen).to(dtype), torch.randn(tokens, width, generator=gen).to(dtype)
    )


def applied(out: torch.Tensor, x: torch.Tensor, slots: LoRASlots, token_slots: torch.Tensor) -> torch.Tensor:
    result = out.clone()
    lora_apply(result, x, slots.a, slots.b, slots.offsets, token_slots)
    return result


def expected(out: torch.Tensor, x: torch.Tensor, slots: LoRASlots, token_slots: torch.Tensor) -> torch.Tensor:
    result = out.clone()
    reference.lora_apply(result, x, slots.a, slots.b, slots.offsets, token_slots)
    return result


def test_kernel_meta_groups_rows_by_slot_in_order():
    token_slots = dev(torch.tensor([2, -1, 0, 2, -1, 0, 0, 3], dtype=torch.int32))
    meta = lora_kernel_meta(token_slots, max_loras=4)
    assert meta.token_indices_sorted_by_lora_ids.tolist() == [2, 5, 6, 0, 3, 7, 1, 4]  # stable; no slot last
    assert meta.num_tokens_per_lora.tolist() == [3, 0, 2, 1, 2]  # slot 1 has none; the last counts -1
    assert meta.lora_token_start_loc.tolist() == [0, 3, 3, 5, 6, 8]
    assert meta.token_indices_sorted_by_lora_ids.dtype == torch.int32
    assert (meta.max_loras, meta.num_tokens) == (4, 8)


def test_kernel_meta_needs_no_values_on_the_host():
    """Shapes follow from T and max_loras alone: it runs on meta tensors (no data), as a graph capture needs."""
    meta = lora_kernel_meta(torch.empty(5, dtype=torch.int32, device="meta"), max_loras=3)
    shapes = [meta.token_indices_sorted_by_lora_ids, meta.num_tokens_per_lora, meta.lora_token_start_loc]
    assert [tuple(t.shape) for t in shapes] == [(5,), (4,), (5,)]


@pytest.mark.parametrize(
    ("slices", "rank", "dtype"),
    [
        ((48,), 8, torch.float32),
        ((40, 24), 16, torch.float32),
        ((40, 24, 24), 64, torch.float32),
        ((40, 24, 24), 16, torch.float16),
    ],
)
def test_lora_apply_matches_reference(slices, rank, dtype):
    slots = make_slots(slices, max_loras=3, max_rank=rank)
    x, out = make_step(37, sum(slices), dtype)
    gen = torch.Generator().manual_seed(2)
    token_slots = dev(torch.randint(-1, 3, (37,), generator=gen, dtype=torch.int32))
    token_slots[:4] = dev(torch.tensor([-1, 0, 1, 2], dtype=torch.int32))  # every slot and none, whatever the draw
    got, want = applied(out, x, slots, token_slots), expected(out, x, slots, token_slots)
    none = token_slots < 0
    assert torch.equal(got[none], out[none])  # rows without an adapter: untouched, bit for bit
    assert not torch.allclose(got[~none].float(), out[~none].float(), atol=1e-2)  # the others really change
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_shrink_and_expand_separately():
    slots = make_slots((24, 16), max_loras=2, max_rank=16)
    x, out = make_step(5, 40, torch.float32)
    token_slots = dev(torch.tensor([1, -1, 0, 1, 1], dtype=torch.int32))
    meta = lora_kernel_meta(token_slots, 2)
    buf = lora_shrink(x, slots.a, meta)
    assert buf.shape == (2, 5, 16) and buf.dtype == torch.float32
    rows = (token_slots >= 0).nonzero().flatten()
    want = torch.einsum("tk,strk->str", x[rows], slots.a[:, token_slots[rows].long()])
    torch.testing.assert_close(buf[:, rows], want, atol=1e-5, rtol=1e-5)
    got = out.clone()
    lora_expand(buf, slots.b, slots.offsets, meta, got)
    torch.testing.assert_close(got, expected(out, x, slots, token_slots), atol=1e-5, rtol=1e-5)


def test_one_token_and_no_adapter_rows():
    slots = make_slots((40, 24, 24), max_loras=2, max_rank=16)
    x, out = make_step(6, 88, torch.float32)
    one = dev(torch.tensor([1], dtype=torch.int32))
    torch.testing.assert_close(applied(out[:1], x[:1], slots, one), expected(out[:1], x[:1], slots, one))
    assert torch.equal(applied(out, x, slots, dev(torch.full((6,), -1, dtype=torch.int32))), out)
    empty = dev(torch.zeros(0, dtype=torch.int32))
    assert applied(out[:0], x[:0], slots, empty).shape == (0, 88)


def test_strided_input_and_output_views():
    slots = make_slots((24, 16), max_loras=2, max_rank=8)
    gen = torch.Generator().manual_seed(5)
    wide_x, wide_out = dev(torch.randn(7, 2 * IN_FEATURES, generator=gen), torch.randn(7, 100, generator=gen))
    x, out = wide_x[:, 1::2], wide_out[:, 10:50]  # non-unit column stride; a row stride past the width
    token_slots = dev(torch.tensor([0, 1, -1, 1, 0, 0, -1], dtype=torch.int32))
    want = expected(out, x, slots, token_slots)
    before = wide_out.clone()
    lora_apply(out, x, slots.a, slots.b, slots.offsets, token_slots)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(wide_out[:, :10], before[:, :10]) and torch.equal(wide_out[:, 50:], before[:, 50:])


@pytest.mark.parametrize("tokens", [37, lora_ops.DECODE_MAX_TOKENS + 3])  # the decode and the prefill row tile
def test_a_rows_result_is_the_same_alone_and_in_a_batch(tokens):
    """Bit for bit on a GPU: an fp32 `tl.dot` there is a chain of FMAs over K in order for each output element,
    whatever the row's place in its tile. The interpreter's dot is numpy's (OpenBLAS), whose order depends on
    the row's place in the tile, so there it is equal to within an ulp or two."""
    slots = make_slots((40, 24), max_loras=3, max_rank=32)
    x, out = make_step(tokens, 64, torch.float32)
    gen = torch.Generator().manual_seed(6)
    token_slots = dev(torch.randint(-1, 3, (tokens,), generator=gen, dtype=torch.int32))
    token_slots[[0, 5, tokens - 1]] = dev(torch.tensor([2, 0, 2], dtype=torch.int32))
    batch = applied(out, x, slots, token_slots)
    for t in (0, 5, tokens - 1):
        alone = applied(out[t : t + 1], x[t : t + 1], slots, token_slots[t : t + 1])
        if DEVICE.type == "cuda":
            assert torch.equal(alone[0], batch[t]), t
        else:
            torch.testing.assert_close(alone[0], batch[t], atol=1e-6, rtol=1e-6)


def test_triton_backend_reuses_the_steps_meta_until_the_slots_change():
    backend = TritonBackend()
    slots = make_slots((24, 16), max_loras=2, max_rank=8)
    x, out = make_step(6, 40, torch.float32)
    token_slots = dev(torch.tensor([0, -1, 1, 1, 0, -1], dtype=torch.int32))
    got = out.clone()
    backend.lora_apply(got, x, slots, token_slots)
    meta = backend._lora_meta[2]
    torch.testing.assert_close(got, expected(out, x, slots, token_slots), atol=1e-5, rtol=1e-5)
    got = out.clone()
    backend.lora_apply(got, x, slots, token_slots)  # the next layer of the step
    assert backend._lora_meta[2] is meta
    token_slots.copy_(dev(torch.tensor([1, 1, -1, 0, -1, 0], dtype=torch.int32)))  # a buffer refilled in place
    got = out.clone()
    backend.lora_apply(got, x, slots, token_slots)
    assert backend._lora_meta[2] is not meta
    torch.testing.assert_close(got, expected(out, x, slots, token_slots), atol=1e-5, rtol=1e-5)
