"""Request/sequence state: one `Sequence` per request, owned by the engine thread."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inflight.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # resolved: the request's seed or one drawn at arrival, so sampling never depends on the batch
    arrival_time: float
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prefix cache: chained hashes of the full blocks (kept across preemption: the tokens do not change),
    # how many of `block_table`'s blocks are registered in the cache, and the prompt tokens served from
    # the cache at first admission (None until admitted).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Leading blocks of `block_table` already given back: behind every layer's sliding window (kv_cache.py)
    num_released_blocks: int = 0
    num_cached_tokens: int | None = None
    # Filled in by the engine as the request progresses (for metrics / benchmarks).
    cumulative_logprob: float = 0.0
    # Speculative decoding: draft tokens proposed for the next step (set just before scheduling; the
    # scheduler moves them into its output, so they never outlive a step).
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (None: the base model), the id its KV events carry, and the key its prefix
    # cache blocks are hashed with (engine/lora.py)
    lora_name: str | None = None
    lora_id: int | None = None
    lora_key: bytes | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]
