"""The front of the engine: requests go to the engine core process, its step messages come back to clients.

The engine runs in its own process (`inflight.engine.core`, started through `CoreClient`); this process
holds no engine. `submit()` (any thread) registers a request's client and sends it to the core. One
responder thread does all the talking: it takes the core's step messages (token ids), runs the output
processor on them (text and stop strings: a request a stop string ended finishes here and is aborted in the
core, and the tokens the core made after the stop never reach its client), turns outputs into responses
(merging a request's outputs that queued up while it was busy, vLLM's stream_interval idea applied only
under load), polls cancellation when a step's message arrives (at most every `cancel_interval_s`, at least every
`cancel_max_interval_s`) and tells the core to abort (which frees the blocks as soon as it sees it), and
publishes metrics at most every `metrics_interval_s`: the core's latest state and the counts it sent since the
last publication (deltas: a restarted core's simply add on).
Every call into a `Client` comes from the responder, so a client is never entered by two threads.

If the core process dies, every request in flight is failed at once (UNAVAILABLE), new ones are refused
while the core restarts (at most `max_restarts` within `restart_window_s`, with backoff); past that the
loop is broken and `on_broken` is called. It knows nothing of Triton: `triton_model.py` supplies Clients.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from inflight.engine import core_messages
from inflight.engine.core import CoreSpec
from inflight.engine.core_client import CoreClient, CoreError
from inflight.engine.stats import IterationStats, SchedulerStats
from inflight.engine.validation import check_params, tokenize_prompt
from inflight.errors import ErrorKind, InvalidRequestError
from inflight.models.loader import load_tokenizer
from inflight.outputs import RequestOutput, merge_outputs
from inflight.sampling_params import SamplingParams
from inflight.text.output_processor import RequestState, process_outputs

log = logging.getLogger("inflight.serving.engine_loop")


__all__ = ["Client", "EngineLoop", "ErrorKind", "Submission"]


class Client(Protocol):
    """One request's way back to its caller. Called from the responder thread only."""

    def is_cancelled(self) -> bool: ...

    def on_output(self, output: RequestOutput) -> None: ...

    def on_error(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        """The request's last word: `field` is the request field at fault, if one is."""


@dataclass
class Submission:
    request_id: str
    prompt: str | list[int]  # text is tokenized by submit()
    params: SamplingParams
    client: Client
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    lora_name: str | None = None  # the LoRA adapter (the core checks it is known)


# A failed request's answer: kind, message, request field at fault.
Failure = tuple[ErrorKind, str, "str | None"]


class _ActiveRequest:
    """One request's client and its text (the output processor's state, responder only); `ended` (responder
    only): answered finally."""

    __slots__ = ("client", "ended", "prompt_token_ids", "request_id", "state")

    def __init__(self, request_id: str, client: Client, prompt_token_ids: list[int], state: RequestState) -> None:
        self.request_id = request_id
        self.client = client
        self.prompt_token_ids = prompt_token_ids
        self.state = state
        self.ended = False

    def fail(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        """End the request with an error, unless it has been answered finally already."""
        if not self.ended:
            self.ended = True
            _notify(self.client, kind, message, field)


# The restart bound: a core that dies more than MAX_RESTARTS times within RESTART_WINDOW_S is not restarted
# again (a crash loop); the k-th restart in the window waits RESTART_BACKOFF_S * 2**(k-1) first.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 0.5


class EngineLoop:
    def __init__(
        self,
        spec: CoreSpec,
        on_iteration: Callable[[SchedulerStats, IterationStats], None] | None = None,
        on_broken: Callable[[str], None] | None = None,
        cancel_interval_s: float = 0.05,
        cancel_max_interval_s: float = 0.5,
        metrics_interval_s: float = 0.5,
        on_core_start: Callable[[core_messages.Ready], None] | None = None,
        on_unavailable: Callable[[str], None] | None = None,
        max_restarts: int = MAX_RESTARTS,
        restart_window_s: float = RESTART_WINDOW_S,
        restart_backoff_s: float = RESTART_BACKOFF_S,
    ) -> None:
        """`on_iteration(state, counts)` publishes metrics (at most every metrics_interval_s; `counts` since its
        previous call); `on_broken(reason)`
        is called once when the engine cannot serve again; `on_core_start(ready)` after each (re)start;
        `on_unavailable(reason)` when the engine stops serving (its core died, or it broke), before the requests
        in flight are failed: a readiness probe turns false before anyone is refused.
        All from the responder thread (the first start's from start())."""
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.model_dir)  # the front tokenizes and detokenizes; the core computes
        self._on_iteration = on_iteration
        self._on_broken = on_broken
        self._on_core_start = on_core_start
        self._on_unavailable = on_unavailable
        self._cancel_interval_s = cancel_interval_s
        self._cancel_max_interval_s = max(cancel_interval_s, cancel_max_interval_s)
        self._metrics_interval_s = metrics_interval_s
        self._max_restarts = max_restarts
        self._restart_window_s = restart_window_s
        self._restart_backoff_s = restart_backoff_s
        self._deaths: collections.deque[float] = collections.deque()
        self._core: CoreClient | None = None
        self.info: core_messages.Ready | None = None  # the running core's handshake
        self._lock = threading.Lock()  # guards _active and _unavailable against submit()
        self._active: dict[str, _ActiveRequest] = {}
        self._unavailable: str | None = None  # why new requests are refused now (restarting)
        self._broken: str | None = None
        self.scheduler_stats: SchedulerStats | None = None  # the core's latest state (responder only)
        self.totals = IterationStats()  # every count of every core so far (responder only)
        self._unpublished = IterationStats()  # counts not yet given to on_iteration
        self._published: SchedulerStats | None = None
        self._stopping = threading.Event()
        self._responder = threading.Thread(target=self._respond, name="inflight-responder", daemon=True)

    def start(self) -> EngineLoop:
        """Start the core process and wait until it is ready (CoreError if it cannot start)."""
        self._start_core()
        self._responder.start()
        return self

    @property
    def core_pid(self) -> int | None:
        return self.info.pid if self.info is not None else None

    def tokenize(self, prompt: str) -> list[int]:
        """Prompt text -> token ids under the engine's bounds (InvalidRequestError). Thread-safe."""
        info = self.info
        return tokenize_prompt(self.tokenizer, prompt, info.max_prompt_bytes, info.max_model_len)

    def check_params(self, params: SamplingParams) -> None:
        check_params(self.spec.config, params)

    def submit(self, submission: Submission) -> None:
        """Thread-safe. While the core restarts, or after stop(), the request is failed at once instead."""
        sub = submission
        try:
            prompt = self.tokenize(sub.prompt) if isinstance(sub.prompt, str) else list(sub.prompt)
        except InvalidRequestError as e:
            _notify(sub.client, e.kind, str(e), e.field)
            return
        active = _ActiveRequest(sub.request_id, sub.client, prompt, RequestState(self.tokenizer, prompt, sub.params))
        with self._lock:
            reason = self._refusal()
            if reason is None:
                self._active[sub.request_id] = active
                self._core.add(
                    core_messages.AddRequest.make(
                        sub.request_id, prompt, sub.params, sub.arrival_time, sub.priority, sub.lora_name
                    )
                )
        if reason is not None:
            _notify(sub.client, ErrorKind.UNAVAILABLE, reason)

    def lora_admin(self, request: core_messages.LoRAAdmin, client: Client) -> None:
        """Thread-safe: load or unload a LoRA adapter in the core, answered through `client` (a finished output, or
        an error naming why). An adapter loaded here is registered again by every later core (a restart keeps it)."""
        state = RequestState(self.tokenizer, [], SamplingParams())
        active = _ActiveRequest(request.request_id, _LoRAAdminClient(client, request, self.spec.config), [], state)
        with self._lock:
            reason = self._refusal()
            if reason is None:
                self._active[request.request_id] = active
                self._core.lora_admin(request)
        if reason is not None:
            _notify(client, ErrorKind.UNAVAILABLE, reason)

    def lora_names(self) -> list[str]:
        """The adapters a request may name now (start-up's and those loaded since)."""
        return sorted(self.spec.config.lora_modules or {}) if self.spec.config.enable_lora else []

    def _refusal(self) -> str | None:
        if self._stopping.is_set():
            return "the model is shutting down"
        if self._broken is not None:
            return f"the engine is unavailable: {self._broken}"
        return self._unavailable

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Fail what is in flight, end the responder and the core; True if they ended within the timeout."""
        deadline = time.monotonic() + timeout_s
        self._stopping.set()
        if self._responder.is_alive():
            self._responder.join(timeout_s)
        core = self._core
        if core is not None:
            core.close(max(0.5, deadline - time.monotonic()))
        return not self._responder.is_alive()

    close = stop

    # ---- the core process ---------------------------------------------------------------------------

    def _start_core(self) -> None:
        core = CoreClient(self.spec)
        try:
            ready = core.start(stopping=self._stopping)
        except BaseException:
            core.close()
            raise
        log.info("engine core process %d ready", ready.pid)
        with self._lock:
            self._core, self.info, self._unavailable = core, ready, None
        if self._on_core_start is not None:
            _safe(self._on_core_start, ready)

    def _on_core_death(self, core: CoreClient) -> None:
        """Fail everyone at once, then restart the core (bounded, with backoff) or give up: broken."""
        reason = f"the engine process died ({core.exit_reason}); restarting"
        log.error("%s (pid %s)", reason, core.pid)
        with self._lock:
            self._unavailable = reason
            active_requests, self._active = self._active, {}
        if self._on_unavailable is not None:
            _safe(self._on_unavailable, reason)
        for active in active_requests.values():
            active.fail(ErrorKind.UNAVAILABLE, reason)
        core.close()
        self._forget_core()
        self._publish()  # now: the restart below blocks this thread for the backoff and the model's load
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self._restart_window_s:
            self._deaths.popleft()
        failures = len(self._deaths)
        while not self._stopping.is_set():
            if failures > self._max_restarts:
                self._set_broken(
                    f"the engine process died {failures} times within {self._restart_window_s:.0f} s "
                    f"(last: {core.exit_reason})"
                )
                return
            if self._stopping.wait(self._restart_backoff_s * 2 ** (failures - 1)):
                return
            try:
                self._start_core()
                return
            except CoreError as e:
                log.error("restarting the engine process failed: %s", e)
                failures += 1

    def _forget_core(self) -> None:
        """A dead core holds nothing: its gauges go to idle (its counts were added up as they came)."""
        if self.scheduler_stats is not None:
            self.scheduler_stats = self.scheduler_stats.idle()

    def _set_broken(self, reason: str) -> None:
        if self._broken is not None:
            return
        log.error("the engine is broken: %s", reason)
        with self._lock:
            self._broken = reason
            active_requests, self._active = self._active, {}
        if self._on_unavailable is not None:
            _safe(self._on_unavailable, reason)
        for active in active_requests.values():
            active.fail(ErrorKind.UNAVAILABLE, f"the engine is unavailable: {reason}")
        if self._on_broken is not None:
            _safe(self._on_broken, reason)

    # ---- the responder thread -------------------------------------------------------------------------

    def _respond(self) -> None:
        # Each is_cancelled() is a round trip to tritonserver: poll as a step's message comes (the core aborts
        # only between steps), and on a timer only while none comes.
        cancel_after = cancel_by = next_metrics = time.monotonic()
        try:
            while not self._stopping.is_set():
                core = self._core
                timeout = max(0.0, min(cancel_by, next_metrics) - time.monotonic())
                messages = core.poll(timeout)
                items = self._read_core_messages(messages)
                try:
                    self._send_batch(items)
                except Exception:  # a bug here must not end the thread that answers everyone
                    log.error("delivering responses failed:\n%s", traceback.format_exc())
                    self._fail_items(items)
                if core.exit_reason is not None and self._broken is None:
                    self._on_core_death(core)
                now = time.monotonic()
                if now >= cancel_by or (messages and now >= cancel_after):
                    self._check_cancelled()
                    cancel_after, cancel_by = now + self._cancel_interval_s, now + self._cancel_max_interval_s
                if now >= next_metrics:
                    self._publish()
                    next_metrics = now + self._metrics_interval_s
        except BaseException:  # a bug in the loop itself: nobody may be left waiting
            log.error("the responder crashed:\n%s", traceback.format_exc())
            self._set_broken("the responder crashed; see the server log")
            raise
        finally:
            with self._lock:
                active_requests, self._active = self._active, {}
            for active in active_requests.values():
                active.fail(ErrorKind.UNAVAILABLE, "the model is shutting down")
            if not self._stopping.is_set():  # stopping: the model unloads, and no metric call may reach the server
                self._publish()

    def _read_core_messages(self, messages: list) -> list[tuple[_ActiveRequest, RequestOutput | Failure]]:
        """The core's messages -> (active, output or failure) in order; active_requests of finished requests leave."""
        items = []
        for message in messages:
            if isinstance(message, core_messages.StepOutputs):
                if message.iteration_stats is not None:
                    self.totals += message.iteration_stats
                    self._unpublished += message.iteration_stats
                if message.scheduler_stats is not None:
                    self.scheduler_stats = message.scheduler_stats
                    if _idle(self.scheduler_stats) != _idle(self._published):  # work began or ended: publish now
                        self._publish()
                items += self._detokenize(message.outputs)
            elif isinstance(message, core_messages.Broken):
                self._set_broken(message.reason)
        return items

    def _detokenize(self, outputs: list[core_messages.Output]) -> list[tuple[_ActiveRequest, RequestOutput | Failure]]:
        """One step's outputs through the output processor; a request it finished (a stop string) the core
        aborts, which frees its blocks. Outputs of requests that ended earlier (cancelled, failed, stopped) go."""
        live = [(active, out) for out in outputs if (active := self._active.get(out.request_id)) is not None]
        if not live:
            return []
        active_requests = [active for active, _ in live]
        outs = [out.to_request_output(active.prompt_token_ids) for active, out in live]
        try:
            processed = process_outputs([active.state for active in active_requests], outs)
        except Exception as e:  # a bug in the text work fails these requests, not the responder
            log.error("detokenizing failed:\n%s", traceback.format_exc())
            with self._lock:
                for active in active_requests:
                    self._active.pop(active.request_id, None)
                self._core.abort([out.request_id for out in outs if not out.finished])
            return [(active, (ErrorKind.INTERNAL, f"detokenizing failed: {e!r}", None)) for active in active_requests]
        items = []
        with self._lock:
            for out in processed.request_outputs:
                if out.finished:
                    self._active.pop(out.request_id, None)
            self._core.abort(processed.reqs_to_abort)
        for active, out in zip(active_requests, processed.request_outputs):
            if out.error is not None:
                items.append((active, (ErrorKind(out.error_kind), out.error, out.error_field)))
            else:
                items.append((active, out))
        return items

    def _fail_items(self, items: list) -> None:
        for active, item in items:
            if not active.ended and isinstance(item, RequestOutput) and not item.finished:
                self._abort(active)
            active.fail(ErrorKind.INTERNAL, "sending a response failed; see the log")

    def _send_batch(self, batch: list) -> None:
        """Send a batch of items, one response per request: its outputs merged, then any error."""
        pending: dict[int, tuple[_ActiveRequest, RequestOutput]] = {}
        for active, item in batch:
            if active.ended:
                continue
            key = id(active)  # active_requests in this batch are alive, so their ids are distinct
            if isinstance(item, RequestOutput):
                previous = pending.get(key)
                pending[key] = (active, merge_outputs(previous[1], item) if previous else item)
                continue
            if key in pending:  # an error after outputs: the outputs go first
                self._send(*pending.pop(key))
            active.fail(*item)
        for active, out in pending.values():
            if not active.ended:
                self._send(active, out)

    def _send(self, active: _ActiveRequest, out: RequestOutput) -> None:
        try:
            active.client.on_output(out)
        except Exception as e:
            # Final or not, the request must still end: answer it with an error (its last chance).
            log.error("sending a response failed:\n%s", traceback.format_exc())
            if not out.finished:
                self._abort(active)
            active.fail(ErrorKind.INTERNAL, f"sending a response failed: {e!r}")
            return
        if out.finished:
            active.ended = True

    def _abort(self, active: _ActiveRequest) -> None:
        with self._lock:
            if self._active.pop(active.request_id, None) is not None:
                self._core.abort([active.request_id])

    def _check_cancelled(self) -> None:
        cancelled = []
        for active in list(self._active.values()):
            if active.ended:
                continue
            try:
                gone = active.client.is_cancelled()
            except Exception:  # the sender is gone: nobody to answer, free the blocks
                gone = True
            if gone:
                cancelled.append(active.request_id)
                active.fail(ErrorKind.CANCELLED, "the request was cancelled")
        if cancelled:
            with self._lock:
                for request_id in cancelled:
                    self._active.pop(request_id, None)
                self._core.abort(cancelled)

    def _publish(self) -> None:
        state, counts = self.scheduler_stats, self._unpublished
        if self._on_iteration is None or state is None or (state is self._published and not counts):
            return
        self._published, self._unpublished = state, IterationStats()
        _safe(self._on_iteration, state, counts)


class _LoRAAdminClient:
    """Passes a LoRA admin request's answer on, and once the core did it, records it in the engine config every
    later core starts from."""

    def __init__(self, client: Client, request: core_messages.LoRAAdmin, config) -> None:
        self.client, self.request, self.config = client, request, config

    def is_cancelled(self) -> bool:
        return False  # the core does it between two steps: there is nothing to cancel

    def on_output(self, output: RequestOutput) -> None:
        if output.finished:
            modules = self.config.lora_modules
            if self.request.action == "load":
                modules[self.request.lora_name] = self.request.lora_path
            else:
                modules.pop(self.request.lora_name, None)
        self.client.on_output(output)

    def on_error(self, kind: ErrorKind, message: str, field: str | None = None) -> None:
        self.client.on_error(kind, message, field)


def _idle(state: SchedulerStats | None) -> bool:
    return state is None or (state.num_running == 0 and state.num_waiting == 0)


def _notify(client: Client, kind: ErrorKind, message: str, field: str | None = None) -> None:
    _safe(client.on_error, kind, message, field)


def _safe(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.error("ignored error in %s:\n%s", getattr(fn, "__name__", fn), traceback.format_exc())
