"""Paged KV block pool: reference counts, an LRU free queue, and the prefix cache (vLLM's `BlockPool`).

A full, computed block is registered under a chained hash of (parent block's hash, its token ids, extra
keys). A freed block keeps its contents and its hash while it waits in the free queue, so a later
request with the same prefix takes it back instead of recomputing it; an allocation evicts the
least-recently-freed one. Blocks that hold nothing reusable are handed out before any cached one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

import numpy as np

from inflight.engine.kv_events import BlockRemoved, BlockStored, KVCacheEvent, external_hash
from inflight.engine.sequence import Sequence

ROOT_HASH = b""  # the parent of a sequence's first block


def hash_block(parent: bytes, token_ids: Seq[int], extra_keys: tuple = ()) -> bytes:
    """Chained block hash. sha256 rather than Python's `hash`: a 64-bit collision would serve wrong KV.

    `extra_keys`: what changes a block's KV besides its tokens (the LoRA adapter; a cache salt).
    """
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Where every layer attends to its last `sliding_window` tokens only: blocks behind the window go back
        # to the pool while their sequence runs (`release_out_of_window`).
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        # Blocks with ref count 0, allocated from the front. Cached blocks join at the back (evicted
        # least-recently-freed first), blocks without reusable contents at the front (handed out first,
        # most recently freed first: their cache lines may still be warm). OrderedDict: O(1) removal on a hit.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding those contents
        self._num_free_cached = 0
        # KV events for routers (kv_events.py), taken by the engine after each step; None: not recorded.
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, in order."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: unused ones and cached ones nobody references (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (a subset of `num_free_blocks`)."""
        return self._num_free_cached

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------------

    def _block_tokens_of(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start, end = index * self.block_size, (index + 1) * self.block_size
        if end <= seq.num_prompt_tokens:
            return tuple(seq.prompt_token_ids[start:end])
        return tuple(seq.token_at(j) for j in range(start, end))

    def _seq_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks, computed once and kept on it."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else ROOT_HASH
            extra = (seq.lora_key,) if seq.lora_key is not None else ()  # two adapters never share KV
            hashes.append(hash_block(parent, self._block_tokens_of(seq, len(hashes)), extra))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`, at most `num_tokens - 1` tokens (the last
        token is always recomputed, so the request samples from fresh logits). Takes nothing yet."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i, h in enumerate(self._seq_hashes(seq, max_blocks)):
            block = self._cached.get(h)
            # A hash match is not trusted alone: the token ids must match too.
            if block is None or self._block_tokens[block] != self._block_tokens_of(seq, i):
                break
            hit.append(block)
        return hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that are full and computed, as they fill (prefill chunks and decode)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._seq_hashes(seq, num_full)
        stored: list[int] = []
        for i in range(seq.num_registered_blocks, num_full):
            block, h = seq.block_table[i], hashes[i]
            # Same contents computed twice (two requests prefilling one prompt at once): keep the first.
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._block_tokens[block] = self._block_tokens_of(seq, i)
                self._cached[h] = block
                if self._events is not None:
                    stored.append(i)
        if stored:
            self._record_stored(hashes, stored, seq.lora_id)
        seq.num_registered_blocks = num_full

    def _record_stored(self, hashes: list[bytes], indices: list[int], lora_id: int | None) -> None:
        """One BlockStored per run of consecutive newly cached blocks of a sequence (its parent chains it)."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            tokens = [t for i in run for t in self._block_tokens[self._cached[hashes[i]]]]
            parent = external_hash(hashes[run[0] - 1]) if run[0] > 0 else None
            self._events.append(
                BlockStored([external_hash(hashes[i]) for i in run], parent, tokens, self.block_size, lora_id, None)
            )

    def _evict(self, block: int) -> None:
        h = self._block_hash[block]
        if h is not None:
            if self._events is not None:
                self._events.append(BlockRemoved([external_hash(h)], None))
            del self._cached[h]
            self._block_hash[block] = None
            self._block_tokens[block] = None

    # ---- allocation ------------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Grow `seq.block_table` to hold `num_tokens` tokens, starting with `cached_blocks` (a prefix hit
        from `find_cached_prefix`, for a sequence that holds no blocks yet). All or nothing: False if
        blocks are short."""
        table = seq.block_table
        assert not cached_blocks or not table, "a prefix hit is taken by a sequence holding no blocks"
        need = self.blocks_for(num_tokens) - len(table) - len(cached_blocks)
        # Hit blocks sitting in the free queue are not free for the new blocks any more.
        reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if max(need, 0) + reclaimed > len(self._free):
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
                self._num_free_cached -= 1
            self.ref_counts[b] += 1
            table.append(b)
        for _ in range(need):
            b, _ = self._free.popitem(last=False)
            if self._block_hash[b] is not None:
                self._num_free_cached -= 1
                self._evict(b)
            self.ref_counts[b] = 1
            table.append(b)
        return True

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks no later query of `seq` reads: a query at position p >= num_computed_tokens sees
        keys p - W + 1..p, so whole blocks before num_computed_tokens - W + 1 are done. Their table entries stay
        (positions keep their blocks' indices) and the attention kernels never read them."""
        if self.sliding_window is None:
            return
        done = min(max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size, len(seq.block_table))
        for i in range(seq.num_released_blocks, done):
            self._release(seq.block_table[i])
        seq.num_released_blocks = max(seq.num_released_blocks, done)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, tail first, so a prefix outlives its suffixes in the LRU order."""
        for b in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(b)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self._free[b] = None
            if self._block_hash[b] is not None:
                self._num_free_cached += 1
            else:
                self._free.move_to_end(b, last=False)
