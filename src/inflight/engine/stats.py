"""What the engine publishes about itself: per-step stats, its snapshot, and what the core sends the front.

Readers (Triton metrics, benchmarks, step logs) see only these immutable records, never engine internals.
The core sends the front vLLM's pair: `SchedulerStats` (gauges: the state now) and `IterationStats` (counts
since its previous message), so metrics only add deltas up, across core restarts too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    time: float  # wall clock at the end of the step (time.monotonic)
    num_running: int
    num_waiting: int
    num_scheduled_seqs: int
    num_scheduled_tokens: int
    num_prefill_tokens: int  # tokens of sequences still working through their prompt (or a recompute)
    num_decode_seqs: int
    num_kv_blocks_used: int  # referenced by a sequence
    num_kv_blocks_total: int
    num_preemptions: int  # cumulative
    arrival_spread_s: float  # latest minus earliest arrival among this step's sequences
    step_time_s: float
    forward_time_s: float  # model forward + logits (the rest of the step is engine overhead)
    max_num_seqs: int
    num_kv_blocks_cached: int = 0  # free but holding a reusable prefix (evicted only when blocks run short)

    @property
    def occupancy(self) -> float:
        return self.num_running / self.max_num_seqs


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state between two steps: cumulative counters and current gauges."""

    steps: int
    prompt_tokens: int  # cumulative
    generation_tokens: int  # cumulative
    num_preemptions: int  # cumulative
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    max_num_seqs: int
    last_step: StepStats | None
    num_kv_blocks_cached: int = 0  # a subset of num_kv_blocks_free: reusable prefixes, evictable
    prefix_cache_queries: int = 0  # cumulative, prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # cumulative, of those, tokens served from the cache
    max_arrival_spread_s: float = 0.0  # the largest arrival spread of any step so far (set by the core)
    # Speculative decoding (vLLM's names), cumulative: sequences' verified proposals, their draft tokens,
    # the drafts accepted, and accepted drafts by position in the proposal.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA (vLLM's lora_requests_info): the adapters of running and of waiting requests, and max_loras (0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    grammar_cache_bytes: int = 0  # compiled grammars the structured-output cache holds (bounded by config)


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's state between two steps (vLLM's SchedulerStats): gauges, set, never summed."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_kv_blocks_cached: int  # a subset of num_kv_blocks_free: reusable prefixes, evictable
    max_num_seqs: int
    last_step: StepStats | None
    max_arrival_spread_s: float = 0.0  # the largest arrival spread of any step of this core so far
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0  # 0: LoRA off
    grammar_cache_bytes: int = 0

    @classmethod
    def of(cls, snap: EngineSnapshot, max_arrival_spread_s: float = 0.0) -> SchedulerStats:
        return cls(
            snap.num_running,
            snap.num_waiting,
            snap.num_kv_blocks_used,
            snap.num_kv_blocks_free,
            snap.num_kv_blocks_cached,
            snap.max_num_seqs,
            snap.last_step,
            max_arrival_spread_s,
            snap.running_lora_adapters,
            snap.waiting_lora_adapters,
            snap.max_lora,
            snap.grammar_cache_bytes,
        )

    def idle(self) -> SchedulerStats:
        """The same cache with nothing in it (a core that died holds nothing)."""
        total = self.num_kv_blocks_used + self.num_kv_blocks_free
        return dataclasses.replace(
            self,
            num_running=0,
            num_waiting=0,
            num_kv_blocks_used=0,
            num_kv_blocks_free=total,
            num_kv_blocks_cached=0,
            running_lora_adapters=(),
            waiting_lora_adapters=(),
            grammar_cache_bytes=0,
        )


@dataclass(frozen=True)
class IterationStats:
    """Counts since the previous message (vLLM's IterationStats, over the steps that message covers); a
    reader adds them up. Field names are EngineSnapshot's cumulative counters."""

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def between(cls, before: EngineSnapshot | None, after: EngineSnapshot) -> IterationStats:
        """What `after` counted since `before` (None: since the engine started)."""
        counts = {f: getattr(after, f) - (getattr(before, f) if before else 0) for f in _SCALAR_COUNTS}
        old = before.spec_decode_num_accepted_tokens_per_pos if before else ()
        new = after.spec_decode_num_accepted_tokens_per_pos
        return cls(**counts, spec_decode_num_accepted_tokens_per_pos=_minus(new, old))

    def __add__(self, other: IterationStats) -> IterationStats:
        counts = {f: getattr(self, f) + getattr(other, f) for f in _SCALAR_COUNTS}
        a, b = self.spec_decode_num_accepted_tokens_per_pos, other.spec_decode_num_accepted_tokens_per_pos
        n = max(len(a), len(b))
        per_pos = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
        return IterationStats(**counts, spec_decode_num_accepted_tokens_per_pos=per_pos)

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in _SCALAR_COUNTS) or any(self.spec_decode_num_accepted_tokens_per_pos)


_SCALAR_COUNTS = tuple(f.name for f in dataclasses.fields(IterationStats))[:-1]


def _minus(new: tuple[int, ...], old: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(v - (old[i] if i < len(old) else 0) for i, v in enumerate(new))
