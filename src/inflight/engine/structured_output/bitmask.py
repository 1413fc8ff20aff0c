"""The step's token bitmask: one int32 row per sampling row, filled by the constrained rows' grammar matchers,
with the matcher time each row cost (a request's grammar time is bounded: max_grammar_*time_s)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar


class BitmaskFiller:
    """Owns the bitmask buffer (grown, never shrunk) and xgrammar's batch matcher."""

    def __init__(self, vocab_size: int) -> None:
        self.words = -(-vocab_size // 32)
        self._buffer: torch.Tensor | None = None
        self._batch_matcher = None  # xgrammar.BatchGrammarMatcher, made on the first batch of several rows

    def fill(
        self,
        num_rows: int,
        rows: list[int],
        matchers: list[xgrammar.GrammarMatcher],
        allowed: list[torch.Tensor | None],
        step_limit_s: float,
    ) -> tuple[torch.Tensor, list[float]]:
        """The bitmask [num_rows, words] with `rows` filled by `matchers` (each ANDed with its `allowed` row,
        if any), and each row's matcher seconds. The other rows are left as they were: the sampler masks
        only `rows`."""
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            self._buffer = torch.empty((2 * num_rows, self.words), dtype=torch.int32)
        bitmask = self._buffer[:num_rows]
        t0 = time.perf_counter()
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:  # xgrammar spreads the rows over its threads
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        elapsed = time.perf_counter() - t0
        # A request's matcher time is its own: the batch's time is shared out, and only a batch over the
        # one-token limit is filled again row by row to find whose it was.
        times = [elapsed / len(rows)] * len(rows)
        if len(rows) > 1 and elapsed > step_limit_s:
            times = []
            for i, matcher in zip(rows, matchers):
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, i)
                times.append(time.perf_counter() - t0)
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}  # at most two distinct rows (JSON masks)
        for i, words in zip(rows, allowed):
            if words is not None:
                groups.setdefault(id(words), (words, []))[1].append(i)
        for words, idx in groups.values():
            bitmask[idx] &= words
        return bitmask, times
