"""Mixture-of-Experts decoders: Qwen2-MoE (with its gated shared expert), Qwen3-MoE, Mixtral and OLMoE.

Attention is the Llama family's; the MLP is a router over E SwiGLU experts whose weights are stacked into
one tensor each (`FusedExperts`), run by the backend's `fused_moe` op: a grouped GEMM on CPU, vLLM's
fused-MoE kernel shape on GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FusedExperts(nn.Module):
    """E experts' SwiGLU MLPs stacked: `w13` [E, 2I, H] (each expert's gate rows, then its up rows) and `w2`
    [E, H, I] (its down projection). `cpu_packed` is a backend's own layout of both, made once (ops/cpu.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.cpu_packed: Any = None
