"""What the engine publishes about itself: per-step stats and a snapshot for metrics.

Readers (Triton metrics, benchmarks, step logs) see only these immutable records, never engine internals.
"""

from __future__ import annotations

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
