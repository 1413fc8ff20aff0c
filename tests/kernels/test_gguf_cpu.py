"""The GGUF GEMM (csrc/cpu/gguf_gemm.cpp) against our own GEMM over gguf-py's dequantization, bit for bit.

Random bytes with finite fp16 scales are valid blocks of every format. fp32: the kernel's weights are gguf's
fp32 values and it sums the same FMAs in the same order as `cpu.linear` over the dequantized weight; bf16:
the same over the weight rounded to bf16. Rows 1..8 of a chunk take the fused kernels, more the dequantized
panel: both must give the reference's bits, so a row's result cannot depend on its batch.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from inflight.ops import cpu, reference

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
DTYPES = [torch.float32, torch.bfloat16]

# Byte offsets of each block's fp16 scales (d, and dmin / m where the format has one).
HALF_OFFSETS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row bytes] of random blocks, their fp16 scales finite and of a size like a model's."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + 1000 * int(qtype))
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in HALF_OFFSETS[qtype]:
        scales = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def ours_dequantized(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Our fp32/bf16 GEMM over the dequantized weight (rounded to x's dtype): the target, bit for bit."""
    return cpu.linear(x, cpu.pack(w.to(x.dtype)), w.shape[0], bias)


def skip_unless(qtype: Q, dtype: torch.dtype, k: int) -> None:
    if not cpu.gguf_supports(int(qtype), dtype, k):
        pytest.skip(f"no GGUF kernel for {qtype.name} x {dtype} on this CPU")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bits_equal_our_gemm_over_the_dequantized_weight(qtype, dtype):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    gen = torch.Generator().manual_seed(int(qtype))
    for n, k in [(100, 2 * block), (48, 256 if block == 32 else 512), (7, 3 * block if block == 32 else 256)]:
        skip_unless(qtype, dtype, k)
        raw = random_blocks(qtype, n, k, seed=n)
        w = reference.gguf_weight(raw, int(qtype), k)
        packed = cpu.gguf_pack(raw, int(qtype), n, k)
        bias = torch.randn(n, generator=gen).to(dtype)
        for m in (1, 3, 8, 9, 10, 17, 64, 70):
            x = torch.randn(m, k, generator=gen).to(dtype)
            for b in (None, bias):
                got = cpu.gguf_linear(x, packed, int(qtype), n, b)
                want = ours_dequantized(x, w, b)
                assert torch.equal(got, want), f"{qtype.name} {dtype} N={n} K={k} M={m} bias={b is not None}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda q: q.name)
