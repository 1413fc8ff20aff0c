"""Fused Mixture-of-Experts (vLLM's `fused_moe_kernel`): every token through its k experts' SwiGLU MLPs.

A step's (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`moe_align_block_size`, device ops of fixed shape: no host sync, so it can sit in a CUDA graph). One
kernel then serves both GEMMs: an M-block belongs to one expert, gathers its rows of A by sorted id, and
multiplies them by that expert's weight tile; programs walk the (M-block, N-tile) grid in groups of
GROUP_M M-blocks so that neighbours share weight tiles in L2.

Numerics follow `inflight.ops.reference.fused_moe`: gate/up, the activation and the down projection each
round to x's dtype (sums in fp32); the routing weight multiplies the rounded down projection in fp32; the
k weighted rows are added in fp32 in top-k order and rounded once. Block sizes depend on the experts'
shape, the dtype and the device only, never on the step (`get_config`), so a row's sums run in the same
order whatever else is in the batch: fp32 dots are IEEE (a chain of FMAs over K on a GPU) and 16-bit dots
take the same MMA instruction for every step, which makes a token's result the same bits alone or in any
batch on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile sizes and launch options of `_fused_moe_kernel`, the same for both GEMMs of a layer."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# 16-bit activations: vLLM's default for batches larger than the expert count.
DEFAULT_CONFIG = MoEKernelConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
# fp32 takes the FMA dot, which holds its operands in registers: small K steps, no prefetch.
FP32_CONFIG = MoEKernelConfig(block_m=64, block_n=64, block_k=16, group_m=8, num_warps=8, num_stages=1)
# (experts, intermediate size, device name) -> config for 16-bit activations. Entries are vLLM's tuned
# configs for these shapes at a mid-size batch, one per shape (see the module docstring for why);
# `python -m benchmarks.kernels.fused_moe --sweep` times candidates on the device at hand.
CONFIGS: dict[tuple[int, int, str], MoEKernelConfig] = {
    (128, 768, "NVIDIA H100 80GB HBM3"): MoEKernelConfig(64, 128, 64, 1, 4, 3),  # Qwen3-30B-A3B
    (128, 768, "NVIDIA H200"): MoEKernelConfig(64, 128, 64, 1, 4, 3),
    (8, 14336, "NVIDIA H100 80GB HBM3"): MoEKernelConfig(64, 128, 64, 1, 8, 5),  # Mixtral-8x7B
}


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def get_config(num_experts: int, intermediate_size: int, dtype: torch.dtype, device: torch.device) -> MoEKernelConfig:
    """The block sizes for experts of this shape on this device: the table's entry, else the default."""
    if dtype == torch.float32:
        return FP32_CONFIG
    return CONFIGS.get((num_experts, intermediate_size, _device_name(device)), DEFAULT_CONFIG)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of `topk_ids` (int [T, k]) grouped by expert, each expert's run padded to a
    multiple of block_m. Returns:

    - sorted_token_ids int32 [T*k + E*(block_m-1)]: flat ids t*k + j, expert by expert, in token order within
      an expert; padding holds T*k (past every valid id);
    - expert_ids int32 [cdiv(that, block_m)]: the expert of each M-block, -1 past the last used block;
    - num_tokens_post_padded int32 [1]: the padded length, a multiple of block_m.

    Shapes follow from T, k, E and block_m alone; nothing is read back on the host."""
    flat = topk_ids.reshape(-1).long()
    numel, device = flat.numel(), topk_ids.device
    max_padded = numel + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    first = counts.cumsum(0) - counts  # where each expert's pairs start in the unpadded sort
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(numel, device=device) - first[expert_of]
    sorted_token_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, padded_start[expert_of] + rank, order.to(torch.int32))
    block_start = torch.arange(triton.cdiv(max_padded, block_m), device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # the expert whose run holds it
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, padded_end[-1:].to(torch.int32)


# The step's pair count, its M-block count and top-k change from call to call: no specialization on them.
@triton.jit(do_not_specialize=["num_valid_tokens", "num_m_blocks", "top_k"])
def _fused_moe_kernel(
    a_ptr,  # [*, K]: row r of the GEMM is row (sorted id // top_k) of A
    b_ptr,  # [E, N, K]
    c_ptr,  # [num_valid_tokens, N]: row r is the sorted id
    topk_weights_ptr,  # fp32 [num_valid_tokens]
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_valid_tokens,
    num_m_blocks,
    top_k,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_in_group = GROUP_M * ((N + BLOCK_N - 1) // BLOCK_N)
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_m_blocks - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    ids = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = ids < num_valid_tokens
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N wrap around to real ones, so weight loads need no N mask; their results are not stored.
    n_load = (n % N).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (ids // top_k)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + n_load[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        # The expert's output rounds to the activation dtype before the weight, as the reference's does.
        weight = tl.load(topk_weights_ptr + ids, mask=valid, other=0.0)
        acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    dst = c_ptr + ids[:, None] * stride_cm + n[None, :].to(tl.int64) * stride_cn
    tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


def invoke_fused_moe_kernel(
    a: torch.Tensor,  # [*, K]
    b: torch.Tensor,  # [E, N, K]
    c: torch.Tensor,  # [T*k, N]
    topk_weights: torch.Tensor | None,  # fp32 [T*k]: multiplies each row when given
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    config: MoEKernelConfig,
) -> None:
    """c[id] = A[id // top_k] @ B[expert(id)]^T for every valid sorted id (times its routing weight)."""
    num_valid = c.shape[0]
    n, k = b.shape[1], b.shape[2]
    # Blocks holding pairs come first and number at most the pairs: the rest of the grid would only exit.
    num_m_blocks = min(expert_ids.shape[0], num_valid)
    grid = (num_m_blocks * triton.cdiv(n, config.block_n),)
    _fused_moe_kernel[grid](
        a,
        b,
        c,
        topk_weights if topk_weights is not None else c,  # unread without MUL_ROUTED_WEIGHT
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        n,
        k,
        num_valid,
        num_m_blocks,
        top_k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> None:
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or hidden != x.shape[1] or two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} must be [T, k] for x {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x and the experts must share one of fp32/fp16/bf16, not {x.dtype}/{w13.dtype}/{w2.dtype}")
    if x.dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        raise ValueError("the Triton interpreter computes bf16 wrongly: run bf16 on a GPU")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # fp32 [T, k]
    topk_ids: torch.Tensor,  # int32 [T, k]
    config: MoEKernelConfig | None = None,  # default: get_config for these experts on x's device
) -> torch.Tensor:  # [T, H], x's dtype
    """`reference.fused_moe` as GEMM1 (w13) -> SiLU-and-mul -> GEMM2 (w2, routing weight in the kernel) into
    fp32 [T, k, H] -> the k rows summed in top-k order and rounded once to x's dtype."""
    _check(x, w13, w2, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    config = config or get_config(num_experts, two_i // 2, x.dtype, x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    aligned = moe_align_block_size(topk_ids, config.block_m, num_experts)
    gate_up = torch.empty(num_tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    invoke_fused_moe_kernel(x, w13, gate_up, None, *aligned, top_k, config)
    gate, up = gate_up.split(two_i // 2, dim=-1)
    act = F.silu(gate) * up  # torch: rounds as the reference does, and is memory-bound anyway
    weighted = torch.empty(num_tokens, top_k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.to(torch.float32).reshape(-1)
    invoke_fused_moe_kernel(act, w2, weighted.view(-1, hidden), weights, *aligned, 1, config)
    out = weighted[:, 0].clone()
    for j in range(1, top_k):
        out += weighted[:, j]
    return out.to(x.dtype)
