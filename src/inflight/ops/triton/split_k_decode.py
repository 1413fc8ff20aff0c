"""Split-K ("flash decoding"): when to split a context across programs, and the merge of the pieces.

The attention kernel itself is the unified one in `paged_attention.py`: with `num_splits > 1` each
program covers one slice of the KV tiles and writes a normalized partial output plus its log-sum-exp
(base 2). `merge_splits` combines the slices exactly: out = sum_s 2^(lse_s - lse) * out_s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A split must stream enough keys to amortize its fixed cost (loading Q, writing an fp32 partial,
# the merge pass and its launch); the threshold comes from GPU runs (docs/BENCHMARKS.md, split-K).
MIN_TOKENS_PER_SPLIT = 512
# More splits than this add merge traffic without adding useful parallelism on current GPUs.
MAX_SPLITS = 16
# The interpreter has no SMs; plan as for a data-center GPU so CPU runs take the same decisions.
NOMINAL_SM_COUNT = 132


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, max_query_len: int, num_sms: int) -> int:
    """How many slices to split each sequence's context into (1 = single pass).

    The single-pass kernel runs one program per (query tile, KV head). A decode batch of B sequences
    therefore has only B * Hkv programs; with a small batch that leaves most SMs idle while each
    program streams a long context alone. Split only then: decode-only batches (prefill tiles give
    plenty of programs and are compute-bound) whose programs do not fill the SMs, into as many slices
    as it takes to fill them, but never slices shorter than MIN_TOKENS_PER_SPLIT.
    """
    if max_query_len > 1:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = min(triton.cdiv(num_sms, programs), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(splits, 1)


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SM_COUNT


# num_splits varies per step (16 would be specialized as divisible by 16): one binary per SPLITS_PAD.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_ptr,  # [S, T, H, D] float32, each slice normalized by its own sum
    lse_ptr,  # [S, T, H] float32, log2-sum-exp2 of each slice's scaled scores (-inf: slice saw no key)
    out_ptr,  # [T, H, D]
    num_splits,
    stride_p_split,
    stride_p_tok,
    stride_p_head,
    stride_l_split,
    stride_l_tok,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(
        lse_ptr + splits * stride_l_split + tok * stride_l_tok + head,
        mask=splits < num_splits,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # a row no slice saw: weights stay 0
    weight = tl.exp2(lse - lse_max)
    weight = weight / tl.maximum(tl.sum(weight, 0), 1e-30)
    part = tl.load(
        part_ptr + splits[:, None] * stride_p_split + tok * stride_p_tok + head * stride_p_head + dims[None, :],
        mask=(splits[:, None] < num_splits) & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partial_out [S, T, H, D] fp32, partial_lse [S, T, H] fp32 (base 2) -> out [T, H, D], in place."""
    num_splits, num_tokens, num_heads, head_dim = partial_out.shape
    assert partial_out.stride(-1) == 1 and out.stride(-1) == 1 and partial_lse.stride(-1) == 1
    if num_tokens == 0:
        return out
    _merge_kernel[(num_tokens, num_heads)](
        partial_out,
        partial_lse,
        out,
        num_splits,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out
