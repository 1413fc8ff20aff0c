"""The front's engine loop on its own (no Triton) over a real engine core process: failures, cancellation,
shutdown and the core's death never leave a request hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from faulty_engines import BREAK_MAX_TOKENS, FAIL_ONCE_MAX_TOKENS

from inflight.config import EngineConfig
from inflight.engine.core import CoreSpec
from inflight.sampling_params import SamplingParams
from inflight.serving.engine_loop import EngineLoop, ErrorKind, Submission

CONFIG = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256)


class Recorder:
    def __init__(self) -> None:
        self.outputs = []
        self.error: tuple[ErrorKind, str] | None = None
        self.field: str | None = None
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

    def on_error(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        self.error, self.field = (kind, message), field
        self.done.set()

    @property
    def text(self) -> str:
        return "".join(o.new_text for o in self.outputs)


def spec(model_dir: str, engine: str = "faulty_engines:FlakyEngine") -> CoreSpec:
    return CoreSpec(model_dir, CONFIG, engine)


@pytest.fixture(scope="module")
def loop(demo_model_dir):
    loop = EngineLoop(spec(demo_model_dir), metrics_interval_s=0.05).start()
    yield loop
    assert loop.stop(timeout_s=10)


def submit(loop, prompt: str = "Hello world", max_tokens: int = 8, **params) -> Recorder:
    rec = Recorder()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    loop.submit(Submission(f"r{id(rec)}", prompt, sp, rec))
    return rec


def blocks_used(loop) -> int | None:
    state = loop.scheduler_stats
    return None if state is None else state.num_kv_blocks_used


def kv_freed(loop) -> bool:
    return _wait(lambda: blocks_used(loop) == 0 and loop.scheduler_stats.num_running == 0)


def test_requests_complete(loop):
    recs = [submit(loop, p) for p in ("Hello world", "The model runs fast", "Why")]
    for rec in recs:
        assert rec.done.wait(30) and rec.error is None
        assert rec.outputs[-1].finished and rec.text
    assert recs[0].outputs[-1].prompt_token_ids == loop.tokenize("Hello world")


def test_engine_failure_fails_every_in_flight_request_and_recovers(loop):
    recs = [submit(loop, max_tokens=FAIL_ONCE_MAX_TOKENS, ignore_eos=True) for _ in range(3)]
    for rec in recs:
        assert rec.done.wait(30)
        assert rec.error is not None and rec.error[0] is ErrorKind.INTERNAL
        assert "injected fault" in rec.error[1]
    assert kv_freed(loop)
    after = submit(loop)
    assert after.done.wait(30) and after.error is None and after.text


def test_invalid_request_from_the_engine_is_reported(loop):
    rec = submit(loop, max_tokens=10_000)
    assert rec.done.wait(30)
    assert rec.error is not None and rec.error[0].is_users and "max_model_len" in rec.error[1]


def test_invalid_prompt_is_reported_by_the_front(loop):
    rec = submit(loop, prompt="")
    assert rec.done.is_set() and rec.error == (ErrorKind.INVALID, "prompt is empty: give at least one character")


def test_cancel_frees_blocks_and_answers_cancelled(loop):
    rec = submit(loop, max_tokens=200, ignore_eos=True)
    assert rec.started.wait(30)
    rec.cancelled = True
    assert rec.done.wait(30)
    assert rec.error is not None and rec.error[0] is ErrorKind.CANCELLED
    assert len(rec.outputs) < 200
    assert kv_freed(loop)


def test_cancellation_is_seen_within_the_interval(loop):
    rec = submit(loop, max_tokens=200, ignore_eos=True)
    assert rec.started.wait(30)
    rec.cancelled = True
    # The loop polls as each step's message comes, at most every cancel_interval_s (0.05 s): a hundred intervals
    # is generous on a loaded machine, and far shorter than the request left to run on its own.
    assert rec.done.wait(5) and rec.error[0] is ErrorKind.CANCELLED
    assert len(rec.outputs) < 200
    assert kv_freed(loop)


def test_a_stop_string_ends_the_stream_in_the_front_and_aborts_the_request_in_the_core(loop):
    # The core does not look for stop strings: the front finds one, ends the stream there and aborts the
    # request in the core, which gives its KV blocks back instead of running on to max_tokens.
    full = submit(loop, "The model runs fast", max_tokens=64, ignore_eos=True)
    assert full.done.wait(30) and full.error is None
    stop = full.text[len(full.text) // 4 :][:3]
    assert stop.strip(), full.text
    assert kv_freed(loop)
    before = loop.totals.generation_tokens
    rec = submit(loop, "The model runs fast", max_tokens=240, ignore_eos=True, stop=[stop])
    assert rec.done.wait(30) and rec.error is None
    last = rec.outputs[-1]
    assert rec.text == full.text[: full.text.index(stop)] and stop not in rec.text
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    tokens = [t for o in rec.outputs for t in o.new_token_ids]
    assert tokens == [t for o in full.outputs for t in o.new_token_ids][: len(tokens)]
    assert last.num_output_tokens == len(tokens) < 64
    assert _wait(lambda: loop.totals.generation_tokens - before >= len(tokens)) and kv_freed(loop)
    generated = loop.totals.generation_tokens - before
    assert generated < 240, "the core ran on after the stop string"


class FailingFinalSend(Recorder):
    """A client whose final response cannot be sent (the sender raised)."""

    def on_output(self, output) -> None:
        if output.finished:
            raise RuntimeError("send failed")
        super().on_output(output)


def test_a_failed_final_send_still_answers_the_request(loop):
    rec = FailingFinalSend()
    loop.submit(Submission("final-fails", "Hello world", SamplingParams(temperature=0, max_tokens=4), rec))
    assert rec.done.wait(30), "the request was left hanging"
    assert rec.error is not None and rec.error[0] is ErrorKind.INTERNAL and "send failed" in rec.error[1]
    assert kv_freed(loop)


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


def test_a_bug_while_delivering_fails_those_requests_and_the_responder_lives_on(loop, monkeypatch):
    send = EngineLoop._send
    calls = []

    def send_that_breaks_once(self, route, out):
        calls.append(out)
        if len(calls) == 1:
            raise RuntimeError("injected responder bug")
        send(self, route, out)

    monkeypatch.setattr(EngineLoop, "_send", send_that_breaks_once)
    first = submit(loop)
    assert first.done.wait(30) and first.error is not None and first.error[0] is ErrorKind.INTERNAL
    second = submit(loop)
    assert second.done.wait(30) and second.error is None and second.text


def test_metrics_are_published_as_deltas_at_an_interval(demo_model_dir):
    published = []
    loop = EngineLoop(
        spec(demo_model_dir), on_iteration=lambda *args: published.append(args), metrics_interval_s=0.2
    ).start()
    try:
        rec = submit(loop, max_tokens=30, ignore_eos=True)
        assert rec.done.wait(30)
        # The engine going idle is published too (then nothing more while it stays idle).
        assert _wait(lambda: published and published[-1][0].num_running == 0 and sum(c.steps for _, c in published))
    finally:
        assert loop.stop(timeout_s=10)
    # Each publication carries the counts since the one before: they add up to the request's, once.
    assert published and sum(counts.generation_tokens for _, counts in published) == 30
    assert published[-1][0].num_running == 0
    assert len(published) < sum(counts.steps for _, counts in published)  # not one publication per step


def test_stop_fails_in_flight_and_later_requests_promptly(demo_model_dir):
    loop = EngineLoop(spec(demo_model_dir)).start()
    pid = loop.core_pid
    rec = submit(loop, max_tokens=200, ignore_eos=True)
    assert rec.started.wait(30)
    assert loop.stop(timeout_s=10)
    # Failed, not left to run on: it had most of its 200 tokens to go.
    assert rec.done.is_set() and rec.error is not None and rec.error[0] is ErrorKind.UNAVAILABLE
    assert len(rec.outputs) < 200
    late = submit(loop)
    assert late.done.is_set() and late.error is not None and late.error[0] is ErrorKind.UNAVAILABLE
    assert not _alive(pid), "the engine core process outlived stop()"


def test_submits_racing_stop_are_all_answered(demo_model_dir):
    loop = EngineLoop(spec(demo_model_dir)).start()
    recs: list[Recorder] = []

    def submitter():
        for _ in range(200):
            recs.append(submit(loop, max_tokens=2))

    thread = threading.Thread(target=submitter)
    thread.start()
    time.sleep(0.05)
    assert loop.stop(timeout_s=10)
    thread.join(20)
    assert all(r.done.wait(5) for r in recs), "a request submitted while the loop stopped was never answered"


def test_a_broken_engine_is_reported_once_and_not_spun(demo_model_dir):
    reasons = []
    loop = EngineLoop(spec(demo_model_dir, "faulty_engines:BreakableEngine"), on_broken=reasons.append).start()
    try:
        rec = submit(loop, max_tokens=BREAK_MAX_TOKENS)
        assert rec.done.wait(30) and rec.error is not None and rec.error[0] is ErrorKind.INTERNAL
        assert _wait(lambda: reasons), "on_broken was never called"
        late = submit(loop)
        assert late.done.wait(10) and late.error is not None and late.error[0] is ErrorKind.UNAVAILABLE
        assert len(reasons) == 1 and "device lost" in reasons[0]
        before = _cpu_seconds(loop.core_pid)
        time.sleep(0.5)
        assert _cpu_seconds(loop.core_pid) - before < 0.2, "a broken engine keeps being stepped (the core spins)"
    finally:
        loop.stop(timeout_s=10)


class StartsAtError(Recorder):
    """Notes how many times the core had started when its request failed."""

    def __init__(self, starts: list) -> None:
        super().__init__()
        self.starts, self.starts_at_error = starts, None

    def on_error(self, *args, **kwargs) -> None:
        self.starts_at_error = len(self.starts)
        super().on_error(*args, **kwargs)


def test_core_death_fails_in_flight_requests_at_once_and_the_core_restarts(demo_model_dir):
    starts, unavailable = [], []
    recs = [StartsAtError(starts) for _ in range(3)]

    def on_unavailable(reason: str) -> None:  # (reason, requests already failed): the probe turns first
        unavailable.append((reason, sum(r.done.is_set() for r in recs)))

    loop = EngineLoop(
        spec(demo_model_dir), on_core_start=starts.append, on_unavailable=on_unavailable, restart_backoff_s=0.1
    ).start()
    try:
        first_pid = loop.core_pid
        for i, rec in enumerate(recs):
            loop.submit(Submission(f"d{i}", "Hello world", SamplingParams(max_tokens=200, ignore_eos=True), rec))
        assert all(r.started.wait(30) for r in recs)
        os.kill(first_pid, signal.SIGKILL)
        # The front sees the death at once (the process's sentinel); 10 s is only a generous bound for a loaded
        # machine. The order is what counts: every request failed before a new core was started.
        assert all(r.done.wait(10) for r in recs), "a request hung after the core died"
        assert [r.starts_at_error for r in recs] == [1, 1, 1]
        assert unavailable == [("the engine process died (was killed by signal SIGKILL); restarting", 0)]
        for rec in recs:
            assert rec.error is not None and rec.error[0] is ErrorKind.UNAVAILABLE
            assert "the engine process died (was killed by signal SIGKILL); restarting" in rec.error[1]
        during = submit(loop)
        if loop.core_pid == first_pid:  # still restarting: refused at once
            assert during.done.is_set() and during.error[0] is ErrorKind.UNAVAILABLE
        assert _wait(lambda: loop.core_pid != first_pid, timeout_s=120), "the core was not restarted"
        assert not _alive(first_pid)
        after = submit(loop)
        assert after.done.wait(30) and after.error is None and after.text
        assert len(starts) == 2 and loop.totals.generation_tokens >= 3
        assert kv_freed(loop)
    finally:
        assert loop.stop(timeout_s=10)


def test_a_dead_cores_gauges_go_idle_at_once_not_after_the_restart(demo_model_dir):
    """The metrics must not show the dead core's KV blocks and running requests while a new core loads."""
    published = []
    loop = EngineLoop(spec(demo_model_dir, "faulty_engines:SlowEngine"),
                      on_iteration=lambda state, _: published.append(state),
                      metrics_interval_s=0.05, restart_backoff_s=30.0).start()  # fmt: skip
    try:
        first_pid = loop.core_pid
        rec = submit(loop, max_tokens=200, ignore_eos=True)  # 200 steps of >= 50 ms: still running at the kill
        assert rec.started.wait(30) and _wait(lambda: published and published[-1].num_kv_blocks_used > 0)
        assert not rec.done.is_set()
        os.kill(first_pid, signal.SIGKILL)
        assert rec.done.wait(10)
        idle = _wait(lambda: published[-1].num_kv_blocks_used == 0 and published[-1].num_running == 0, timeout_s=10)
        assert idle and loop.core_pid == first_pid, "the dead core's gauges stayed up until the restart"
    finally:
        assert loop.stop(timeout_s=10)


