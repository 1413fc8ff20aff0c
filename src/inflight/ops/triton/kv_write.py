"""KV write: scatter one step's new keys and values into the paged cache by slot.

Cache layout is `[num_blocks, block_size, num_kv_heads, head_dim]`; `slot = block * block_size + offset`.
A negative slot means "do not write" (padding or a token whose KV is already cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # A skipped token gets zero valid heads. (Not `scalar_bool & tensor`: the interpreter turns that
    # into an int mask and fails.)
    valid_heads = tl.where(slot >= 0, num_heads, 0)
    slot = tl.maximum(slot, 0)  # keep the (masked) addresses of skipped tokens inside the cache
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < valid_heads) & (dims[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    vc = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(kc + heads[:, None] * stride_kc_head + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + heads[:, None] * stride_vc_head + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64; negative = skip
) -> None:
    """Writes key/value rows into the caches in place (converted to the cache dtype)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    assert k_cache.shape[2:] == (num_heads, head_dim), "cache heads/head_dim do not match key"
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
