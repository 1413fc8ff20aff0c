"""The engine thread on its own (no Triton): failures, cancellation and shutdown never leave a request hanging."""

from __future__ import annotations

import queue
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


class FailingFinalSend(Recorder):
    """A client whose final response cannot be sent (the sender raised)."""

    def on_output(self, output) -> None:
        if output.finished:
            raise RuntimeError("send failed")
        super().on_output(output)


def test_a_failed_final_send_still_answers_the_request(loop, engine):
    rec = FailingFinalSend()
    loop.submit(Submission("final-fails", "Hello world", SamplingParams(temperature=0, max_tokens=4), rec))
    assert rec.done.wait(30), "the request was left hanging"
    assert rec.error is not None and rec.error[0] is ErrorKind.INTERNAL and "send failed" in rec.error[1]
    assert engine.block_manager.num_used_blocks == 0


class _PutAfterTheLoopEnded(queue.Queue):
    """An inbox whose put() is delayed until the engine thread has ended: submit() checked 'not stopping',
    then lost the CPU while stop() ran to completion (the check-then-put race, made deterministic)."""

    def __init__(self, loop_thread: threading.Thread) -> None:
        super().__init__()
        self.loop_thread = loop_thread
        self.delay = False

    def put(self, item, block=True, timeout=None):
        if self.delay and isinstance(item, Submission):
            self.loop_thread.join(10)
        super().put(item, block, timeout)


def test_submit_racing_stop_is_still_answered(engine):
    loop = EngineLoop(engine)
    inbox = _PutAfterTheLoopEnded(loop._thread)
    loop._inbox = inbox
    loop.start()
    inbox.delay = True
    rec = Recorder()
    submitter = threading.Thread(
        target=loop.submit, args=(Submission("racer", "Hi", SamplingParams(max_tokens=2), rec),)
    )
    submitter.start()  # passes the 'stopping?' check, then waits in put() for the loop to end
    time.sleep(0.2)
    assert loop.stop(timeout_s=10)
    submitter.join(20)
    assert rec.done.wait(5), "a request submitted while the loop stopped was never answered"
    assert rec.error is not None and rec.error[0] is ErrorKind.UNAVAILABLE


def test_a_broken_engine_is_reported_once(demo_model_dir):
    class Unrecoverable(FlakyEngine):
        steps = 0

        def step(self):
            Unrecoverable.steps += 1
            raise RuntimeError("device lost")

    engine = Unrecoverable(demo_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256))
    reasons = []
    loop = EngineLoop(engine, on_broken=reasons.append).start()
    try:
        rec = submit(loop)
        assert rec.done.wait(30) and rec.error is not None and rec.error[0] is ErrorKind.INTERNAL
        assert _wait(lambda: reasons), "on_broken was never called"
        late = submit(loop)
        assert late.done.wait(10) and late.error is not None and late.error[0] is ErrorKind.UNAVAILABLE
        assert len(reasons) == 1 and "device lost" in reasons[0]
        steps = Unrecoverable.steps
        time.sleep(0.3)
        assert Unrecoverable.steps == steps, "a broken engine keeps being stepped (the loop spins)"
    finally:
        loop.stop(timeout_s=10)


def test_a_bug_while_delivering_fails_those_requests_and_the_responder_lives_on(engine, monkeypatch):
    send = EngineLoop._send
    calls = []

    def send_that_breaks_once(self, route, out):
        calls.append(out)
        if len(calls) == 1:
            raise RuntimeError("injected responder bug")
        send(self, route, out)

    monkeypatch.setattr(EngineLoop, "_send", send_that_breaks_once)
    loop = EngineLoop(engine).start()
    try:
        first = submit(loop)
        assert first.done.wait(30) and first.error is not None and first.error[0] is ErrorKind.INTERNAL
        second = submit(loop)
        assert second.done.wait(30) and second.error is None and second.text
    finally:
        assert loop.stop(timeout_s=10)


def _wait(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class SlowClient(Recorder):
    """Sending takes a while (a busy server): outputs that queue up meanwhile arrive merged."""

    def on_output(self, output) -> None:
        time.sleep(0.05)
        super().on_output(output)


def test_outputs_that_queue_up_are_merged_and_lose_nothing(loop):
    fast, slow = submit(loop, max_tokens=40, ignore_eos=True), SlowClient()
    loop.submit(Submission("slow", "Hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), slow))
    assert fast.done.wait(60) and slow.done.wait(60)
    assert slow.error is None and slow.text == fast.text
    assert sum(len(o.new_token_ids) for o in slow.outputs) == 40 == slow.outputs[-1].num_output_tokens
    assert len(slow.outputs) < 40  # merged while the responder was busy sending
    assert slow.outputs[-1].finished and slow.outputs[-1].finish_reason == "length"


def test_cancellation_is_seen_within_the_interval(engine):
    loop = EngineLoop(engine, cancel_interval_s=0.05).start()
    try:
        rec = submit(loop, max_tokens=200, ignore_eos=True)
        assert rec.started.wait(30)
        rec.cancelled = True
        cancelled_at = time.monotonic()
        assert rec.done.wait(10) and rec.error[0] is ErrorKind.CANCELLED
        assert time.monotonic() - cancelled_at < 1.0
        assert _wait(lambda: engine.block_manager.num_used_blocks == 0)
    finally:
        assert loop.stop(timeout_s=10)


def test_metrics_are_published_from_snapshots_at_an_interval(engine):
    snaps = []
    loop = EngineLoop(engine, on_iteration=snaps.append, metrics_interval_s=0.2).start()
    try:
        rec = submit(loop, max_tokens=30, ignore_eos=True)
        assert rec.done.wait(30)
        time.sleep(0.5)
    finally:
        assert loop.stop(timeout_s=10)
    assert snaps and snaps[-1].generation_tokens == 30 and snaps[-1].num_running == 0
    assert len(snaps) < engine.counters["steps"]  # not one publication per step
