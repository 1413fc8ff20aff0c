"""Weight packing on CPU: bf16 within its one rounding of the exact product, fp32 within rounding, on every
layer shape; a row's output does not depend on how many rows share the call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inflight.models.loader import load_model
from inflight.models.packed_linear import PackedLinear, RowPaddedLinear, pack_linears, rows_bucket, warm_up_onednn
from inflight.ops import cpu


def test_bf16_packed_rounds_the_fp32_product_once(demo_model_dir):
    """Both kernels (ours, oneDNN) sum in fp32 and round once to bf16: within half a bf16 ulp of the fp32
    product (relative 2^-8), plus fp32 summation-order noise."""
    model, cfg = load_model(demo_model_dir, torch.bfloat16, "cpu")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        pytest.skip("this torch build or CPU has no oneDNN bf16")
    assert len(packed) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for p in packed:
            weight = torch.randn(p.out_features, p.in_features, generator=gen).bfloat16()
            ref = nn.Linear(p.in_features, p.out_features, bias=False).bfloat16()
            ref.weight.data.copy_(weight)
            mine = PackedLinear(ref)
            for rows in (1, 5, 64):
                x = torch.randn(rows, p.in_features, generator=gen).bfloat16()
                exact = x.float() @ weight.float().T
                err = (mine(x).float() - exact).abs()
                assert (err <= exact.abs() * 2**-8 + 1e-4).all(), err.max()


def test_fp32_packed_matches_unpacked_within_rounding(demo_model_dir):
    model, cfg = load_model(demo_model_dir, torch.float32, "cpu")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        pytest.skip("this torch build has no oneDNN")
    assert len(packed) == 4 * cfg.num_hidden_layers + 1
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for p in packed:
            ref = nn.Linear(p.in_features, p.out_features, bias=False)
            ref.weight.data.copy_(torch.randn(p.out_features, p.in_features, generator=gen))
            mine = PackedLinear(ref)
            for rows in (1, 5, 64):
                x = torch.randn(rows, p.in_features, generator=gen)
                # MKL (nn.Linear) and oneDNN sum in different orders: fp32 rounding, nothing more.
                torch.testing.assert_close(mine(x), ref(x), rtol=1e-5, atol=1e-4)


def test_fp16_is_left_alone(demo_model_dir):
    model, _ = load_model(demo_model_dir, torch.float16, "cpu")
    assert pack_linears(model) == 0 and not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tied_lm_head_is_packed_where_our_gemm_runs_it(tmp_path, dtype, monkeypatch):
    """The output layer is a large share of a small model's decode step: a tied lm_head gets a packed copy
    of the embedding for our GEMM (the embedding keeps its tensor, the logits HF's within rounding), unless
    that copy would pass the bound; then it shares the embedding's tensor as before."""
    pytest.importorskip("transformers")
    from test_loader import make_checkpoint

    from inflight.models import loader

    make_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)
    model, _ = load_model(tmp_path, dtype, "cpu")
    if not cpu.gemm_supports(dtype, model.model.embed_tokens.weight.shape[1]):
        pytest.skip("our GEMM does not run this dtype here")
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.own_gemm
    hidden = torch.randn(3, model.lm_head.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    tied = torch.nn.functional.linear(hidden, model.model.embed_tokens.weight)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(model.lm_head(hidden).float(), tied.float(), atol=tol, rtol=tol)
    with torch.inference_mode():  # a row's logits do not depend on the rows beside it
        assert torch.equal(torch.cat([model.lm_head(h[None]) for h in hidden]), model.lm_head(hidden))

    monkeypatch.setattr(loader, "TIED_HEAD_COPY_MAX_BYTES", 1024)
    model, _ = load_model(tmp_path, dtype, "cpu")
    assert not isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [(704, 512, False), (1536, 742, True), (4096, 512, False), (528, 100, True)],  # 528: not whole AMX tiles
)
def test_rows_do_not_depend_on_how_many_share_the_call(dtype, in_features, out_features, bias):
    """Batch invariance: a row's output is the same alone, in 2, 3, 9, 10, 16, 17 or 256 rows. oneDNN sums K in
    another order for a single row when K > 1024 (AVX512-BF16), so there a lone row must take the batched
    kernel; our GEMM sums every row alike (742 outputs: a part-filled last panel; with a bias)."""
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    gen = torch.Generator().manual_seed(0)
    linear.weight.data.copy_(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
    if bias:
        linear.bias.data.copy_(torch.randn(out_features, generator=gen))
    if pack_linears(nn.Sequential(linear)) == 0:
        pytest.skip("this torch build or CPU has no oneDNN bf16")
    packed = PackedLinear(linear)
    x = torch.randn(256, in_features, generator=gen).to(dtype)  # oneDNN: ~1e-4 of outputs differ, 131k of them
    with torch.inference_mode():
        together = packed(x)
        for rows in (1, 2, 3, 9, 10, 16, 17):  # blocks of 1-10 rows: 9 and 10 in one, 17 as 9 + 8
            split = torch.cat([packed(x[i : i + rows]) for i in range(0, 256, rows)])  # 256 = 85 * 3 + 1
            assert torch.equal(split, together), f"{rows} row(s) per call"
        exact = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
        rel = 2**-8 if dtype == torch.bfloat16 else 1e-5  # bf16: rounded once; fp32: summation order
        assert ((together.float() - exact).abs() <= exact.abs() * rel + 1e-4).all()


def test_tied_bf16_head_shares_the_embedding_and_pads_a_lone_row(tmp_path, monkeypatch):
    """Where the tied head is not packed (over the copy bound, or no GEMM of ours), it shares the embedding."""
    transformers = pytest.importorskip("transformers")
    from test_loader import make_checkpoint

    from inflight.models import loader

    monkeypatch.setattr(loader, "TIED_HEAD_COPY_MAX_BYTES", 0)
    make_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True, hidden_size=1536, head_dim=16)
    assert transformers
    model, _ = load_model(tmp_path, torch.bfloat16, "cpu")
    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        pytest.skip("this torch build or CPU has no oneDNN bf16")
    head = model.lm_head
    assert isinstance(head, RowPaddedLinear) and head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(512, 1536, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        assert torch.equal(torch.cat([head(h[None]) for h in hidden]), head(hidden))


def test_bf16_gemm_takes_amx_tiles_where_the_cpu_has_them():
    """On a CPU with AMX our bf16 GEMM runs on its tiles (faster than the AVX512-BF16 kernel from
    tens of rows up); elsewhere, or with a K that is not whole 32-wide
    tiles (the 528 case above), on AVX512-BF16."""
    from test_bf16_reference import cpuinfo_flags

    from inflight.ops import cpu

    module = cpu.load()
    if module is None or not module.supports_bf16():
        pytest.skip("no AVX512-BF16 build on this machine")
    has_amx = {"amx_tile", "amx_bf16"} <= cpuinfo_flags()
    if has_amx and not _kernel_grants_amx():
        pytest.skip("the CPU has AMX but this kernel (or a seccomp filter) refuses its tile state")
    assert module.amx_for(32) == has_amx


def _kernel_grants_amx() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64
    return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


def test_loading_a_bf16_model_says_where_its_gemms_run(demo_model_dir, caplog):
    """The operator sees whether the AMX tiles are in use (a CPU without them, or a kernel or seccomp filter
    that refuses their state, leaves bf16 on the slower AVX512-BF16 kernel)."""
    import logging

    from test_bf16_reference import cpuinfo_flags

    from inflight.ops import cpu

    if not cpu.gemm_supports(torch.bfloat16, 64):
        pytest.skip("no AVX512-BF16 build on this machine")
    with caplog.at_level(logging.INFO, logger="inflight"):
        model, cfg = load_model(demo_model_dir, torch.bfloat16, "cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bf16 GEMMs:")]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.own_gemm]
    tiles = sum(cpu.amx_for(m.in_features) for m in packed)
    assert lines == [f"bf16 GEMMs: {tiles} of {len(packed)} layers on AMX tiles, the rest on AVX512-BF16"]
    if {"amx_tile", "amx_bf16"} <= cpuinfo_flags() and _kernel_grants_amx():
        assert tiles == len(packed) > 0  # the demo model's widths are all whole 32s


