"""The engine thread on its own (no Triton): failures, cancellation and shutdown never leave a request hanging."""

from __future__ import annotations

import threading
import time

import pytest

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.sampling_params import SamplingParams
from inflight.serving.engine_loop import EngineLoop, ErrorKind, Submission


class FlakyEngine(LLMEngine):
    """The real engine with one injected fault: the next step() raises when `fail_next` is set."""

    fail_next = False

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected fault")
        return super().step()


class Recorder:
    def __init__(self) -> None:
        self.outputs = []
        self.error: tuple[ErrorKind, str] | None = None
        self.cancelled = False
        self.done = threading.Event()
        self.started = threading.Event()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def on_output(self, output) -> None:
        self.outputs.append(output)
        self.started.set()
        if output.finished:
            self.done.set()

    def on_error(self, kind: ErrorKind, message: str) -> None:
        self.error = (kind, message)
        self.done.set()

    @property
    def text(self) -> str:
        return "".join(o.new_text for o in self.outputs)


@pytest.fixture()
def engine(demo_model_dir):
    return FlakyEngine(demo_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256))


@pytest.fixture()
def loop(engine):
    loop = EngineLoop(engine).start()
    yield loop
    assert loop.stop(timeout_s=10)


def submit(loop, prompt: str = "Hello world", max_tokens: int = 8, **params) -> Recorder:
    rec = Recorder()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    loop.submit(Submission(f"r{id(rec)}", prompt, sp, rec))
    return rec


def test_requests_complete(loop):
    recs = [submit(loop, p) for p in ("Hello world", "The model runs fast", "Why")]
    for rec in recs:
        assert rec.done.wait(30) and rec.error is None
        assert rec.outputs[-1].finished and rec.text


def test_engine_failure_fails_every_in_flight_request_and_recovers(loop, engine):
    recs = [submit(loop, max_tokens=200, ignore_eos=True) for _ in range(3)]
    assert all(r.started.wait(30) for r in recs)
    engine.fail_next = True
    for rec in recs:
        assert rec.done.wait(30)
        assert rec.error is not None and rec.error[0] is ErrorKind.INTERNAL
        assert "injected fault" in rec.error[1]
    assert engine.block_manager.num_used_blocks == 0
    after = submit(loop)
    assert after.done.wait(30) and after.error is None and after.text


def test_invalid_request_from_the_engine_is_reported(loop):
    rec = submit(loop, max_tokens=10_000)
    assert rec.done.wait(30)
    assert rec.error is not None and rec.error[0] is ErrorKind.INVALID and "max_model_len" in rec.error[1]


def test_cancel_frees_blocks_and_answers_cancelled(loop, engine):
    rec = submit(loop, max_tokens=200, ignore_eos=True)
    assert rec.started.wait(30)
    rec.cancelled = True
    assert rec.done.wait(30)
    assert rec.error is not None and rec.error[0] is ErrorKind.CANCELLED
    assert len(rec.outputs) < 200
    deadline = time.monotonic() + 10
    while engine.block_manager.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.block_manager.num_used_blocks == 0


def test_stop_fails_in_flight_and_later_requests_promptly(engine):
    loop = EngineLoop(engine).start()
    rec = submit(loop, max_tokens=200, ignore_eos=True)
    assert rec.started.wait(30)
    started = time.monotonic()
    assert loop.stop(timeout_s=10)
    assert time.monotonic() - started < 5
    assert rec.done.is_set() and rec.error is not None and rec.error[0] is ErrorKind.UNAVAILABLE
    late = submit(loop)
    assert late.done.is_set() and late.error is not None and late.error[0] is ErrorKind.UNAVAILABLE
