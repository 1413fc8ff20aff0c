"""The flattened, unpadded batch every attention backend reads (one step, shared by all layers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's batch. T = scheduled tokens, B = scheduled sequences (queries are contiguous per seq)."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) for each new K/V
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32 (unused entries are 0)
    query_start_loc_np: np.ndarray  # host copies so no backend syncs with the device to plan work
    seq_lens_np: np.ndarray
    cache: dict[str, Any] = field(default_factory=dict)  # per-step values a backend derives once, not per layer

    @property
    def query_lens_np(self) -> np.ndarray:
        return np.diff(self.query_start_loc_np)
