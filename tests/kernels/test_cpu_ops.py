"""The C++ CPU ops of TorchBackend against its plain-torch reference (and HF's rounding points in bf16)."""

from __future__ import annotations

import pytest
import torch
from kernel_batches import batch_kinds, make_batch

from inflight.executor.attention import TorchBackend
from inflight.ops import cpu

# fp32: both sum the same products in fp32, in different orders. bf16: the inputs are identical bf16
# values and both compute in fp32; only the output's rounding to bf16 (8 bits of mantissa: a relative
# step of 2**-8 = 0.0039) can differ by one ulp, so one bf16 step is the bound.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}

needs_op = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler to build the ops")


@needs_op
@pytest.mark.parametrize(
    ("kind", "hq", "hkv", "head_dim", "block_size", "dtype"),
    [
        ("decode", 8, 4, 32, 16, torch.float32),  # the demo model's geometry
        ("decode", 16, 2, 128, 16, torch.bfloat16),
        ("mixed", 8, 2, 64, 32, torch.float32),  # decode rows picked out of a mixed batch
        ("mixed", 4, 4, 64, 16, torch.bfloat16),
        ("chunk_after_prefix", 8, 4, 64, 16, torch.float32),  # cached prefixes: the gather path
        ("decode", 6, 2, 48, 16, torch.float32),  # a head size without a compiled-in specialization
        ("decode", 8, 1, 64, 16, torch.bfloat16),  # MQA: one KV head, nothing to split across threads
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
    out = TorchBackend(native=True).attention(
        poisoned.query,
        poisoned.k_cache,
        poisoned.v_cache,
        poisoned.metadata(),
        scale,
        key=poisoned.key,
        value=poisoned.value,
    )
    assert not out.isnan().any()


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


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_do_not_depend_on_their_batch(dtype):
    """A sequence's attention is bit for bit the same alone and in a batch (the op splits work differently)."""
    batch = make_batch(batch_kinds(16)["decode"], 8, 4, 64, 16, dtype, garbage=None)
    meta = batch.metadata()
    full = cpu.paged_attention(batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, 0.125)
    for row in range(batch.query.shape[0]):
        alone = cpu.paged_attention(
            batch.query[row : row + 1],
            batch.k_cache,
            batch.v_cache,
            meta.block_tables[row : row + 1],
            meta.seq_lens[row : row + 1],
            0.125,
        )
        assert torch.equal(alone[0], full[row])


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step at x's magnitude: the most two roundings of the same value can differ by."""
    return x.float().abs() * 2**-7 + 1e-6


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: split across threads
@pytest.mark.parametrize("hidden", [96, 100])  # bf16: whole 16-lane vectors, and the generic loop
def test_norms_and_silu_match_the_reference(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    inter = 160
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    ref, nat = TorchBackend(native=False), TorchBackend(native=True)

    def close(got, want, steps=1):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert ((got.float() - want.float()).abs() <= steps * _bf16_step(want)).all()

    close(nat.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    want_out, want_res = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    got_out, got_res = nat.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(got_res, want_res)  # the residual add rounds once, as HF's does
    close(got_out, want_out)
    # Two roundings in a row (silu's, then the product's): silu's may land one step apart (a different exp),
    # and the product carries that step before rounding again.
    close(nat.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), steps=2)
    # Row by row: a row's result does not depend on the rows beside it.
    assert torch.equal(nat.rms_norm(x[-1:], weight, 1e-5)[0], nat.rms_norm(x, weight, 1e-5)[-1])
    assert torch.equal(nat.silu_and_mul(gate_up[-1:])[0], nat.silu_and_mul(gate_up)[-1])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_qkv_views_and_kv_write(dtype):
    """q and k are strided views into the fused qkv output; rope rotates them there; write_kv copies k/v out."""
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d, max_pos = 37, 8, 2, 64, 512
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos_sin = (freqs.cos(), freqs.sin())

    def views(buf):
        q, k, v = buf.split((hq * d, hkv * d, hkv * d), dim=-1)
        return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)

    # HF's apply_rotary_pos_emb on the same values: cos/sin cast to the dtype, each product and the sum rounded.
    cos = torch.cat([cos_sin[0][positions]] * 2, dim=-1)[:, None].to(dtype)
    sin = torch.cat([cos_sin[1][positions]] * 2, dim=-1)[:, None].to(dtype)

    def hf_rope(x):
        rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)
        return (x * cos) + (rotated * sin)

    q_ref, k_ref = (hf_rope(x) for x in views(qkv.clone())[:2])
    buf = qkv.clone()
    q, k, v = views(buf)
    q_out, k_out = TorchBackend(native=True).rope(q, k, positions, cos_sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place, no copies
    for got, want in ((q, q_ref), (k, k_ref)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the same roundings at the same points: the same bits
            assert torch.equal(got, want)
    assert torch.equal(views(buf)[2], views(qkv)[2])  # v untouched

    k_cache = torch.full((8, 16, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    TorchBackend(native=True).write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], k) and torch.equal(v_cache.view(-1, hkv, d)[slots], v)
    assert k_cache.view(-1, hkv, d).isnan().all(-1).all(-1).sum() == 8 * 16 - t  # nothing else written
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        TorchBackend(native=True).write_kv(k, v, k_cache, v_cache, slots + 8 * 16)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_token_is_the_same_bits_as_a_decode_step_at_its_position(dtype):
    """Every row is attention at one position: a prompt's token j equals decoding alone at j, bit for bit,
    whatever the chunk around it (what makes greedy outputs independent of chunking and prefix hits)."""
    batch = make_batch(batch_kinds(16)["chunk_after_prefix"], 8, 4, 64, 16, dtype, garbage=None)
    meta = batch.metadata()
    out = TorchBackend(native=True).attention(batch.query, batch.k_cache, batch.v_cache, meta, 0.125)
    qsl, lens = meta.query_start_loc_np, meta.seq_lens_np
    for seq in range(len(lens)):
        for j, token in enumerate(range(qsl[seq], qsl[seq + 1])):
            position = lens[seq] - (qsl[seq + 1] - qsl[seq]) + j
            alone = cpu.paged_attention(
                batch.query[token : token + 1],
                batch.k_cache,
                batch.v_cache,
                meta.block_tables[seq : seq + 1],
                torch.tensor([position + 1], dtype=torch.int32),
                0.125,
            )
            assert torch.equal(alone[0], out[token])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])  # the SIMD path and the scalar one
def test_prompt_tiles_give_each_row_its_bits_alone(dtype, head_dim):
    """Consecutive rows of one sequence share each K/V block's reads (tiles of up to 16 rows; bf16 blocks widened
    once): a 40-row chunk (three tiles), two sequences that share a prefix's blocks with consecutive lengths
    (a tile across sequences), and a lone row each give exactly the bits of their rows run one at a time."""
    g = torch.Generator().manual_seed(3)
    bs, hkv, hq, blocks = 16, 3, 9, 40
    k = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(blocks, bs, hkv, head_dim, generator=g).to(dtype)
    seq_a = torch.randperm(blocks, generator=g)[:8].to(torch.int32)  # 128 tokens of context at most
    seq_b = torch.cat([seq_a[:3], torch.tensor([blocks - 1], dtype=torch.int32)])  # shares a's first 3 blocks
    rows = [(seq_a, n) for n in range(60, 100)]  # a prompt chunk: positions 59..98
    rows += [(seq_a, 40), (seq_b, 41)]  # consecutive lengths, different tables: same blocks for both
    rows += [(seq_b, 64)]  # reads b's own last block
    width = 8
    tables = torch.stack([torch.cat([t, torch.full((width - len(t),), -1, dtype=torch.int32)]) for t, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(len(rows), hq, head_dim, generator=g).to(dtype)
    full = cpu.paged_attention(q, k, v, tables, lens, head_dim**-0.5)
    for r in range(len(rows)):
        alone = cpu.paged_attention(q[r : r + 1], k, v, tables[r : r + 1], lens[r : r + 1], head_dim**-0.5)
        assert torch.equal(alone[0], full[r]), f"row {r}"


@needs_op
@pytest.mark.parametrize("shape", [(1, 5), (3, 16), (32, 49152), (7, 49157), (2, 33), (5, 1)])
def test_argmax_is_torch_argmax(shape):
    gen = torch.Generator().manual_seed(shape[1])
    logits = torch.randn(*shape, generator=gen)
    assert torch.equal(cpu.argmax(logits), logits.argmax(-1))
    ties = torch.randint(0, 3, shape, generator=gen).float()  # many equal maxima: the first one wins
    assert torch.equal(cpu.argmax(ties), ties.argmax(-1))


@needs_op
def test_argmax_nan_inf_and_strided_rows():
    logits = torch.zeros(5, 100)
    logits[1, 50] = logits[1, 70] = float("nan")  # torch answers the first NaN
    logits[2, 99] = float("nan")  # in the tail past whole vectors
    logits[3] = -float("inf")
    logits[4, 3], logits[4, 90] = float("inf"), float("inf")
    assert cpu.argmax(logits).tolist() == logits.argmax(-1).tolist() == [0, 50, 99, 0, 3]
    wide = torch.randn(8, 200)
    wide[:, 150:] = 1e9  # padded vocabulary columns outside the view
    assert torch.equal(cpu.argmax(wide[:, :150]), wide[:, :150].argmax(-1))


def _torch_gumbel_noise(keys: torch.Tensor, hashed: torch.Tensor) -> torch.Tensor:
    """The sampler's noise as torch ops (its GPU path): lowbias32, u = x / 2**32 clamped, -log(-log1p(-u))."""
    x = keys[:, None] ^ hashed
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B - (1 << 32)), (16, None)):
        x = x ^ (x >> shift)
        if mul is not None:
            x = (x * mul) & 0xFFFFFFFF
    f = x.to(torch.float32).mul_(-(2.0**-32)).clamp_(-(1.0 - 2.0**-24), -(2.0**-33))
    return f.log1p_().neg_().log_().neg_()


def _keys_and_hashes(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    from inflight.executor.sampling_noise import id_hashes, row_keys

    keys = row_keys(torch.arange(rows, dtype=torch.int64) * 7919 + (1 << 40), torch.arange(rows, dtype=torch.int64))
    return keys, id_hashes(torch.arange(vocab))


@needs_op
def test_gumbel_noise_finds_torchs_vector_logs():
    # Where the build has AVX-512 or AVX2 the noise's log1p and log come from the SLEEF inside libtorch_cpu; a
    # lookup that failed would leave a scalar call per lane (the same noise within ulps, ~50x slower).
    assert cpu.load().gumbel_vector_logs() == cpu.load().supports_f32()


@needs_op
@pytest.mark.parametrize("shape", [(1, 5), (3, 16), (32, 49152), (4, 33)])
def test_gumbel_noise_is_the_samplers_formula(shape):
    keys, hashed = _keys_and_hashes(*shape)
    ref = _torch_gumbel_noise(keys, hashed)
    native = cpu.gumbel_noise(keys, hashed.to(torch.int32))
    # The same hash and clamp; log1p and log from SLEEF (torch's CPU kernels may take MKL's): within ulps.
    torch.testing.assert_close(native, ref, rtol=1e-6, atol=1e-6)
    assert bool(native.isfinite().all()) and float(native.max()) < 22.9 and float(native.min()) > -2.9
    # A token's noise does not depend on where it sits: the vocabulary's order or a window's.
    order = torch.randperm(shape[1])
    window = cpu.gumbel_noise(keys, hashed[order].expand(shape[0], -1).contiguous().to(torch.int32))
    assert torch.equal(window, native[:, order])


@needs_op
@pytest.mark.parametrize("shape", [(1, 5), (3, 16), (32, 49152), (7, 1000), (2, 1)])
def test_gumbel_argmax_is_the_argmax_of_scaled_logits_plus_noise(shape):
    keys, hashed = _keys_and_hashes(*shape)
    h32 = hashed.to(torch.int32)
    noise = cpu.gumbel_noise(keys, h32)
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1])) * 3
    temps = torch.linspace(0.3, 1.7, shape[0])
    ones = torch.ones(shape[0])
    assert torch.equal(cpu.gumbel_argmax(logits, ones, keys, h32, None), (logits + noise).argmax(-1))
    scaled = logits / temps[:, None]  # the division rounds as torch's: the scores are the same bits
    assert torch.equal(cpu.gumbel_argmax(logits, temps, keys, h32, None), (scaled + noise).argmax(-1))
    floor = scaled.max(-1).values - 1
    masked = (scaled + noise).masked_fill(scaled < floor[:, None], -float("inf"))
    assert torch.equal(cpu.gumbel_argmax(logits, temps, keys, h32, floor), masked.argmax(-1))
    odd = logits.clone()
    odd[:, ::3] = -float("inf")
    odd[0, 4 % shape[1]] = odd[-1, -1] = float("nan")  # torch answers a row's first NaN
    assert torch.equal(cpu.gumbel_argmax(odd, temps, keys, h32, None), (odd / temps[:, None] + noise).argmax(-1))
    dead = torch.full(shape, -float("inf"))
    assert cpu.gumbel_argmax(dead, temps, keys, h32, None).tolist() == [0] * shape[0]
    wide = torch.randn(shape[0], shape[1] + 7) * 3  # rows of a padded vocabulary: strided
    view = wide[:, : shape[1]]
    expect = (view / temps[:, None] + noise).argmax(-1)
    assert torch.equal(cpu.gumbel_argmax(view, temps, keys, h32, None), expect)
