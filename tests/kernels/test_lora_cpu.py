"""The C++ multi-LoRA op (csrc/cpu/lora.cpp) against `reference.lora_apply`, its batch and thread invariance,
TorchBackend's hook, and the layer stack with adapters against the per-op path, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_cpu_forward import runner_for, step_inputs

from inflight.executor.attention import TorchBackend
from inflight.executor.cpu_forward import CpuForward
from inflight.models.lora import LoRASlots
from inflight.ops import cpu, reference

# fp32: both sum the same products in fp32, in different orders. bf16: both sum in fp32 and round once to bf16,
# so they can differ by one bf16 step where the fp32 sums straddle a rounding boundary.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}

needs_op = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler to build the ops")


def make_slots(slices: tuple[int, ...], in_features: int, max_loras: int, rank: int, seed: int = 0) -> LoRASlots:
    """Random adapters in every slot; slot 1 of a smaller rank zero-padded, as installed."""
    gen = torch.Generator().manual_seed(seed)
    slots = LoRASlots.empty(slices, in_features, max_loras, rank, torch.device("cpu"))
    slots.a.copy_(torch.randn(slots.a.shape, generator=gen) / in_features**0.5)
    slots.b.copy_(torch.randn(slots.b.shape, generator=gen) / rank**0.5)
    if rank > 8:
        slots.a[:, 1, 8:] = 0
        slots.b[1, :, 8:] = 0
    return slots


def make_step(tokens: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 1):
    """x as a column slice of a wider tensor (rows further apart than K), and the base linear's output."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, in_features + 5, generator=gen).to(dtype)
    return wide[:, 3 : 3 + in_features], torch.randn(tokens, out_features, generator=gen).to(dtype)


def native(out: torch.Tensor, x: torch.Tensor, slots: LoRASlots, token_slots: torch.Tensor) -> torch.Tensor:
    result = out.clone()
    cpu.lora_apply(result, x, slots.a, slots.b, slots.offsets, token_slots)
    return result


def expected(out: torch.Tensor, x: torch.Tensor, slots: LoRASlots, token_slots: torch.Tensor) -> torch.Tensor:
    result = out.clone()
    reference.lora_apply(result, x, slots.a, slots.b, slots.offsets, token_slots)
    return result


