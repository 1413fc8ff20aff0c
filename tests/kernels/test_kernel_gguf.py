"""GGUF-block GEMV, GEMM and embedding kernels against `gguf.quants.dequantize` (reference.gguf_*).

Blocks are random bytes with finite fp16 scales (every byte pattern of the quants is a valid block), so
every bit of every field is exercised. Dequantization is exact: the embedding gather matches the
reference bit for bit. Products are compared with the fp32 product of the dequantized weight; the bound
is relative to sum|x||w| (what an fp32 sum of K products can lose), so a single wrong weight fails.
"""

from __future__ import annotations

import pytest
import torch
import triton
from kernel_batches import dev

from inflight.ops import reference
from inflight.ops.triton.gguf_gemm import (
    BLOCK_LAYOUT,
    GEMM_BLOCK_M,
    GEMV_MAX_ROWS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    gemv_num_splits,
    gguf_embedding,
    gguf_gemm,
    gguf_gemv,
    gguf_matmul,
    gguf_supports,
)
from inflight.ops.triton.split_k_decode import device_sm_count

# Byte offsets of the fp16 fields (d, and m/dmin where the format has one) within a block.
FP16_FIELDS = {Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q5_1: [0, 2], Q8_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208]}
FORMATS = list(BLOCK_LAYOUT)
# Row lengths: three 32-weight blocks (a K tile of the GEMV only partly filled), one 256-weight super-block.
IN_FEATURES = {q: 96 if BLOCK_LAYOUT[q][0] == 32 else 256 for q in FORMATS}
OUT_FEATURES = 37  # no multiple of any tile width
# fp32: the observed error is ~2^-23 of sum|x||w| (a few roundings of an fp32 sum); 2^-20 leaves room
# for other summation orders (a GPU's FMA, split-K) while one wrong weight of K would cost ~1/K.
FP32_BOUND = 2.0**-20
# fp16 output: one rounding of the fp32 result (half an ulp, 2^-11 relative) on top of the fp32 bound.
FP16_ROUNDING = 2.0**-11


