"""Attention metadata for a batch whose sequences own consecutive blocks (the layout a fresh cache gets)."""

from __future__ import annotations

import numpy as np
import torch

from inflight.executor.attention import AttentionMetadata


def batch_metadata(seq_lens: list[int], query_lens: list[int], block_size: int, device: torch.device):
    """Positions, metadata and the number of blocks used, for sequences of `seq_lens` tokens whose last
    `query_lens` tokens are this step's queries."""
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
