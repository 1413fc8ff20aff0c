"""Rotary position embedding on q and k, in place, HF "rotate half" layout.

For each head, with x = [x1, x2] split in halves and (cos, sin) the row of the token's position:
    [x1 * cos - x2 * sin, x2 * cos + x1 * sin]     (computed in fp32, rounded back to x's dtype)
One program handles one token: its cos/sin row is loaded once for all q and k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_head,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    first = x_ptr + heads * stride_head + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + tok * stride_q_tok, stride_q_head, num_q_heads, cos, sin, HALF, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr + tok * stride_k_tok, stride_k_head, num_k_heads, cos, sin, HALF, K_HEADS_PAD, HALF_PAD)


def rotary_embedding(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, D/2] float32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query and key in place (strided views are fine) and returns them."""
    num_tokens, num_q_heads, head_dim = query.shape
    half = head_dim // 2
    assert key.shape[0] == num_tokens and key.shape[2] == head_dim, "query and key shapes disagree"
    assert cos.shape[-1] == half and sin.shape[-1] == half, "cos/sin must be [max_pos, head_dim / 2]"
    assert query.stride(-1) == 1 and key.stride(-1) == 1, "rows of q and k must be contiguous"
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    if num_tokens == 0:
        return query, key
    _rope_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos,
        sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        key.shape[1],
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
    )
    return query, key
