"""Linear layers and embeddings computed on a GGUF file's quantized blocks (weight-only: activations stay in the
engine's dtype, the kernels dequantize in registers and accumulate in fp32).

On CPU the blocks are repacked once into our GGUF GEMM's panels (`inflight.ops.cpu.gguf_pack`, the same bytes a
block): its results are our fp32/bf16 GEMM's over the dequantized weight, bit for bit. On CUDA the file's rows
stay as they are for the Triton kernels (`inflight.ops.triton.gguf_gemm`). A fused projection whose parts have
different block types (attn_v Q6_K beside attn_q Q4_K in a Q4_K_M file) keeps one segment per run of parts of
one type, each writing its columns of the one output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inflight.models.parallel import SINGLE, TensorParallel, vocab_parallel_lookup
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
        return cpu.gguf_supports(qtype, dtype, in_features)
    if device.type == "cuda":
        from inflight.ops.triton import gguf_gemm

        return gguf_gemm.gguf_supports(qtype, dtype, in_features)
    return False


@dataclass
class _Segment:
    qtype: int
    data: torch.Tensor  # CPU: the packed panels; CUDA: the file's rows
    start: int  # first output column
    size: int  # outputs


def _segments(parts: list[GGUFWeight], device: torch.device) -> list[_Segment]:
    """Runs of parts of one block type, concatenated along the outputs (fewer calls, fewer partial panels)."""
    runs: list[list[GGUFWeight]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    segments, start = [], 0
    for run in runs:
        raw = torch.cat([p.data for p in run]) if len(run) > 1 else run[0].data
        size, in_features = sum(p.shape[0] for p in run), run[0].shape[1]
        qtype = int(run[0].qtype)
        if device.type == "cpu":
            data = cpu.gguf_pack(raw.cpu(), qtype, size, in_features)
        else:
            data = raw.to(device).contiguous()
        segments.append(_Segment(qtype, data, start, size))
        start += size
    return segments


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W the concatenation (along the outputs) of GGUF parts."""

    def __init__(
        self, segments: list[_Segment], in_features: int, dtype: torch.dtype, bias: torch.Tensor | None, owns: bool
    ) -> None:
        super().__init__()
        self.segments = segments
        self.in_features = in_features
        self.out_features = sum(s.size for s in segments)
        self.dtype = dtype
        self.bias = bias
        self.owns_weight = owns  # False: a tied head on its embedding's blocks (counted there)

    @classmethod
    def from_gguf(
        cls, parts: list[GGUFWeight], dtype: torch.dtype, device: torch.device, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        device = torch.device(device)
        in_features = parts[0].shape[1]
        if any(p.shape[1] != in_features for p in parts):
            raise ValueError("fused parts must share in_features")
        if device.type == "cpu":
            for p in parts:
                if not cpu.gguf_supports(p.qtype, dtype, in_features):
                    raise ValueError(f"no CPU GGUF kernel for qtype {p.qtype} in {dtype} (K={in_features})")
        bias = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
        return cls(_segments(parts, device), in_features, dtype, bias, owns=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, self.in_features).contiguous()
        if rows.device.type == "cpu":
            out = self._cpu(rows)
        else:
            out = self._cuda(rows)
        return out if rows is x else out.view(*x.shape[:-1], self.out_features)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.segments) == 1:
            s = self.segments[0]
            return cpu.gguf_linear(x, s.data, s.qtype, s.size, self.bias)
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        for s in self.segments:
            bias = None if self.bias is None else self.bias[s.start : s.start + s.size]
            cpu.gguf_linear(x, s.data, s.qtype, s.size, bias, out=out[:, s.start : s.start + s.size])
        return out

    def _cuda(self, x: torch.Tensor) -> torch.Tensor:
        from inflight.ops.triton.gguf_gemm import gguf_matmul

        parts = [gguf_matmul(x, s.data, s.qtype, s.size) for s in self.segments]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out if self.bias is None else out + self.bias

    def weight_bytes(self) -> int:
        """Bytes this module holds (a tied head: 0, its blocks are the embedding's)."""
        held = sum(s.data.numel() for s in self.segments) if self.owns_weight else 0
        return held + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        types = ",".join(str(s.qtype) for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={types}"


class QuantizedEmbedding(nn.Module):
    """Rows of a GGUF embedding dequantized as they are looked up; its `lm_head()` computes on the same blocks."""

    def __init__(
        self, segment: _Segment, embedding_dim: int, dtype: torch.dtype, tp: TensorParallel = SINGLE, start: int = 0
    ) -> None:
        """`tp`, `start`: a tensor-parallel rank holds the vocabulary rows from `start` (models/parallel.py)."""
        super().__init__()
        self.segment = segment
        self.num_embeddings = segment.size
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.tp, self.vocab_start = tp, start

    @classmethod
    def from_gguf(
        cls, weight: GGUFWeight, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE, start: int = 0
    ) -> QuantizedEmbedding:
        device = torch.device(device)
        if device.type == "cpu" and not cpu.gguf_supports(weight.qtype, dtype, weight.shape[1]):
            raise ValueError(f"no CPU GGUF kernel for qtype {weight.qtype} in {dtype} (K={weight.shape[1]})")
        return cls(_segments([weight], device)[0], weight.shape[1], dtype, tp, start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        end = self.vocab_start + self.num_embeddings
        return vocab_parallel_lookup(self.tp, ids, self.vocab_start, end, self._lookup)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        s, flat = self.segment, ids.reshape(-1)
        if flat.device.type == "cpu":
            rows = cpu.gguf_embedding(flat.long(), s.data, s.qtype, s.size, self.embedding_dim, self.dtype)
        else:
            from inflight.ops.triton.gguf_gemm import gguf_embedding

            rows = gguf_embedding(flat, s.data, s.qtype, self.embedding_dim, self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def lm_head(self) -> QuantizedLinear:
        """The tied output layer: logits from the same blocks (no second copy)."""
        return QuantizedLinear([self.segment], self.embedding_dim, self.dtype, None, owns=False)

    def weight_bytes(self) -> int:
        return self.segment.data.numel()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.segment.qtype}"