@needs_op
@pytest.mark.parametrize(
    ("slices", "rank", "in_features", "dtype"),
    [
        ((37,), 8, 75, torch.float32),  # o/down: one slice
        ((37,), 64, 130, torch.bfloat16),
        ((40, 29), 16, 100, torch.bfloat16),  # gate/up
        ((40, 29), 8, 64, torch.float32),  # K in whole 16s: no tail
        ((64, 24, 24), 64, 53, torch.float32),  # q/k/v
        ((64, 24, 24), 16, 75, torch.bfloat16),
    ],
)
def test_matches_reference(slices, rank, in_features, dtype):
    slots = make_slots(slices, in_features, max_loras=4, rank=rank)
    x, out = make_step(23, in_features, sum(slices), dtype)
    token_slots = torch.tensor([i % 5 - 1 for i in range(23)], dtype=torch.int32)  # -1, 0, 1, 2, 3, -1, ...
    got, want = native(out, x, slots, token_slots), expected(out, x, slots, token_slots)
    none, some = token_slots < 0, token_slots >= 0
    assert torch.equal(got[none], out[none])  # rows without an adapter: not a bit changed
    assert not torch.equal(got[some], out[some])
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_bits_alone_in_any_batch_on_any_thread_count(dtype):
    """K = 576, q/k/v slices of 576, 192, 192: enough work a row that 37 rows split across threads."""
    slots = make_slots((576, 192, 192), 576, max_loras=4, rank=16)
    x, out = make_step(37, 576, 960, dtype)
    token_slots = torch.tensor([(i * 7) % 5 - 1 for i in range(37)], dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native(out, x, slots, token_slots)
        torch.set_num_threads(2)
        two = native(out, x, slots, token_slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for i in range(37):
        alone = native(out[i : i + 1], x[i : i + 1], slots, token_slots[i : i + 1])
        assert torch.equal(alone[0], one[i]), f"row {i}"
    # A row's bits do not depend on its neighbours' slots either
    shuffled = token_slots.roll(3)
    shuffled[5] = token_slots[5]
    assert torch.equal(native(out, x, slots, shuffled)[5], one[5])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_output_gives_the_same_bits_wherever_its_slice_starts(dtype):
    """Outputs go in vectors from a slice's start, the rest through a partial one. With the same A in both slices,
    (5, 32) computes outputs 0-4 one by one and 32-36 in a group, (37,) the other way round, and every other
    output at another place in its vector: the bits must agree (the same chains, the same bf16 rounding)."""
    one = make_slots((37,), 75, max_loras=2, rank=16)
    two = LoRASlots(one.a_t.expand(2, -1, -1, -1).contiguous(), one.b_t, torch.tensor([0, 5, 37]))
    x, out = make_step(9, 75, 37, dtype)
    token_slots = torch.tensor([0, 1] * 4 + [-1], dtype=torch.int32)
    assert torch.equal(native(out, x, one, token_slots), native(out, x, two, token_slots))


@needs_op
def test_torch_backend_uses_the_op_on_cpu():
    slots = make_slots((40, 29), 75, max_loras=3, rank=16)
    token_slots = torch.tensor([0, -1, 2, 1, 0], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, out = make_step(5, 75, 69, dtype)
        got = out.clone()
        TorchBackend(native=True).lora_apply(got, x, slots, token_slots)
        # fp16: no C++ kernel, the reference runs
        want = native(out, x, slots, token_slots) if dtype != torch.float16 else expected(out, x, slots, token_slots)
        assert torch.equal(got, want)
        got = out.clone()
        TorchBackend(native=False).lora_apply(got, x, slots, token_slots)
        assert torch.equal(got, expected(out, x, slots, token_slots))


@needs_op
def test_bad_inputs_are_refused():
    slots = make_slots((40, 29), 75, max_loras=3, rank=8)
    x, out = make_step(4, 75, 69, torch.float32)
    with pytest.raises(RuntimeError, match="LoRA slot outside"):
        native(out, x, slots, torch.tensor([0, 3, -1, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="LoRA slot outside"):
        native(out, x, slots, torch.tensor([0, -2, -1, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="lora b"):
        native(out[:, :60], x, slots, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="lora offsets"):
        native(out, x, LoRASlots(slots.a_t, slots.b_t, torch.tensor([0, 40, 60])), torch.zeros(4, dtype=torch.int32))


# ---- the layer stack ----


def attach_lora(model, max_loras: int = 3, rank: int = 8, seed: int = 0) -> None:
    """Adapters on every linear of every layer: random in slots 0 and 2, slot 1 left empty (zero)."""
    cfg = model.cfg
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    gen = torch.Generator().manual_seed(seed)

    def slots(sizes: tuple[int, ...], k: int) -> LoRASlots:
        s = LoRASlots.empty(sizes, k, max_loras, rank, torch.device("cpu"))
        for slot in (0, 2):
            s.a[:, slot] = torch.randn(s.a[:, slot].shape, generator=gen) / k**0.5
            s.b[slot] = torch.randn(s.b[slot].shape, generator=gen) / rank**0.5
        return s

    for layer in model.model.layers:
        layer.self_attn.qkv_lora = slots((q, kv, kv), h)
        layer.self_attn.o_lora = slots((h,), q)
        layer.mlp.gate_up_lora = slots((inter, inter), h)
        layer.mlp.down_lora = slots((h,), inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_stack_with_adapters_gives_the_per_op_bits(demo_model_dir, dtype):
    if not cpu.gemm_supports(dtype, 64):
        pytest.skip(f"our GEMM does not run {dtype} on this CPU: the per-op path runs")
    runner = runner_for(demo_model_dir, dtype)
    attach_lora(runner.model)
    forward = CpuForward(runner.model, runner.kv_caches)  # built after the adapters are attached
    caches = [c for pair in runner.kv_caches for c in pair]
    gen = torch.Generator().manual_seed(0)
    for c in caches:  # the cached prefixes: anything but zeros
        c.copy_(torch.randn(c.shape, generator=gen))
    before = [c.clone() for c in caches]
    ids, positions, meta = step_inputs(runner)
    query_lens = torch.as_tensor(meta.query_lens_np)
    # test_cpu_forward's four sequences: slot 0, none, slot 2, slot 1 (empty)
    token_slots = torch.repeat_interleave(torch.tensor([0, -1, 2, 1], dtype=torch.int32), query_lens)

    def run(fn, slots: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for c, saved in zip(caches, before):
            c.copy_(saved)
        step_meta = step_inputs(runner)[2]
        step_meta.token_lora_slots = slots
        with torch.inference_mode():
            if fn is None:
                out = runner.model(ids, positions, step_meta, runner.kv_caches, runner.ops)
            else:
                out = fn(ids, positions, step_meta)
        return out, [c.clone() for c in caches]

    ref, ref_caches = run(None, token_slots)
    base, base_caches = run(None, None)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads, 2 * threads + 1}):
            torch.set_num_threads(n)
            out, out_caches = run(forward, token_slots)
            assert torch.equal(out, ref), f"{n} thread(s): hidden states differ"
            assert all(torch.equal(a, b) for a, b in zip(out_caches, ref_caches))
    finally:
        torch.set_num_threads(threads)
    # No adapter row this step: the bits of a step without LoRA (the per-op path's too)
    for slots in (None, torch.full_like(token_slots, -1)):
        out, out_caches = run(forward, slots)
        assert torch.equal(out, base)
        assert all(torch.equal(a, b) for a, b in zip(out_caches, base_caches))
    # The adapters changed their sequences' rows, and only theirs
    first = torch.cumsum(query_lens, 0) - query_lens
    rows = [torch.arange(int(s), int(s + n)) for s, n in zip(first, query_lens)]
    assert not torch.equal(ref[rows[0]], base[rows[0]]) and not torch.equal(ref[rows[2]], base[rows[2]])
    assert torch.equal(ref[rows[1]], base[rows[1]])
    bad = token_slots.clone()
    bad[0] = 3
    with pytest.raises(RuntimeError, match="LoRA slot outside"):
        run(forward, bad)
