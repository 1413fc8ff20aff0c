"""Two threads around the engine: one computes, one talks to the clients.

The engine thread owns the engine. It takes work from a thread-safe inbox between steps (so new requests
join the running batch at the next step) and does little else but step. Everything that is I/O happens
on the responder thread: it turns outputs into responses (merging a request's outputs that queued up
while it was busy, vLLM's stream_interval idea applied only under load: when idle it sends each one at
once), polls cancellation every `cancel_interval_s` and hands cancelled ids back to the engine thread
(which frees their blocks as soon as it sees them), and publishes metrics from the engine's latest
snapshot at most every `metrics_interval_s`. Every call into a `Client` comes from the responder, so
a client is never entered by two threads. It knows nothing of Triton: `triton_model.py` supplies
Clients that talk to a Triton response sender.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from inflight.engine.engine import LLMEngine
from inflight.engine.stats import EngineSnapshot
from inflight.outputs import RequestOutput
from inflight.sampling_params import InvalidRequestError, SamplingParams

log = logging.getLogger("inflight.serving.engine_loop")


class ErrorKind(enum.Enum):
    INVALID = "invalid"  # the user's request is wrong
    INTERNAL = "internal"  # the engine failed
    UNAVAILABLE = "unavailable"  # shutting down, or the engine is broken
    CANCELLED = "cancelled"


class Client(Protocol):
    """One request's way back to its caller. Called from the engine thread only."""

    def is_cancelled(self) -> bool: ...

    def on_output(self, output: RequestOutput) -> None: ...

    def on_error(self, kind: ErrorKind, message: str) -> None: ...


@dataclass
class Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    client: Client
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)


_STOP = object()


@dataclass(frozen=True)
class _Abort:
    """From the responder to the engine thread: this request was cancelled; free its blocks."""

    request_id: str


