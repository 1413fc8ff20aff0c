"""The engine thread: the only code that touches the engine once it serves.

Other threads hand it work through a thread-safe inbox; it admits new requests between steps (so they
join the running batch at the next step), checks every in-flight request for cancellation every step,
and passes each step's outputs to the request's `Client`, which turns them into responses. It knows
nothing of Triton: `server_model.py` supplies Clients that talk to a Triton response sender.
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


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_iteration: Callable[[EngineSnapshot], None] | None = None,
        step_log: str | Path | None = None,
        on_broken: Callable[[str], None] | None = None,
    ) -> None:
        """`on_broken(reason)` is called once, from the engine thread, when the engine cannot recover."""
        self.engine = engine
        self._on_iteration = on_iteration
        self._on_broken = on_broken
        self._step_log = open(step_log, "a", buffering=1) if step_log else None  # noqa: SIM115 - lives with the loop
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[str, Client] = {}
        self._broken: str | None = None
        self._stopping = threading.Event()
        self._closed = threading.Event()  # set before the thread's last drain of the inbox
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)

    def start(self) -> EngineLoop:
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
        """Fail what is in flight, end the thread; True if it ended within the timeout."""
        self._stopping.set()
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._admit(block=not self.engine.has_unfinished_requests()):
                self._check_cancelled()
                if self.engine.has_unfinished_requests():
                    self._step()
                if self._on_iteration is not None:
                    _safe(self._on_iteration, self.engine.snapshot())
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
            self._add(item)

    def _add(self, sub: Submission) -> None:
        if self._broken is not None:
            _safe(sub.client.on_error, ErrorKind.UNAVAILABLE, f"the engine is unavailable: {self._broken}")
            return
        try:
            self.engine.add_request(sub.request_id, sub.prompt, sub.params, sub.arrival_time, sub.priority)
        except InvalidRequestError as e:
            _safe(sub.client.on_error, ErrorKind.INVALID, str(e))
            return
        except Exception as e:
            log.error("add_request failed:\n%s", traceback.format_exc())
            _safe(sub.client.on_error, ErrorKind.INTERNAL, f"the engine could not take the request: {e!r}")
            return
        self._active[sub.request_id] = sub.client

    def _check_cancelled(self) -> None:
        for request_id, client in list(self._active.items()):
            try:
                cancelled = client.is_cancelled()
            except Exception:  # the sender is gone: nobody to answer, free the blocks
                cancelled = True
            if cancelled:
                self.engine.abort_request(request_id)  # frees its KV blocks now
                del self._active[request_id]
                _safe(client.on_error, ErrorKind.CANCELLED, "the request was cancelled")

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
            client = self._active.get(out.request_id)
            if client is None:  # cancelled or failed earlier; this is the engine's abort echo
                continue
            if out.finished:
                del self._active[out.request_id]
            if out.error is not None:  # failed after admission (its grammar cannot compile)
                _safe(client.on_error, ErrorKind.INVALID, out.error)
                continue
            try:
                client.on_output(out)
            except Exception as e:
                # Final or not, the request must still end: answer it with an error (its last chance).
                log.error("sending a response failed:\n%s", traceback.format_exc())
                if not out.finished:
                    self.engine.abort_request(out.request_id)
                    del self._active[out.request_id]
                _safe(client.on_error, ErrorKind.INTERNAL, f"sending a response failed: {e!r}")

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
        for request_id, client in active.items():
            _safe(self.engine.abort_request, request_id)
            _safe(client.on_error, kind, message)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _safe(item.client.on_error, ErrorKind.UNAVAILABLE, "the model is shutting down")

    def _log_step(self) -> None:
        stats = self.engine.last_step_stats
        if stats is not None:
            record = dataclasses.asdict(stats) | {"wall_time": time.time()}
            self._step_log.write(json.dumps(record) + "\n")


def _safe(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.error("ignored error in %s:\n%s", getattr(fn, "__name__", fn), traceback.format_exc())
