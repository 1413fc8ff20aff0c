"""A scheduler with no model behind it: a structured-output manager that never compiles, EOS ids as given."""

from __future__ import annotations

from inflight.config import EngineConfig
from inflight.engine.kv_cache import BlockManager
from inflight.engine.scheduler import Scheduler
from inflight.engine.structured_output import StructuredOutputManager


def make_scheduler(
    config: EngineConfig, block_manager: BlockManager, max_model_len: int, eos_token_ids: frozenset[int] = frozenset()
) -> Scheduler:
    structured = StructuredOutputManager(None, 0, [], config)  # tokenizer and vocab are read at the first compile
    return Scheduler(config, block_manager, max_model_len, set(eos_token_ids), structured)
