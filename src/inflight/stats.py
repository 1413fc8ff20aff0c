"""Per-step engine statistics: what Triton metrics and benchmark plots read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    time: float  # wall clock at the end of the step (time.monotonic)
    num_running: int
    num_waiting: int
    num_scheduled_seqs: int
    num_scheduled_tokens: int
    num_prefill_tokens: int  # tokens of sequences still working through their prompt (or a recompute)
    num_decode_seqs: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int  # cumulative
    arrival_spread_s: float  # latest minus earliest arrival among this step's sequences
    step_time_s: float
    forward_time_s: float  # model forward + logits (the rest of the step is engine overhead)
    max_num_seqs: int

    @property
    def occupancy(self) -> float:
        return self.num_running / self.max_num_seqs
