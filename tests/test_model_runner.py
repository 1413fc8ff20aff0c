"""The runner's per-step checks on what the scheduler hands it."""

from __future__ import annotations

import pytest

from inflight import SamplingParams
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine


def test_a_block_table_too_short_for_its_tokens_is_refused(demo_model_dir):
    # Padding fills short table rows with block 0, which may hold another request's cached prefix: a table
    # that does not cover its tokens must stop the step rather than write K/V into someone else's block.
    engine = LLMEngine(demo_model_dir, EngineConfig(num_kv_blocks=32, block_size=8, max_num_seqs=2))
    engine.add_request("a", "Hello there, a prompt of more than one block of tokens", SamplingParams(max_tokens=2))
    engine.add_request("b", "Hi", SamplingParams(max_tokens=2))
    sched = engine.scheduler.schedule()
    long_seq = max(sched.seqs, key=lambda s: len(s.block_table))
    assert len(long_seq.block_table) > 1
    long_seq.block_table = long_seq.block_table[:-1]
    with pytest.raises(AssertionError, match="block table does not cover"):
        engine.runner.prepare(sched)
