"""Linear layers and embeddings computed on a GGUF file's quantized blocks (weight-only: activations stay in the
engine's dtype, the kernels dequantize in registers and accumulate in fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inflight.ops import cpu


@dataclass
class GGUFWeight:
    """One tensor as the file stores it: `data` uint8 [rows, bytes per row] of `qtype` blocks (rows in HF order)."""

    qtype: int  # gguf.GGMLQuantizationType
    data: torch.Tensor
    shape: tuple[int, int]  # (out_features, in_features)


def packed_kernel_available(type_name: str, dtype: torch.dtype, device: torch.device, in_features: int) -> bool:
    """Whether a kernel computes `type_name` blocks (e.g. "Q4_K") with `dtype` activations on `device`."""
    import gguf

    qtype = int(gguf.GGMLQuantizationType[type_name])
    if device.type == "cpu":
        supports = getattr(cpu, "gguf_supports", None)
        return supports is not None and supports(qtype, dtype, in_features)
    return False


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W the concatenation (along the outputs) of GGUF parts."""

    @classmethod
    def from_gguf(
        cls, parts: list[GGUFWeight], dtype: torch.dtype, device: torch.device, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        raise NotImplementedError("packed GGUF kernels are not built into this tree")


class QuantizedEmbedding(nn.Module):
    """Rows of a GGUF embedding dequantized as they are looked up; its `lm_head()` computes on the same blocks."""

    @classmethod
    def from_gguf(cls, weight: GGUFWeight, dtype: torch.dtype, device: torch.device) -> QuantizedEmbedding:
        raise NotImplementedError("packed GGUF kernels are not built into this tree")
