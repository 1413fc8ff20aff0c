"""LLMEngines with injected faults, built by an engine core process (CoreSpec.engine_class names them):
faults are triggered by a request's max_tokens, since the test cannot reach into the core process."""

from __future__ import annotations

import os
import time

from inflight.engine.engine import LLMEngine

START_GATE_ENV = "INFLIGHT_TEST_START_GATE"  # a file: while it exists, a GatedEngine waits before it loads
FAIL_ONCE_MAX_TOKENS = 199  # a step fails once, after such a request has 2 tokens
BREAK_MAX_TOKENS = 13  # every step fails from the moment such a request arrives (the device is "lost")


class FlakyEngine(LLMEngine):
    failed: set[str]

    def step(self):
        failed = self.__dict__.setdefault("failed", set())
        due = [
            seq.request_id
            for seq in self._seqs.values()
            if not seq.is_finished  # aborted ones stay until the next step reports them
            and seq.sampling_params.max_tokens == FAIL_ONCE_MAX_TOKENS
            and len(seq.output_token_ids) >= 2
            and seq.request_id not in failed
        ]
        if due:  # the step fails once for all of them: the core fails every request in flight
            failed.update(due)
            raise RuntimeError("injected fault")
        return super().step()


class SlowEngine(LLMEngine):
    """Each step takes at least STEP_S: a test can act while a request is surely still running."""

    STEP_S = 0.05

    def step(self):
        time.sleep(self.STEP_S)
        return super().step()


class BreakableEngine(LLMEngine):
    broken = False

    def step(self):
        if self.broken or any(s.sampling_params.max_tokens == BREAK_MAX_TOKENS for s in self._seqs.values()):
            self.broken = True
            raise RuntimeError("device lost")
        return super().step()


class GatedEngine(LLMEngine):
    """Holds its core back at start while the file $INFLIGHT_TEST_START_GATE exists: a test keeps a restarted core
    from serving until it has looked at the gap."""

    def __init__(self, *args, **kwargs) -> None:
        gate = os.environ.get(START_GATE_ENV)
        while gate and os.path.exists(gate):
            time.sleep(0.05)
        super().__init__(*args, **kwargs)
