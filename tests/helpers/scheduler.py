"""A scheduler with no model behind it: no EOS token, a structured-output manager that never compiles."""

from __future__ import annotations

from inflight.config import EngineConfig
from inflight.engine.kv_cache import BlockManager
from inflight.engine.scheduler import Scheduler
from inflight.engine.structured_output import StructuredOutputManager


def make_scheduler(config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> Scheduler:
    structured = StructuredOutputManager(None, 0, [], config)  # tokenizer and vocab are read at the first compile
    return Scheduler(config, block_manager, max_model_len, set(), structured)