def random_rows(out_features: int, in_features: int, qtype: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [out_features, row_bytes]: random quants, finite fp16 scales of either sign and varied size."""
    per_block, block_bytes, _ = BLOCK_LAYOUT[qtype]
    blocks = torch.randint(0, 256, (out_features, in_features // per_block, block_bytes), generator=gen)
    blocks = blocks.to(torch.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = torch.randn(blocks.shape[:2], generator=gen) * torch.exp2(torch.randint(-9, -4, blocks.shape[:2]))
        blocks[:, :, offset : offset + 2] = scale.half().view(torch.uint8).view(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)


def case(qtype: int, rows: int, dtype: torch.dtype, seed: int, in_features: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    k = in_features or IN_FEATURES[qtype]
    raw = random_rows(OUT_FEATURES, k, qtype, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    return dev(x), dev(raw)


def assert_close_to_product(out: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, qtype: int) -> None:
    weight = reference.gguf_weight(raw, qtype, x.shape[1])
    exact = x.float() @ weight.T
    bound = FP32_BOUND * (x.float().abs() @ weight.abs().T)
    if out.dtype != torch.float32:
        bound += FP16_ROUNDING * exact.abs()
    err = (out.float() - exact).abs()
    assert out.dtype == x.dtype and out.shape == exact.shape
    assert (err <= bound).all(), f"worst error {(err / bound).max():.2f} x the bound"


@pytest.mark.parametrize("qtype", FORMATS)
def test_embedding_dequantizes_exactly(qtype):
    gen = torch.Generator().manual_seed(qtype)
    k = IN_FEATURES[qtype]
    raw = dev(random_rows(OUT_FEATURES, k, qtype, gen))
    ids = dev(torch.tensor([5, 0, OUT_FEATURES - 1, 5], dtype=torch.int32))
    for dtype in (torch.float32, torch.float16):
        out = gguf_embedding(ids, raw, qtype, k, dtype)
        assert out.dtype == dtype and torch.equal(out, reference.gguf_embedding(ids, raw, qtype, k, dtype))


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_and_gemm_match_the_dequantized_product(qtype, dtype):
    for rows, kernel in ((1, gguf_gemv), (GEMV_MAX_ROWS, gguf_gemv), (GEMV_MAX_ROWS + 3, gguf_gemm)):
        x, raw = case(qtype, rows, dtype, seed=qtype * 10 + rows)
        assert_close_to_product(kernel(x, raw, qtype, OUT_FEATURES), x, raw, qtype)


@pytest.mark.parametrize("qtype", [Q4_0, Q6_K])
def test_gemv_split_over_k(qtype):
    k = 2048  # 16 chunks of the GEMV's K tile: split in several slices
    assert gemv_num_splits(OUT_FEATURES, k, device_sm_count(torch.device("cpu"))) > 1
    x, raw = case(qtype, 3, torch.float32, seed=7, in_features=k)
    assert_close_to_product(gguf_gemv(x, raw, qtype, OUT_FEATURES), x, raw, qtype)


@pytest.mark.parametrize("qtype", [Q5_1, Q4_K])
def test_gemm_over_several_tiles_of_rows(qtype):
    rows = GEMM_BLOCK_M + 6
    x, raw = case(qtype, rows, torch.float32, seed=3)
    out = gguf_gemm(x, raw, qtype, OUT_FEATURES)
    assert_close_to_product(out, x, raw, qtype)
    # a row's result does not depend on the rows that share its call (at the same place in a tile: the
    # interpreter's dot is numpy's, whose order may depend on that place; a GPU's MMA is per row)
    assert torch.equal(gguf_gemm(x[GEMM_BLOCK_M:], raw, qtype, OUT_FEATURES), out[GEMM_BLOCK_M:])
    assert torch.equal(gguf_gemm(x[:5], raw, qtype, OUT_FEATURES), out[:5])


@pytest.mark.parametrize("qtype", [Q8_0, Q5_K])
def test_gemv_rows_do_not_depend_on_the_batch(qtype):
    x, raw = case(qtype, GEMV_MAX_ROWS, torch.float32, seed=11)
    out = gguf_gemv(x, raw, qtype, OUT_FEATURES)
    for row in (0, GEMV_MAX_ROWS - 1):
        assert torch.equal(gguf_gemv(x[row : row + 1], raw, qtype, OUT_FEATURES), out[row : row + 1])


def test_matmul_takes_the_gemv_for_decode_rows_and_the_gemm_beyond():
    x, raw = case(Q4_1, GEMV_MAX_ROWS + 1, torch.float32, seed=5)
    assert torch.equal(
        gguf_matmul(x[:GEMV_MAX_ROWS], raw, Q4_1, OUT_FEATURES), gguf_gemv(x[:-1], raw, Q4_1, OUT_FEATURES)
    )
    assert torch.equal(gguf_matmul(x, raw, Q4_1, OUT_FEATURES), gguf_gemm(x, raw, Q4_1, OUT_FEATURES))


def test_strided_activations():
    # x as a column slice of a wider buffer (e.g. one half of a fused projection's output)
    _, raw = case(Q5_0, 1, torch.float32, seed=9)
    x = dev(torch.randn(10, 192, generator=torch.Generator().manual_seed(9)))[:, 32:128]
    assert x.stride(0) == 192
    for rows in (2, 10):
        assert_close_to_product(gguf_matmul(x[:rows], raw, Q5_0, OUT_FEATURES), x[:rows], raw, Q5_0)


def test_supports():
    assert all(gguf_supports(q, torch.float16, 256) for q in FORMATS)
    assert gguf_supports(Q8_0, torch.float32, 96) and not gguf_supports(Q4_K, torch.float32, 96)
    assert not gguf_supports(10, torch.float16, 256)  # Q2_K
    assert gguf_supports(Q4_0, torch.bfloat16, 256) == (not triton.knobs.runtime.interpret)


def test_bad_inputs_are_refused():
    x, raw = case(Q4_0, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="bytes"):
        gguf_matmul(x[:, :64], raw, Q4_0, OUT_FEATURES)
    with pytest.raises(ValueError, match="no GPU kernel"):
        gguf_matmul(x, raw, 10, OUT_FEATURES)  # Q2_K
    if triton.knobs.runtime.interpret:
        with pytest.raises(ValueError, match="bf16"):
            gguf_matmul(x.bfloat16(), raw, Q4_0, OUT_FEATURES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is computed wrongly by the interpreter")
@pytest.mark.parametrize("qtype", FORMATS)
def test_bf16_on_a_gpu(qtype):
    for rows in (1, GEMV_MAX_ROWS + 3):
        x, raw = case(qtype, rows, torch.bfloat16, seed=qtype)
        out = gguf_matmul(x, raw, qtype, OUT_FEATURES)
        weight = reference.gguf_weight(raw, qtype, x.shape[1])
        exact = x.float() @ weight.T
        bound = FP32_BOUND * (x.float().abs() @ weight.abs().T) + 2.0**-8 * exact.abs()  # bf16's half ulp
        assert ((out.float() - exact).abs() <= bound).all()


def test_a_gguf_model_on_cuda_keeps_the_formats_these_kernels_compute():
    """The loader keeps blocks on a GPU exactly where these kernels run them (bf16 only where compiled)."""
    from inflight.models.quantized import packed_kernel_available

    cuda = torch.device("cuda")
    assert packed_kernel_available("Q4_K", torch.float16, cuda, 256)
    assert packed_kernel_available("Q8_0", torch.float32, cuda, 96)
    assert not packed_kernel_available("Q4_K", torch.float16, cuda, 96)  # a row is not whole super-blocks
    assert not packed_kernel_available("F16", torch.float16, cuda, 256)