def test_onednn_sees_a_bounded_number_of_row_counts(monkeypatch):
    """oneDNN builds and caches a kernel per input shape, each holding memory (its cache keeps 1024): a server
    whose steps carry every row count from 1 to max_num_batched_tokens grew by hundreds of MB. Row counts are
    rounded up to a few dozen sizes; the padded rows never reach the caller."""
    monkeypatch.setattr(cpu, "gemm_supports", lambda dtype, k: False)  # the oneDNN path, on any CPU
    linear = nn.Linear(64, 48)
    packed = PackedLinear(linear)
    seen: set[tuple[int, ...]] = set()
    run = packed._linear
    monkeypatch.setattr(packed, "_linear", lambda x: seen.add(tuple(x.shape)) or run(x))
    x = torch.randn(600, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        together = packed(x)
        for rows in range(1, 601):
            out = packed(x[:rows])
            assert out.shape == (rows, 48)
            assert torch.allclose(out, together[:rows], rtol=1e-5, atol=1e-5), rows
    assert len(seen) <= 48, sorted(seen)


def test_warm_up_meets_every_shape_a_step_can_bring(monkeypatch):
    """After the warm-up, no row count (up to the step's limit) or thread count a step may use makes oneDNN
    build another kernel: the server's memory is what it holds from its start. The output layer is warmed only
    up to the rows it can be given."""
    monkeypatch.setattr(cpu, "gemm_supports", lambda dtype, k: False)
    model = nn.Module()
    model.up, model.down = PackedLinear(nn.Linear(32, 64)), PackedLinear(nn.Linear(64, 32))
    model.lm_head = PackedLinear(nn.Linear(32, 100, bias=False))
    seen: set[tuple[str, int, int]] = set()
    for name in ("up", "down", "lm_head"):
        module = getattr(model, name)
        run = module._linear
        monkeypatch.setattr(
            module, "_linear", lambda x, n=name, r=run: seen.add((n, x.shape[0], torch.get_num_threads())) or r(x)
        )
    calls = warm_up_onednn(model, max_rows=300, head_rows=20, thread_counts=[2, 1])
    warmed = set(seen)
    assert calls == len(warmed) > 0
    assert max(rows for name, rows, _ in warmed if name == "lm_head") == rows_bucket(20) < rows_bucket(300)
    previous = torch.get_num_threads()
    with torch.inference_mode():
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for rows in range(1, 301):
                model.up(torch.randn(rows, 32))
                model.down(torch.randn(rows, 64))
                if rows <= 20:
                    model.lm_head(torch.randn(rows, 32))
    torch.set_num_threads(previous)
    assert seen == warmed
    assert torch.get_num_threads() == previous