def test_a_core_that_keeps_dying_makes_the_loop_broken(demo_model_dir):
    reasons = []
    loop = EngineLoop(spec(demo_model_dir), on_broken=reasons.append, max_restarts=0).start()
    try:
        os.kill(loop.core_pid, signal.SIGKILL)
        assert _wait(lambda: reasons), "on_broken was never called"
        assert "died 1 times" in reasons[0]
        late = submit(loop)
        assert late.done.is_set() and late.error[0] is ErrorKind.UNAVAILABLE
    finally:
        loop.stop(timeout_s=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().split(")")[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_stopping_loop_makes_no_metric_update(demo_model_dir):
    """Stopping is the model unloading: a metric update then is a call into a server that is unloading the model
    (python_backend's stub may die of it, and the server waits out its exit timeout)."""
    calls, stopping = [], threading.Event()
    loop = EngineLoop(spec(demo_model_dir, "faulty_engines:SlowEngine"),
                      on_iteration=lambda state, counts: calls.append(stopping.is_set()),
                      metrics_interval_s=600.0).start()  # fmt: skip
    rec = submit(loop, max_tokens=200, ignore_eos=True)
    assert rec.started.wait(30) and _wait(lambda: calls)  # published as work began
    assert _wait(lambda: len(rec.outputs) >= 20)  # steps since: counts not yet published
    stopping.set()
    assert loop.stop(timeout_s=10)
    assert rec.done.is_set() and rec.error[0] is ErrorKind.UNAVAILABLE
    assert calls and True not in calls, calls
