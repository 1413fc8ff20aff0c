"""Paged KV block allocator: a free list and reference counts over `num_blocks` fixed-size blocks."""

from __future__ import annotations

import numpy as np

from inflight.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: a just-freed block is reused first, while its cache lines may still be warm.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq.block_table` to hold `num_tokens` tokens. All or nothing: False if blocks are short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        new = self._free[-need:]
        del self._free[-need:]
        self.ref_counts[new] += 1
        seq.block_table.extend(new)
        return True

    def free(self, seq: Sequence) -> None:
        if not seq.block_table:
            return
        table = np.asarray(seq.block_table, dtype=np.int64)
        self.ref_counts[table] -= 1
        released = table[self.ref_counts[table] == 0]
        self._free.extend(released[::-1].tolist())
        seq.block_table = []
