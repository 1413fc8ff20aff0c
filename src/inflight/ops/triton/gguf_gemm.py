"""GGUF-block weights computed as shipped: x @ W^T and embedding rows with W kept as the file's blocks.

`raw` is the file's tensor as stored, uint8 [N, row_bytes]: row n holds the K weights of output n as
consecutive blocks (32 weights for Q8_0, Q4_0/1, Q5_0/1; 256 for Q4_K, Q5_K, Q6_K). No repack: every
kernel reads the blocks in place and dequantizes in registers. Each format reads as w = scale * q + min
over sub-blocks of GROUP weights (32; 16 for Q6_K), with q a small integer (|q| <= 128, exact in fp16 and
bf16) and scale/min in fp32, computed in `gguf.quants.dequantize`'s order of operations.

- GEMV (decode, M <= GEMV_MAX_ROWS): a program dequantizes a [BLOCK_N, BLOCK_K] tile to fp32 once and
  reuses it for every row of x; programs split N and, when N alone gives too few, K. The split partials
  (fp32) are added in a fixed order, so a row's result never depends on M.
- GEMM (prefill): tiles of [BLOCK_M, BLOCK_N]; the K loop goes one sub-block at a time:
  acc += tl.dot(x, q) * scale + rowsum(x) * min, x in its own dtype, accumulation in fp32 (IEEE for fp32
  inputs). Tile sizes do not depend on M, so a row's result does not depend on the rows beside it.

The torch oracle is `inflight.ops.reference.gguf_matmul` (dequantize to fp32, matmul in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.ops.triton.split_k_decode import device_sm_count

# gguf.GGMLQuantizationType values of the formats these kernels read.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
# qtype -> (weights per block, bytes per block, weights per scale group)
BLOCK_LAYOUT = {
    Q4_0: (32, 18, 32),
    Q4_1: (32, 20, 32),
    Q5_0: (32, 22, 32),
    Q5_1: (32, 24, 32),
    Q8_0: (32, 34, 32),
    Q4_K: (256, 144, 32),
    Q5_K: (256, 176, 32),
    Q6_K: (256, 210, 16),
}
SUPPORTED_QTYPES = tuple(BLOCK_LAYOUT)
# Up to this many rows of x a call takes the GEMV (one dequantized tile serves every row).
GEMV_MAX_ROWS = 8
GEMV_BLOCK_N, GEMV_BLOCK_K = 16, 128
# A GEMV split covers at least this many BLOCK_K chunks of the row, and the splits are at most this many.
GEMV_MIN_CHUNKS_PER_SPLIT, GEMV_MAX_SPLITS = 4, 16
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_NUM_WARPS = 64, 64, 8
EMBEDDING_BLOCK_K = 256


@triton.jit
def _u8(ptr, offset, mask):
    return tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, offset, mask):
    """A little-endian fp16 at a byte offset (blocks are 2-byte aligned only), as fp32."""
    lo = tl.load(ptr + offset, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offset + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quants(raw_ptr, row_off, k, mask, QTYPE: tl.constexpr):
    """The integer q of weight k (a column index within the row) of the rows at byte offsets row_off."""
    if QTYPE == 8:  # Q8_0: d, 32 x int8
        q = tl.load(raw_ptr + row_off + (k // 32) * 34 + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        q = q.to(tl.int32)
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0 (d, 16 B of nibbles) / Q4_1 (d, m, 16 B): low nibbles first
        j = k % 32
        if QTYPE == 2:
            byte = _u8(raw_ptr, row_off + (k // 32) * 18 + 2 + j % 16, mask)
            q = ((byte >> (4 * (j // 16))) & 15) - 8
        else:
            byte = _u8(raw_ptr, row_off + (k // 32) * 20 + 4 + j % 16, mask)
            q = (byte >> (4 * (j // 16))) & 15
    elif QTYPE == 6 or QTYPE == 7:  # Q5_0 (d, qh u32, 16 B) / Q5_1 (d, m, qh, 16 B): bit j of qh is q's bit 4
        j = k % 32
        if QTYPE == 6:
            base = row_off + (k // 32) * 22 + 2
        else:
            base = row_off + (k // 32) * 24 + 4
        low = (_u8(raw_ptr, base + 4 + j % 16, mask) >> (4 * (j // 16))) & 15
        high = (_u8(raw_ptr, base + j // 8, mask) >> (j % 8)) & 1
        q = low | (high << 4)
        if QTYPE == 6:
            q = q - 16
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: 32-byte chunks give 32 low then 32 high nibbles
        j = k % 256
        sub = j // 32
        if QTYPE == 12:
            base = row_off + (k // 256) * 144
            q = (_u8(raw_ptr, base + 16 + (sub // 2) * 32 + j % 32, mask) >> (4 * (sub % 2))) & 15
        else:
            base = row_off + (k // 256) * 176
            low = (_u8(raw_ptr, base + 48 + (sub // 2) * 32 + j % 32, mask) >> (4 * (sub % 2))) & 15
            high = (_u8(raw_ptr, base + 16 + j % 32, mask) >> sub) & 1  # qh: bit `sub` of byte j % 32
            q = low | (high << 4)
    else:  # Q6_K: ql 128 B, qh 64 B, 16 int8 scales, d; each half of the block is 128 weights
        tl.static_assert(QTYPE == 14, "unsupported GGUF block format")
        j = k % 256
        half = j // 128
        h = j % 128
        base = row_off + (k // 256) * 210
        low = (_u8(raw_ptr, base + half * 64 + h % 64, mask) >> (4 * (h // 64))) & 15
        high = (_u8(raw_ptr, base + 128 + half * 32 + h % 32, mask) >> (2 * (h // 32))) & 3
        q = (low | (high << 4)) - 32
    return q


@triton.jit
def _scale_min(raw_ptr, row_off, group, mask, QTYPE: tl.constexpr):
    """(scale, min) in fp32 of scale group `group` (k // GROUP) of each row: w = scale * q + min."""
    zero = tl.zeros(group.shape, tl.float32)
    if QTYPE == 8:
        scale, min_ = _f16(raw_ptr, row_off + group * 34, mask), zero
    elif QTYPE == 2:
        scale, min_ = _f16(raw_ptr, row_off + group * 18, mask), zero
    elif QTYPE == 3:
        scale, min_ = _f16(raw_ptr, row_off + group * 20, mask), _f16(raw_ptr, row_off + group * 20 + 2, mask)
    elif QTYPE == 6:
        scale, min_ = _f16(raw_ptr, row_off + group * 22, mask), zero
    elif QTYPE == 7:
        scale, min_ = _f16(raw_ptr, row_off + group * 24, mask), _f16(raw_ptr, row_off + group * 24 + 2, mask)
    elif QTYPE == 12 or QTYPE == 13:
        # 8 six-bit (scale, min) pairs in 12 bytes: bytes 0-3 scales 0-3 (+ top bits of 4-7), 4-7 mins
        # 0-3 (+ top bits of 4-7), 8-11 the low nibbles of scales / mins 4-7.
        if QTYPE == 12:
            base = row_off + (group // 8) * 144
        else:
            base = row_off + (group // 8) * 176
        s = group % 8
        d = _f16(raw_ptr, base, mask)
        dmin = _f16(raw_ptr, base + 2, mask)
        sc_lo = _u8(raw_ptr, base + 4 + s % 4, mask)
        m_lo = _u8(raw_ptr, base + 8 + s % 4, mask)
        both = _u8(raw_ptr, base + 12 + s % 4, mask)
        sc = tl.where(s < 4, sc_lo & 63, (both & 15) | ((sc_lo >> 2) & 48))
        m = tl.where(s < 4, m_lo & 63, (both >> 4) | ((m_lo >> 2) & 48))
        scale, min_ = d * sc.to(tl.float32), -(dmin * m.to(tl.float32))
    else:
        base = row_off + (group // 16) * 210
        sc = tl.load(raw_ptr + base + 192 + group % 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        scale, min_ = _f16(raw_ptr, base + 208, mask) * sc.to(tl.float32), zero
    return scale, min_


@triton.jit
def _dequantize(raw_ptr, row_off, k, mask, QTYPE: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr):
    """Weights (fp32) at (row_off, k), exactly as `gguf.quants.dequantize` computes them; 0 where masked."""
    q = _quants(raw_ptr, row_off, k, mask, QTYPE)
    scale, min_ = _scale_min(raw_ptr, row_off, k // GROUP, mask, QTYPE)
    w = scale * q.to(tl.float32)
    if HAS_MIN:
        w = w + min_
    return tl.where(mask, w, 0.0)


# Shapes vary per layer and step: no specialization on them (K is always a multiple of 32).
@triton.jit(do_not_specialize=["num_rows", "N", "k_per_split", "stride_raw"])
def _gguf_gemv_kernel(
    x_ptr,  # [M, K]
    raw_ptr,  # uint8 [N, row_bytes]
    part_ptr,  # fp32 [num_splits, M, N]
    num_rows,  # M <= BLOCK_M
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_raw,
    QTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    row_off = n.to(tl.int64) * stride_raw
    rows = tl.arange(0, BLOCK_M)
    # The K tile as [groups, GROUP]: scale and min are loaded once per (row, group), not per weight.
    NUM_GROUPS: tl.constexpr = BLOCK_K // GROUP
    groups = tl.arange(0, NUM_GROUPS)
    k_tile = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    row3 = row_off[:, None, None]
    n_ok3 = n_ok[:, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + k_tile  # [NUM_GROUPS, GROUP]
        k_ok = k < k_end  # K is a multiple of GROUP: a group is in or out as a whole
        group = k0 // GROUP + groups
        q = _quants(raw_ptr, row3, k[None, :, :], n_ok3 & k_ok[None, :, :], QTYPE)
        scale, min_ = _scale_min(
            raw_ptr, row3, group[None, :, None], n_ok3 & (group * GROUP < k_end)[None, :, None], QTYPE
        )
        w = scale * q.to(tl.float32)
        if HAS_MIN:
            w = w + min_
        w = tl.where(n_ok3 & k_ok[None, :, :], w, 0.0)
        for m in range(num_rows):  # the tile is dequantized once for every row of x
            xm = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            dot = tl.sum(tl.sum(w * xm[None, :, :], 2), 1)
            acc = tl.where(rows[:, None] == m, acc + dot[None, :], acc)
    out = part_ptr + (split * num_rows + rows[:, None]).to(tl.int64) * N + n[None, :]
    tl.store(out, acc, mask=(rows[:, None] < num_rows) & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "N", "stride_raw", "stride_om"])
def _gguf_gemm_kernel(
    x_ptr,  # [M, K]
    raw_ptr,  # uint8 [N, row_bytes]
    out_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_raw,
    stride_om,
    QTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    row_off = n.to(tl.int64) * stride_raw
    g = tl.arange(0, GROUP)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, GROUP):  # one scale group per step: scale and min are per column of the tile
        x = tl.load(x_rows + (k0 + g)[None, :], mask=m_ok[:, None], other=0.0)
        q = _quants(raw_ptr, row_off[None, :], (k0 + g)[:, None], n_ok[None, :], QTYPE)
        group = tl.zeros_like(row_off) + k0 // GROUP
        scale, min_ = _scale_min(raw_ptr, row_off, group, n_ok, QTYPE)
        if IEEE:
            dot = tl.dot(x, q.to(x.dtype), input_precision="ieee")
        else:
            dot = tl.dot(x, q.to(x.dtype))
        acc += dot * scale[None, :]
        if HAS_MIN:
            acc += tl.sum(x.to(tl.float32), 1)[:, None] * min_[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["stride_raw"])
def _gguf_embedding_kernel(
    ids_ptr,  # [T] int
    raw_ptr,  # uint8 [V, row_bytes]
    out_ptr,  # [T, K]
    K,
    stride_raw,
    stride_out,
    QTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    row = tl.load(ids_ptr + tok).to(tl.int64)
    w = _dequantize(raw_ptr, row * stride_raw, k, k_ok, QTYPE, GROUP, HAS_MIN)
    tl.store(out_ptr + tok * stride_out + k, w.to(out_ptr.dtype.element_ty), mask=k_ok)


def _check(raw: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype) -> tuple[int, bool]:
    """(GROUP, HAS_MIN) of the format, after checking the row layout and the dtype."""
    if qtype not in BLOCK_LAYOUT:
        raise ValueError(f"GGUF block format {qtype} has no GPU kernel (supported: {SUPPORTED_QTYPES})")
    per_block, block_bytes, group = BLOCK_LAYOUT[qtype]
    if in_features % per_block or raw.shape[-1] != in_features // per_block * block_bytes:
        raise ValueError(f"rows of {raw.shape[-1]} bytes are not {in_features} weights of format {qtype}")
    if raw.dtype != torch.uint8 or raw.stride(-1) != 1:
        raise ValueError("raw must be uint8 with contiguous rows")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"activations must be fp32, fp16 or bf16, not {dtype}")
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        raise ValueError("the Triton interpreter computes bf16 wrongly: run bf16 on a GPU")
    return group, qtype in (Q4_1, Q5_1, Q4_K, Q5_K)


def gguf_supports(qtype: int, dtype: torch.dtype, in_features: int) -> bool:
    """Whether these kernels compute `qtype` rows of `in_features` weights with `dtype` activations here."""
    if qtype not in BLOCK_LAYOUT or in_features % BLOCK_LAYOUT[qtype][0]:
        return False
    if dtype == torch.bfloat16:
        return not triton.knobs.runtime.interpret
    return dtype in (torch.float32, torch.float16)


def gemv_num_splits(n: int, k: int, num_sms: int) -> int:
    """K splits of the GEMV: enough programs to fill the SMs twice, never a split under a few chunks.
    Depends on the weight's shape and the device only, so a row's sum order does not depend on M."""
    tiles = triton.cdiv(n, GEMV_BLOCK_N)
    chunks = triton.cdiv(k, GEMV_BLOCK_K)
    wanted = triton.cdiv(2 * num_sms, tiles)
    return max(1, min(wanted, chunks // GEMV_MIN_CHUNKS_PER_SPLIT, GEMV_MAX_SPLITS))


def gguf_gemv(x: torch.Tensor, raw: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
    """x [M <= GEMV_MAX_ROWS, K] @ W^T -> [M, out_features] in x's dtype (the decode shape)."""
    group, has_min = _check(raw, qtype, x.shape[1], x.dtype)
    num_rows, k = x.shape
    assert num_rows <= GEMV_MAX_ROWS and raw.shape[0] == out_features
    x = x if x.stride(-1) == 1 else x.contiguous()
    splits = gemv_num_splits(out_features, k, device_sm_count(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, GEMV_BLOCK_K), splits) * GEMV_BLOCK_K
    splits = triton.cdiv(k, k_per_split)  # no empty split
    part = torch.empty(splits, num_rows, out_features, dtype=torch.float32, device=x.device)
    if num_rows and out_features:
        _gguf_gemv_kernel[(triton.cdiv(out_features, GEMV_BLOCK_N), splits)](
            x,
            raw,
            part,
            num_rows,
            out_features,
            k,
            k_per_split,
            x.stride(0),
            raw.stride(0),
            QTYPE=qtype,
            GROUP=group,
            HAS_MIN=has_min,
            BLOCK_M=GEMV_MAX_ROWS,
            BLOCK_N=GEMV_BLOCK_N,
            BLOCK_K=GEMV_BLOCK_K,
            num_warps=4,
        )
    return (part[0] if splits == 1 else part.sum(0)).to(x.dtype)


def gguf_gemm(x: torch.Tensor, raw: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, out_features] in x's dtype (the prefill shape; any M)."""
    group, has_min = _check(raw, qtype, x.shape[1], x.dtype)
    num_rows, k = x.shape
    assert raw.shape[0] == out_features
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows and out_features:
        grid = (triton.cdiv(num_rows, GEMM_BLOCK_M), triton.cdiv(out_features, GEMM_BLOCK_N))
        _gguf_gemm_kernel[grid](
            x,
            raw,
            out,
            num_rows,
            out_features,
            k,
            x.stride(0),
            raw.stride(0),
            out.stride(0),
            QTYPE=qtype,
            GROUP=group,
            HAS_MIN=has_min,
            BLOCK_M=GEMM_BLOCK_M,
            BLOCK_N=GEMM_BLOCK_N,
            IEEE=x.dtype == torch.float32,
            num_warps=GEMM_NUM_WARPS,
            num_stages=1 if x.dtype == torch.float32 else 2,  # fp32's FMA dot leaves no registers to prefetch
        )
    return out


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ W^T -> [M, out_features] in x's dtype, W = the GGUF rows `raw`
    (uint8 [out_features, row_bytes], as stored in the file) of format `qtype` (gguf.GGMLQuantizationType)."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gguf_gemv(x, raw, qtype, out_features)
    return gguf_gemm(x, raw, qtype, out_features)


def gguf_embedding(
    ids: torch.Tensor, raw: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """The rows `ids` [T] of the GGUF table `raw` [V, row_bytes], dequantized -> [T, embedding_dim] in dtype."""
    group, has_min = _check(raw, qtype, embedding_dim, dtype)
    ids = ids.reshape(-1)
    out = torch.empty(ids.shape[0], embedding_dim, dtype=dtype, device=raw.device)
    if ids.shape[0]:
        _gguf_embedding_kernel[(ids.shape[0], triton.cdiv(embedding_dim, EMBEDDING_BLOCK_K))](
            ids,
            raw,
            out,
            embedding_dim,
            raw.stride(0),
            out.stride(0),
            QTYPE=qtype,
            GROUP=group,
            HAS_MIN=has_min,
            BLOCK_K=EMBEDDING_BLOCK_K,
        )
    return out
