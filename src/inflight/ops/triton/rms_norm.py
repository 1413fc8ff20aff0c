"""RMSNorm over the last dim, optionally fused with the residual add that precedes it.

Numerics follow `inflight.ops.reference.rms_norm` exactly: the sum x + residual is rounded to the
activation dtype (it becomes the next residual), normalized in fp32, rounded back to the activation
dtype and only then multiplied by the weight. One program normalizes one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    num_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / num_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # a view when it can be, e.g. [T, H, D] -> [T*H, D]
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    num_cols = x.shape[-1]
    assert weight.shape == (num_cols,), "weight must match the normalized (last) dim"
    x2 = _rows(x)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, num_cols)
    if residual is None:
        r2, res_out, res_out2 = x2, None, out2  # residual pointers unused without HAS_RESIDUAL
    else:
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        res_out2 = res_out.view(-1, num_cols)
    block = triton.next_power_of_2(num_cols)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            res_out2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            res_out2.stride(0),
            num_cols,
            eps,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=8 if block >= 2048 else 4,
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normalize(x) over the last dim; any leading shape (e.g. Qwen3's per-head q/k norm)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are left untouched."""
    return _launch(x, residual, weight, eps)
