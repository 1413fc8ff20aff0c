"""Sliding-window attention on CPU: the C++ per-row op and TorchBackend's plain-torch path against the torch
reference, with the blocks before every query's window poisoned (they may be freed and reused: never read)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from kernel_batches import WINDOW_BATCH, batch_kinds, make_batch, poison_outside_window

from inflight.executor import cpu_forward
from inflight.executor.attention import TorchBackend
from inflight.executor.attention.torch_backend import token_rows
from inflight.executor.cpu_forward import CpuForward
from inflight.models.loader import load_model
from inflight.ops import cpu, reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}  # test_cpu_ops.py says why
needs_op = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler to build the ops")
# Windows of one token, under a block, not a multiple of it, equal to a context (40), longer than every context.
WINDOWS = [1, 7, 17, 40, 1000]


def oracle(batch, window: int | None) -> torch.Tensor:
    q = batch.query
    args = (q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    return reference.paged_attention(*args, q.shape[-1] ** -0.5, window)


@needs_op
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(
    ("hq", "hkv", "head_dim", "dtype"),
    [(8, 2, 64, torch.float32), (8, 4, 64, torch.bfloat16), (6, 2, 48, torch.float32)],  # 48: no specialization
)
def test_native_op_matches_reference_and_reads_nothing_before_the_window(window, hq, hkv, head_dim, dtype):
    # NaN in every slot outside a context (make_batch) and in every block before every query's window.
    batch = make_batch(WINDOW_BATCH, hq, hkv, head_dim, 16, dtype)
    poisoned, blocks = poison_outside_window(batch, window)
    assert blocks or window == 1000
    scale = head_dim**-0.5
    out = TorchBackend(native=True).attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata(), scale,
                                              sliding_window=window)  # fmt: skip
    again = TorchBackend(native=True).attention(
        poisoned.query, poisoned.k_cache, poisoned.v_cache, poisoned.metadata(), scale, sliding_window=window
    )
    assert torch.isfinite(again).all() and torch.equal(out, again)
    torch.testing.assert_close(out.float(), oracle(batch, window).float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_op
def test_native_op_without_a_window_is_unchanged():
    batch = make_batch(WINDOW_BATCH, 8, 2, 64, 16)
    args = (batch.query, batch.k_cache, batch.v_cache, *token_rows(batch.metadata(), torch.device("cpu")), 0.125)
    full = cpu.paged_attention(*args)
    assert torch.equal(full, cpu.paged_attention(*args, 1000)) and torch.equal(full, cpu.paged_attention(*args, None))
    assert not torch.equal(full, cpu.paged_attention(*args, 17))
    with pytest.raises(RuntimeError, match="window"):
        cpu.load().paged_attention(torch.empty_like(batch.query), *args, -1)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 17, 40])
def test_a_windowed_prompt_token_is_the_same_bits_as_decoding_alone(dtype, window):
    """Prompt rows share tiles whose rows start their windows at different keys: each row's bits are still those
    of decoding alone at its position (what keeps greedy outputs independent of chunking)."""
    batch = make_batch([(50, 40), (3, 30)], 8, 2, 64, 16, dtype, garbage=None)
    meta = batch.metadata()
    out = TorchBackend(native=True).attention(batch.query, batch.k_cache, batch.v_cache, meta, 0.125,
                                              sliding_window=window)  # fmt: skip
    qsl, lens = meta.query_start_loc_np, meta.seq_lens_np
    for seq in range(len(lens)):
        for j, token in enumerate(range(qsl[seq], qsl[seq + 1])):
            position = int(lens[seq] - (qsl[seq + 1] - qsl[seq]) + j)
            alone = cpu.paged_attention(
                batch.query[token : token + 1],
                batch.k_cache,
                batch.v_cache,
                meta.block_tables[seq : seq + 1],
                torch.tensor([position + 1], dtype=torch.int32),
                0.125,
                window,
            )
            assert torch.equal(alone[0], out[token]), (seq, j)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_torch_path_matches_reference(window, dtype):
    """The SDPA paths (native=False): decode buckets, a chunk after a prefix through the gather, fresh prompts
    from this step's K/V (and, without them, through the gather). 20 decode rows make a bucket of 16 that
    mixes rows inside and past the window."""
    decode = [(n, 1) for n in range(3, 160, 8)]
    batch = make_batch(WINDOW_BATCH + decode, 8, 2, 32, 16, dtype, garbage=None)
    poisoned, blocks = poison_outside_window(batch, window)
    assert blocks or window == 1000
    ref = oracle(batch, window)
    tol = TOL[dtype] if dtype == torch.float32 else 2**-7  # bf16: SDPA in bf16 on fresh prompts (2 ulps)
    for kv in ((batch.key, batch.value), (None, None)):
        out = TorchBackend(native=False).attention(
            poisoned.query, poisoned.k_cache, poisoned.v_cache, poisoned.metadata(), 32**-0.5, *kv,
            sliding_window=window,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_plain_torch_path_keeps_a_plan_per_window():
    batch = make_batch(batch_kinds(16)["mixed"], 4, 2, 32, 16, garbage=None)
    meta = batch.metadata()
    ops = TorchBackend(native=False)
    for window in (None, 9, None, 9):  # layers of both kinds in one step (Gemma 3's local and global)
        out = ops.attention(batch.query, batch.k_cache, batch.v_cache, meta, 32**-0.5, sliding_window=window)
        torch.testing.assert_close(out, oracle(batch, window), atol=1e-5, rtol=1e-5)


def test_the_layer_stack_leaves_windowed_models_to_the_per_op_path(monkeypatch, demo_model_dir):
    # Everything else supported (the GEMM checks stubbed: this host may lack our GEMM); any window says no.
    monkeypatch.setattr(cpu_forward, "_runs_here", lambda linear, dtype: True)
    monkeypatch.setattr(cpu, "gemm_supports", lambda dtype, k: True)
    model, cfg = load_model(demo_model_dir, torch.float32, torch.device("cpu"))
    ops = SimpleNamespace(native=True)
    for window, layers, supported in ((None, (), True), (4096, (), False), (None, (None, 512), False)):
        model.cfg = replace(cfg, sliding_window=window, layer_sliding_windows=layers)
        assert CpuForward.supported(model, ops) is supported