def test_a_row_is_the_same_bits_at_any_batch_size_and_thread_count(qtype, dtype):
    n, k = 150, 512
    skip_unless(qtype, dtype, k)
    raw = random_blocks(qtype, n, k, seed=3)
    packed = cpu.gguf_pack(raw, int(qtype), n, k)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    full = cpu.gguf_linear(x, packed, int(qtype), n)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads, 3}):
            torch.set_num_threads(t)
            for rows in (slice(0, 1), slice(5, 7), slice(60, 69), slice(0, 130), slice(129, 130)):
                assert torch.equal(cpu.gguf_linear(x[rows], packed, int(qtype), n), full[rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_may_be_a_column_slice_of_a_wider_output(dtype):
    """A fused projection of parts of different types: each writes its columns of one output, nothing else."""
    k = 256
    skip_unless(Q.Q4_K, dtype, k)
    parts = [(Q.Q4_K, 64), (Q.Q6_K, 50), (Q.Q8_0, 30)]
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = torch.full((11, 144), float("nan"), dtype=dtype)
    col, want = 0, []
    for i, (qtype, n) in enumerate(parts):
        raw = random_blocks(qtype, n, k, seed=i)
        for rows in (slice(0, 3), slice(3, 11)):  # a fused kernel's and a panel's chunk, both into the slice
            cpu.gguf_linear(x[rows], cpu.gguf_pack(raw, int(qtype), n, k), int(qtype), n, out=out[rows, col : col + n])
        want.append(ours_dequantized(x, reference.gguf_weight(raw, int(qtype), k), None))
        col += n
    assert torch.equal(out, torch.cat(want, dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_embedding_rows_are_the_dequantized_rows(qtype, dtype):
    n, k = 100, 512
    skip_unless(qtype, dtype, k)
    raw = random_blocks(qtype, n, k, seed=7)
    packed = cpu.gguf_pack(raw, int(qtype), n, k)
    ids = torch.tensor([0, 99, 47, 48, 5, 5, 96])
    got = cpu.gguf_embedding(ids, packed, int(qtype), n, k, dtype)
    assert torch.equal(got, reference.gguf_weight(raw, int(qtype), k)[ids].to(dtype))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu.gguf_embedding(torch.tensor([n]), packed, int(qtype), n, k, dtype)


def test_packed_bytes_stay_close_to_the_files():
    for qtype in TYPES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        k = 2 * max(block, 256)
        if not cpu.gguf_supports(int(qtype), torch.float32, k):
            pytest.skip("no GGUF kernel on this CPU")
        raw = random_blocks(qtype, 96, k)
        assert cpu.gguf_pack(raw, int(qtype), 96, k).numel() <= 1.15 * raw.numel(), qtype.name


def test_shapes_that_do_not_fit_are_refused():
    if not cpu.gguf_supports(int(Q.Q4_0), torch.float32, 64):
        pytest.skip("no GGUF kernel on this CPU")
    raw = random_blocks(Q.Q4_0, 10, 64)
    packed = cpu.gguf_pack(raw, int(Q.Q4_0), 10, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        cpu.gguf_linear(torch.randn(2, 64), packed, int(Q.Q4_0), 49)
    with pytest.raises(RuntimeError, match="whole blocks"):
        cpu.gguf_pack(random_blocks(Q.Q4_K, 10, 256), int(Q.Q4_K), 10, 100)
    with pytest.raises(RuntimeError, match="no GGUF kernel"):
        cpu.gguf_pack(raw, int(Q.Q2_K), 10, 256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_linear_fuses_parts_of_different_types(dtype):
    from inflight.models.quantized import GGUFWeight, QuantizedLinear

    k = 256
    skip_unless(Q.Q6_K, dtype, k)
    shapes = [(Q.Q4_K, 64), (Q.Q4_K, 40), (Q.Q6_K, 40)]  # q, k (one segment), v
    parts = [GGUFWeight(int(q), random_blocks(q, n, k, seed=i), (n, k)) for i, (q, n) in enumerate(shapes)]
    bias = torch.randn(144, generator=torch.Generator().manual_seed(4))
    layer = QuantizedLinear.from_gguf(parts, dtype, torch.device("cpu"), bias=bias)
    assert [s.qtype for s in layer.segments] == [int(Q.Q4_K), int(Q.Q6_K)]
    w = torch.cat([reference.gguf_weight(p.data, p.qtype, k) for p in parts])
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    # the dequantized model's layer: one GEMM over the concatenated weight, the bias in x's dtype
    want = ours_dequantized(x.reshape(10, k), w, bias.to(dtype)).view(2, 5, 144)
    assert torch.equal(layer(x), want)
    assert layer.weight_bytes() == sum(s.data.numel() for s in layer.segments) + 144 * bias.to(dtype).element_size()


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_embedding_and_its_tied_head_share_one_copy(dtype):
    from inflight.models.quantized import GGUFWeight, QuantizedEmbedding

    vocab, k = 200, 64
    skip_unless(Q.Q8_0, dtype, k)
    raw = random_blocks(Q.Q8_0, vocab, k, seed=9)
    emb = QuantizedEmbedding.from_gguf(GGUFWeight(int(Q.Q8_0), raw, (vocab, k)), dtype, torch.device("cpu"))
    head = emb.lm_head()
    assert head.segments[0].data is emb.segment.data and head.weight_bytes() == 0
    w = reference.gguf_weight(raw, int(Q.Q8_0), k)
    ids = torch.tensor([[3, 199], [0, 3]])
    assert torch.equal(emb(ids), w[ids].to(dtype))
    h = torch.randn(3, k, generator=torch.Generator().manual_seed(8)).to(dtype)
    assert torch.equal(head(h), ours_dequantized(h, w, None))
