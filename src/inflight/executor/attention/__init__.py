"""The one backend seam: KV write, paged attention, RMSNorm and RoPE.

`TorchBackend` is the CPU path and the reference; `TritonBackend` runs the Triton-language kernels of
`inflight.ops.triton` (the default on CUDA). Both take the same flattened, unpadded batch described by
`AttentionMetadata`. Modules are named `*_backend` so that none shadows the `torch` or `triton` package.
"""

from __future__ import annotations

from typing import Any

import torch

from inflight.executor.attention.metadata import AttentionMetadata
from inflight.executor.attention.torch_backend import TorchBackend

__all__ = ["AttentionMetadata", "TorchBackend", "get_backend"]


def get_backend(name: str, device: torch.device | None = None) -> Any:
    if name == "torch":
        # The C++ decode op is CPU code: building it (gcc, tens of seconds) on a GPU host would buy nothing.
        return TorchBackend(native=device is None or device.type == "cpu")
    if name == "triton":
        from inflight.executor.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"attention_backend={name!r} is invalid: must be torch or triton")