class _Route:
    """One request's client, as both threads see it; `ended` (responder only): answered finally."""

    __slots__ = ("client", "ended", "request_id")

    def __init__(self, request_id: str, client: Client) -> None:
        self.request_id = request_id
        self.client = client
        self.ended = False


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying both deltas (`later` is the newer)."""
    logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (later.new_logprobs or [])
    return dataclasses.replace(
        later,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
        new_logprobs=logprobs,
    )


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_iteration: Callable[[EngineSnapshot], None] | None = None,
        step_log: str | Path | None = None,
        on_broken: Callable[[str], None] | None = None,
        cancel_interval_s: float = 0.05,
        metrics_interval_s: float = 0.5,
    ) -> None:
        """`on_iteration(snapshot)` publishes metrics (responder thread, at most every metrics_interval_s);
        `on_broken(reason)` is called once, from the engine thread, when the engine cannot recover."""
        self.engine = engine
        self._on_iteration = on_iteration
        self._on_broken = on_broken
        self._cancel_interval_s = cancel_interval_s
        self._metrics_interval_s = metrics_interval_s
        self._step_log = open(step_log, "a", buffering=1) if step_log else None  # noqa: SIM115 - lives with the loop
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()  # (route, RequestOutput | (ErrorKind, message)) | _STOP
        self._active: dict[str, _Route] = {}  # engine thread writes; the responder reads copies
        self._snapshot: EngineSnapshot | None = None
        self._broken: str | None = None
        self._stopping = threading.Event()
        self._closed = threading.Event()  # set before the engine thread's last drain of the inbox
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self._responder = threading.Thread(target=self._respond, name="inflight-responder", daemon=True)

    def start(self) -> EngineLoop:
        self._responder.start()
        self._thread.start()
        return self

    def submit(self, submission: Submission) -> None:
        """Thread-safe. After stop() the request is failed at once instead."""
        if self._stopping.is_set():  # shutting down, or the loop died
            reason = self._broken or "the model is shutting down"
            _safe(submission.client.on_error, ErrorKind.UNAVAILABLE, reason)
            return
        self._inbox.put(submission)
        if self._closed.is_set():  # the thread ended between our check and our put: nobody else will drain
            self._drain_inbox()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Fail what is in flight, end the threads; True if they ended within the timeout."""
        deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)
        self._responder.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive() and not self._responder.is_alive()

    # ---- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # Once broken, every request was failed and new ones are refused: wait for work, never spin on
            # a step that raises again.
            while self._admit(block=self._broken is not None or not self.engine.has_unfinished_requests()):
                if self._broken is None and self.engine.has_unfinished_requests():
                    self._step()
                self._snapshot = self.engine.snapshot()  # an immutable record; the responder publishes it
        except BaseException:  # a bug in the loop itself: nobody may be left waiting
            log.error("engine loop crashed:\n%s", traceback.format_exc())
            self._fail_all(ErrorKind.INTERNAL, "the engine loop crashed; see the server log")
            self._set_broken("the engine loop crashed")
            raise
        finally:
            self._stopping.set()  # from here on submit() answers at once instead of queueing
            self._fail_all(ErrorKind.UNAVAILABLE, "the model is shutting down")
            self._closed.set()  # a submit() that put after this drains the inbox itself
            self._drain_inbox()
            self._outbox.put(_STOP)  # after every answer: the responder sends them all, then ends
            if self._step_log is not None:
                self._step_log.close()

    def _admit(self, block: bool) -> bool:
        """Move inbox items into the engine; block for the first one when idle. False on stop."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, _Abort):
                if self._active.pop(item.request_id, None) is not None:
                    self.engine.abort_request(item.request_id)  # frees its KV blocks now
                continue
            self._add(item)

    def _add(self, sub: Submission) -> None:
        route = _Route(sub.request_id, sub.client)
        if self._broken is not None:
            self._answer(route, ErrorKind.UNAVAILABLE, f"the engine is unavailable: {self._broken}")
            return
        try:
            self.engine.add_request(sub.request_id, sub.prompt, sub.params, sub.arrival_time, sub.priority)
        except InvalidRequestError as e:
            self._answer(route, ErrorKind.INVALID, str(e))
            return
        except Exception as e:
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._answer(route, ErrorKind.INTERNAL, f"the engine could not take the request: {e!r}")
            return
        self._active[sub.request_id] = route

    def _step(self) -> None:
        steps_before = self.engine.counters.get("steps")
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._recover(e)
            return
        if self._step_log is not None and self.engine.counters.get("steps") != steps_before:
            self._log_step()
        for out in outputs:
            route = self._active.get(out.request_id)
            if route is None:  # cancelled or failed earlier; this is the engine's abort echo
                continue
            if out.finished:
                del self._active[out.request_id]
            if out.error is not None:  # failed after admission (its grammar cannot compile, or a step on it failed)
                kind = ErrorKind.INTERNAL if out.error_kind == "internal" else ErrorKind.INVALID
                self._answer(route, kind, out.error)
                continue
            self._outbox.put((route, out))

    def _answer(self, route: _Route, kind: ErrorKind, message: str) -> None:
        self._outbox.put((route, (kind, message)))

    def _recover(self, error: Exception) -> None:
        """A step failed: fail every in-flight request, then try to bring the engine back to empty."""
        log.error("engine step failed:\n%s", traceback.format_exc())
        failed = list(self._active)
        self._fail_all(ErrorKind.INTERNAL, f"the engine failed while running this request: {error!r}")
        try:
            for request_id in failed:
                self.engine.abort_request(request_id)
            for _ in range(3):  # the abort outputs come back from the next step
                if not self.engine.has_unfinished_requests():
                    return
                self.engine.step()
            raise RuntimeError("requests still unfinished after aborting all of them")
        except Exception as e:
            log.error("engine could not recover; refusing new requests:\n%s", traceback.format_exc())
            self._set_broken(f"it failed and could not recover ({e!r}; first failure: {error!r})")

    def _set_broken(self, reason: str) -> None:
        if self._broken is not None:
            return
        self._broken = reason
        if self._on_broken is not None:
            _safe(self._on_broken, reason)

    def _fail_all(self, kind: ErrorKind, message: str) -> None:
        active, self._active = self._active, {}
        for request_id, route in active.items():
            _safe(self.engine.abort_request, request_id)
            self._answer(route, kind, message)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Submission):
                _safe(item.client.on_error, ErrorKind.UNAVAILABLE, "the model is shutting down")

    def _log_step(self) -> None:
        stats = self.engine.last_step_stats
        if stats is not None:
            record = dataclasses.asdict(stats) | {"wall_time": time.time()}
            self._step_log.write(json.dumps(record) + "\n")

    # ---- the responder thread -------------------------------------------------------------------------

    def _respond(self) -> None:
        next_cancel_check = next_metrics = time.monotonic()
        running = True
        while running:
            timeout = max(0.0, min(next_cancel_check, next_metrics) - time.monotonic())
            try:
                batch = [self._outbox.get(timeout=timeout)]
            except queue.Empty:
                batch = []
            while True:  # what queued up meanwhile goes out together
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            if batch and batch[-1] is _STOP:
                running = False
            items = [item for item in batch if item is not _STOP]
            try:
                self._deliver(items)
            except Exception:  # a bug here must not end the thread that answers everyone
                log.error("delivering responses failed:\n%s", traceback.format_exc())
                for route, item in items:
                    if not route.ended:
                        route.ended = True
                        if isinstance(item, RequestOutput) and not item.finished:
                            self._inbox.put(_Abort(item.request_id))
                        _safe(route.client.on_error, ErrorKind.INTERNAL, "sending a response failed; see the log")
            now = time.monotonic()
            if now >= next_cancel_check:
                self._check_cancelled()
                next_cancel_check = now + self._cancel_interval_s
            if now >= next_metrics or not running:
                if self._on_iteration is not None and self._snapshot is not None:
                    _safe(self._on_iteration, self._snapshot)
                next_metrics = now + self._metrics_interval_s

    def _deliver(self, batch: list) -> None:
        """Send a batch of queued items, one response per request: its outputs merged, then any error."""
        pending: dict[int, tuple[_Route, RequestOutput]] = {}
        for route, item in batch:
            if route.ended:
                continue
            key = id(route)  # routes in this batch are alive, so their ids are distinct
            if isinstance(item, RequestOutput):
                previous = pending.get(key)
                pending[key] = (route, merge_outputs(previous[1], item) if previous else item)
                continue
            if key in pending:  # an error after outputs: the outputs go first
                self._send(*pending.pop(key))
            if not route.ended:
                route.ended = True
                _safe(route.client.on_error, *item)
        for route, out in pending.values():
            if not route.ended:
                self._send(route, out)

    def _send(self, route: _Route, out: RequestOutput) -> None:
        try:
            route.client.on_output(out)
        except Exception as e:
            # Final or not, the request must still end: answer it with an error (its last chance).
            log.error("sending a response failed:\n%s", traceback.format_exc())
            route.ended = True
            if not out.finished:
                self._inbox.put(_Abort(out.request_id))
            _safe(route.client.on_error, ErrorKind.INTERNAL, f"sending a response failed: {e!r}")
            return
        if out.finished:
            route.ended = True

    def _check_cancelled(self) -> None:
        for request_id, route in self._active.copy().items():
            if route.ended:
                continue
            try:
                cancelled = route.client.is_cancelled()
            except Exception:  # the sender is gone: nobody to answer, free the blocks
                cancelled = True
            if cancelled:
                route.ended = True
                self._inbox.put(_Abort(request_id))
                _safe(route.client.on_error, ErrorKind.CANCELLED, "the request was cancelled")


def _safe(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.error("ignored error in %s:\n%s", getattr(fn, "__name__", fn), traceback.format_exc())
