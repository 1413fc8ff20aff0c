"""CPU `Linear` layers (fp32 and bf16) with the weight packed once at load.

Where this CPU has AVX-512 or AVX2 with FMA for fp32 (AVX512-BF16 for bf16), the weight goes into our own GEMM's
panels (`inflight.ops.cpu`): faster than oneDNN on decode's skinny shapes and batch-invariant by construction.
Elsewhere the weight is pre-blocked for oneDNN (what inductor's freezing does), as follows.

bf16: `F.linear` re-lays-out the weight for oneDNN on every call; packing once at load removes that and is
bit-identical to `F.linear` (checked at pack time).
fp32: `F.linear` goes to MKL sgemm, which runs skinny shapes well below oneDNN's packed rate. The results
differ from MKL's in rounding only (checked at pack time).

Batch invariance: oneDNN runs a single row through another kernel than two or more rows; for some shapes
(with AVX512-BF16: K > 1024, in bf16 and in fp32) it sums K in another order, so a few outputs round one
ulp apart. A sequence decoding alone would then get other logits than in a batch, and greedy outputs would
depend on the batch. Each layer is therefore probed once at pack time: if a lone row differs from the same
row among others, a lone row is duplicated into a 2-row call on that layer (padding every layer cost more).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from inflight.ops import cpu

logger = logging.getLogger(__name__)


_LONE_ROW_DIFFERS: dict[tuple[int, int, torch.dtype, bool], bool] = {}


def rows_bucket(rows: int) -> int:
    """The row count oneDNN is called with: `rows` rounded up to one of a few dozen sizes. oneDNN builds and
    caches a kernel per input shape, each holding memory, so every distinct step size would grow the process
    (by hundreds of MB over a server's mix of prefill chunks); the padded rows cost little next to that."""
    if rows <= 16:
        return rows
    step = 16 if rows <= 128 else 64 if rows <= 1024 else 256
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every row count `rows_bucket` gives for 1..max_rows."""
    return sorted({rows_bucket(r) for r in range(1, max_rows + 1)})


def warm_up_onednn(model: nn.Module, max_rows: int, head_rows: int, thread_counts: list[int]) -> int:
    """Run each oneDNN-packed shape of `model` at every row bucket it can meet, under each thread count a step
    may use, so that oneDNN builds (and holds memory for) its kernels now rather than over the first minutes
    of serving. The output layer sees at most `head_rows` rows. Returns the number of calls."""
    head = getattr(model, "lm_head", None)
    shapes: dict[tuple, tuple[PackedLinear, int]] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear) and not module.own_gemm:
            key = (module.in_features, module.out_features, module.dtype, module.bias is not None)
            limit = min(head_rows, max_rows) if module is head else max_rows
            if limit > shapes.get(key, (None, 0))[1]:
                shapes[key] = (module, limit)
    calls = 0
    previous = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for module, limit in shapes.values():
                    for rows in row_buckets(limit):
                        module(torch.zeros(rows, module.in_features, dtype=module.dtype))
                        calls += 1
    finally:
        torch.set_num_threads(previous)
    return calls


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # Kept as plain attributes, not parameters: state_dict cannot hold a packed layout.
        self.own_gemm = cpu.gemm_supports(self.dtype, self.in_features)
        if self.own_gemm:
            self.packed = cpu.pack(linear.weight.detach())
            self.pad_single_row = False
            return
        # An opaque oneDNN tensor: kept as a plain attribute, not a parameter (state_dict cannot hold it).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        # See the module docstring (batch invariance). oneDNN picks its kernels by shape and dtype, not by
        # the weights' values: one probe per shape serves every layer of that shape.
        shape = (self.in_features, self.out_features, self.dtype, self.bias is not None)
        if shape not in _LONE_ROW_DIFFERS:
            _LONE_ROW_DIFFERS[shape] = self._lone_row_differs()
        self.pad_single_row = _LONE_ROW_DIFFERS[shape]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_gemm:
            if x.dim() == 2 and x.stride(-1) == 1:  # the model's case: no reshape (a dispatch saved per call)
                return cpu.linear(x, self.packed, self.out_features, self.bias)
            rows = x.reshape(-1, self.in_features).contiguous()
            out = cpu.linear(rows, self.packed, self.out_features, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.pad_single_row and x.dim() == 2 and x.shape[0] == 1:
            return self._linear(x.expand(2, -1).contiguous())[:1]
        rows = x.reshape(-1, self.in_features)
        bucket = rows_bucket(rows.shape[0])
        if bucket != rows.shape[0]:
            padded = rows.new_zeros(bucket, self.in_features)
            padded[: rows.shape[0]] = rows
            return self._linear(padded)[: rows.shape[0]].view(*x.shape[:-1], self.out_features)
        return self._linear(x.contiguous())

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _lone_row_differs(self) -> bool:
        # Random rows: another summation order over K rounds some outputs differently. In bf16 the output's
        # own rounding hides most of it (~1e-4 of outputs differ), so the probe looks at >= 64k outputs.
        rows = min(256, max(4, -(-65536 // self.out_features)))
        x = torch.randn(rows, self.in_features, generator=torch.Generator().manual_seed(0)).to(self.dtype)
        with torch.inference_mode():
            together = self._linear(x)
            return any(not torch.equal(self._linear(x[i : i + 1])[0], together[i]) for i in range(rows))


class RowPaddedLinear(nn.Linear):
    """An unpacked bf16 `nn.Linear` that shares its parameters (a tied lm_head: packing would copy the
    embedding), with `PackedLinear`'s single-row padding for the same batch invariance."""

    @classmethod
    def wrap(cls, linear: nn.Linear) -> RowPaddedLinear:
        with torch.device("meta"):
            padded = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        padded.weight, padded.bias = linear.weight, linear.bias
        return padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            return super().forward(x.expand(2, -1))[:1]
        return super().forward(x)


def pack_linears(model: nn.Module, skip: set[nn.Module] | frozenset = frozenset()) -> int:
    """Swap every CPU fp32/bf16 `nn.Linear` of `model` (but those in `skip`) for a `PackedLinear`; returns
    how many (0 if unsupported). Those in `skip` keep their weight tensor; in bf16 they become a
    `RowPaddedLinear` around it."""
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.dtype in (torch.float32, torch.bfloat16)
        and child.weight.device.type == "cpu"
    ]
    packable = [
        entry
        for entry in linears
        if entry[2] not in skip and cpu.gemm_supports(entry[2].weight.dtype, entry[2].in_features)
    ]
    others = [entry for entry in linears if entry[2] not in skip and entry not in packable]
    if others and not _supported(others[0][2]):  # oneDNN for what our GEMM cannot run, where it can
        others = []
    for parent, name, child in packable + others:
        setattr(parent, name, PackedLinear(child))
    bf16 = [child.in_features for _, _, child in packable if child.weight.dtype == torch.bfloat16]
    if bf16:  # an operator should see whether the tiles are in use (a kernel or seccomp filter may refuse them)
        tiles = sum(cpu.amx_for(k) for k in bf16)
        logger.info("bf16 GEMMs: %d of %d layers on AMX tiles, the rest on AVX512-BF16", tiles, len(bf16))
    if packable or others:
        for parent, name, child in linears:
            if child in skip and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, RowPaddedLinear.wrap(child))
    return len(packable) + len(others)


def _supported(sample: nn.Linear) -> bool:
    try:
        dtype = sample.weight.dtype
        if not torch.backends.mkldnn.is_available() or (
            dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            return False
        x = torch.randn(3, sample.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.inference_mode():
            mine, ref = PackedLinear(sample)(x), sample(x)
        if dtype == torch.bfloat16:  # both are oneDNN: the same kernel, the same bits
            return torch.equal(mine, ref)
        return torch.allclose(mine, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    except (RuntimeError, AttributeError) as exc:  # a torch build without oneDNN / the private op
        logger.info("bf16 weight packing unavailable (%s); using nn.Linear", exc)
        return False
