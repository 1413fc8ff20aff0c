"""What the executor reads of the engine's step: the scheduled sequences and their token counts. The engine
hands its own objects down (engine.sequence.Sequence, engine.scheduler.SchedulerOutput); these protocols
name what they must carry, so the executor never imports the engine."""

from __future__ import annotations

from typing import Protocol

from inflight.sampling_params import SamplingParams


class ScheduledSequence(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    num_preemptions: int  # a new count: the sequence restarted (its KV recomputes from token 0)
    sampling_params: SamplingParams
    seed: int

    @property
    def num_tokens(self) -> int: ...


class ScheduledStep(Protocol):
    seqs: list[ScheduledSequence]
    num_scheduled_tokens: list[int]  # aligned with seqs
    spec_token_ids: list[list[int]] | None  # each sequence's drafts to verify, or None when none has any
    lora_slots: list[int] | None  # each sequence's LoRA adapter slot (-1: none), or None when none has one
