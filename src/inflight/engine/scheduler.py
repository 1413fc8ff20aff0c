"""Iteration-level scheduler: re-decides the batch at every step.

One rule: a running sequence is scheduled `num_tokens - num_computed_tokens` tokens, capped by what is
left of `max_num_batched_tokens`. A fresh prompt is therefore prefilled (in chunks when long), a
sequence that just sampled gets 1 token (decode), and a preempted one recomputes — all in one batch.
A prefix cache hit at admission only sets `num_computed_tokens`: the same rule then computes the rest.
Speculative decoding counts a running sequence's draft tokens in: a decode with d drafts is a (d+1)-token
chunk, its drafts trimmed to what the budget leaves.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from inflight.config import EngineConfig
from inflight.engine.kv_cache import BlockManager
from inflight.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Draft tokens of each scheduled sequence (aligned with `seqs`), or None when no sequence has any.
    spec_token_ids: list[list[int]] | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def part(self, lo: int, hi: int) -> SchedulerOutput:
        spec = self.spec_token_ids[lo:hi] if self.spec_token_ids is not None else None
        return SchedulerOutput(self.seqs[lo:hi], self.num_scheduled_tokens[lo:hi], spec_token_ids=spec)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.static = config.scheduling_policy == "static"
        self.speculative = config.speculative_config is not None  # else no draft bookkeeping per step
        self.reserve_max_length = config.kv_reservation == "max_length"
        # Both queues stay sorted by (priority, arrival, admission order): lower priority values first,
        # so the running queue's tail holds the preemption victims and the waiting queue's head is next.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._order: dict[Sequence, tuple] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0
        # Prefix cache lookups at first admission, in prompt tokens (a resumed preemption is not a query).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def _key(self, seq: Sequence) -> tuple:
        return self._order[seq]

    def add(self, seq: Sequence) -> None:
        self._order[seq] = (seq.priority, seq.arrival_time, next(self._counter))
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out of whichever queue holds it and give its blocks back at once."""
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        i = bisect.bisect_left(queue, self._key(seq), key=self._key)
        if i < len(queue) and queue[i] is seq:
            del queue[i]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._order[seq]

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: drop the KV and replay prompt + output later; nothing is lost.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._key)

    def _reservation(self, seq: Sequence, num_tokens: int) -> int:
        # max_length: hold max_model_len worth of blocks from admission, as a contiguous allocator would.
        return self.max_model_len if self.reserve_max_length else num_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.static and not self.running:
            self._admit_static_batch()

        i = 0
        speculative = self.speculative
        drafts: list[list[int]] = []
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            unspec = seq.num_tokens - seq.num_computed_tokens
            n = min(unspec + len(seq.spec_token_ids), budget)
            target = self._reservation(seq, seq.num_computed_tokens + n)
            while not self.block_manager.allocate(seq, target):
                if seq.spec_token_ids:  # drafts never cost another sequence its place: drop them first
                    seq.spec_token_ids = []
                    n = min(unspec, budget)
                    target = self._reservation(seq, seq.num_computed_tokens + n)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(n)
                if speculative:
                    drafts.append(seq.spec_token_ids[: max(n - unspec, 0)])
                    seq.spec_token_ids = []
                budget -= n
                i += 1
        if speculative:  # the ones not scheduled this step: their drafts would be stale by the next
            for j in range(i, len(self.running)):
                self.running[j].spec_token_ids = []

        if not self.static and not out.preempted:
            w = 0
            while w < len(self.waiting) and len(self.running) < self.config.max_num_seqs and budget > 0:
                seq = self.waiting[w]
                if not seq.is_ready:  # its grammar is compiling: it must not hold up the queue
                    w += 1
                    continue
                cached = self.block_manager.find_cached_prefix(seq)
                num_cached = len(cached) * self.block_manager.block_size
                n = min(seq.num_tokens - num_cached, budget)
                if not self.block_manager.allocate(seq, self._reservation(seq, num_cached + n), cached):
                    break  # FCFS: the head waits for blocks rather than being overtaken
                self.waiting.pop(w)
                self._set_cached(seq, num_cached)
                self._start_running(seq)
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(n)
                budget -= n
        if speculative and any(drafts):
            out.spec_token_ids = drafts + [[] for _ in range(len(out.seqs) - len(drafts))]
        return out

    def _admit_static_batch(self) -> None:
        """Static batching: a whole new batch joins only once the previous one has fully drained."""
        w = 0
        while w < len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[w]
            if not seq.is_ready:
                w += 1
                continue
            cached = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            if not self.block_manager.allocate(seq, self._reservation(seq, num_cached), cached):
                break
            self.waiting.pop(w)
            self._set_cached(seq, num_cached)
            self._start_running(seq)

    def _set_cached(self, seq: Sequence, num_cached: int) -> None:
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = num_cached // self.block_manager.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached
            if self.block_manager.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self._key)
