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
    # [T] int32: each token's adapter slot (models/lora.py), -1 for none; None when no row of the step has one
    token_lora_slots: torch.Tensor | None = None
    cache: dict[str, Any] = field(default_factory=dict)  # per-step values a backend derives once, not per layer

    @property
    def query_lens_np(self) -> np.ndarray:
        return np.diff(self.query_start_loc_np)


def consecutive_batch(
    seq_lens: list[int], query_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata, int]:
    """A step in which sequences of `seq_lens` tokens query their last `query_lens` tokens and own consecutive
    blocks (the layout of a fresh cache), for benchmarks and tests that build steps without a scheduler:
    (positions, metadata, blocks used)."""
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    n = np.asarray(query_lens, dtype=np.int64)
    nblk = -(-seq_lens_np // block_size)
    tables = np.zeros((len(seq_lens), int(nblk.max())), dtype=np.int32)
    first = np.concatenate([[0], np.cumsum(nblk)[:-1]])
    for row, (f, k) in enumerate(zip(first, nblk)):
        tables[row, :k] = np.arange(f, f + k)
    qsl = np.concatenate([[0], np.cumsum(n)])
    positions = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens_np, n)])
    rows = np.repeat(np.arange(len(seq_lens)), n)
    slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens_np,
    )
    return torch.from_numpy(positions).to(device), meta, int(nblk.sum())
