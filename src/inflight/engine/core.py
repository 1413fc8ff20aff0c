"""The engine core process: an LLMEngine in a busy loop, and nothing that talks to clients.

Started by `core_client.CoreClient` (spawn). The loop takes what the front sent (new requests, aborts) —
without waiting while there is work, blocking when idle — runs one `engine.step()`, and sends ONE
message with every request's outputs of that step (and the engine's stats at most every STATS_INTERVAL_S,
and once more when the engine goes idle: its state, and its counts since the stats sent before). The
engine's outputs are token ids (with logprobs and the finishes max_tokens,
EOS, stop tokens and grammars make); text and stop strings are the front's, which aborts a request a stop
string ended. A step that fails fails the requests in flight; an engine that cannot recover says `Broken`
and answers every later request with an error. The core exits when its parent (Triton's stub) goes away:
it checks its parent pid every iteration and while it waits (PR_SET_PDEATHSIG would fire when the *thread*
that started it ends, and a restart starts it from the responder thread). With tensor parallelism the core is
rank 0 and its worker ranks are its children: a rank that dies is the core's death (it exits at once, and the
front restarts it with new ranks); the ranks exit when the core does.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass

import msgspec
import zmq

from inflight.config import EngineConfig
from inflight.engine import core_messages
from inflight.engine.stats import EngineSnapshot, IterationStats, SchedulerStats
from inflight.errors import EngineDeadError, ErrorKind, InvalidRequestError
from inflight.log import setup as log_setup
from inflight.lora_request import LoRARequest

log = logging.getLogger("inflight.engine.core")

STATS_INTERVAL_S = 0.25
IDLE_POLL_MS = 500  # an idle core wakes this often to check that its parent is alive


@dataclass(frozen=True)
class CoreSpec:
    """What a core process is built from (pickled to the child). `engine_class` is "module:Class": tests
    name an LLMEngine subclass with injected faults."""

    model_dir: str
    config: EngineConfig
    engine_class: str = "inflight.engine.engine:LLMEngine"
    step_log: str | None = None
    num_threads: int | None = None  # torch threads; None: every core this process may run on


def run_core(spec: CoreSpec, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """The child's main (spawn target)."""
    log_setup("[core]")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group: the front stops us
    ctx = zmq.Context(io_threads=1)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, IDLE_POLL_MS)
    outbox.bind(output_addr)
    try:
        core = EngineCore(spec, inbox, outbox, parent_pid)
    except BaseException:
        log.error("the engine core could not start:\n%s", traceback.format_exc())
        raise
    core.run()


class EngineCore:
    def __init__(self, spec: CoreSpec, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        import torch

        from inflight.models.loader import release_load_memory

        # Placement: the core's forward takes every core it may run on; the front (Triton's stub) only waits
        # on sockets and Triton's I/O, and OMP_WAIT_POLICY=PASSIVE lets it take a core back when it needs one.
        torch.set_num_threads(spec.num_threads or len(os.sched_getaffinity(0)))
        module, _, name = spec.engine_class.partition(":")
        engine_cls = getattr(importlib.import_module(module), name)
        self.engine = engine_cls(spec.model_dir, spec.config)  # token ids out: the front detokenizes
        self.engine.on_rank_failure(self.rank_failed)
        release_load_memory()
        started = time.monotonic()
        calls = self.engine.warm_up()  # the core's resident size is then what the engine holds while serving
        log.info("warmed up in %.1f s (%d calls)", time.monotonic() - started, calls)
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(core_messages.ToCore)
        self.active: set[str] = set()
        self.broken: str | None = None
        self.step_log = open(spec.step_log, "a", buffering=1) if spec.step_log else None  # noqa: SIM115
        self.next_stats = 0.0
        self.max_spread = 0.0  # stats skip steps: the largest arrival spread is kept here
        self.stats_sent = False  # the engine's latest state has gone out
        self.counted: EngineSnapshot | None = None  # the snapshot whose counts went out last
        engine = self.engine
        self.send(
            core_messages.Ready(
                pid=os.getpid(),
                max_model_len=engine.max_model_len,
                max_prompt_bytes=engine.max_prompt_bytes,
                num_kv_blocks=engine.num_kv_blocks,
                block_size=engine.config.block_size,
                vocab_size=engine.model_config.vocab_size,
                dtype=str(engine.dtype).removeprefix("torch."),
                model_weight_bytes=engine.model_weight_bytes,
                lora_names=engine.list_loras(),
                max_loras=engine.config.max_loras if engine.lora is not None else 0,
            )
        )
        log.info("engine core ready (pid %d)", os.getpid())
        self.publish([])  # the new engine's state, before any work

    def send(self, message) -> None:
        data = self.encoder.encode(message)
        while True:  # a bound PUSH with no peer blocks: never wait on a front that is gone
            try:
                self.outbox.send(data, copy=False)
                return
            except zmq.Again:
                self.exit_if_orphaned()

    def rank_failed(self, reason: str) -> None:
        """A tensor-parallel rank died (or the ranks fell out of step): the core exits, its front restarts it."""
        log.error("%s; the engine core exits", reason)
        os._exit(1)

    def exit_if_orphaned(self) -> None:
        if os.getppid() != self.parent_pid:  # the stub died (we were re-parented): nobody to serve
            log.error("the front (pid %d) is gone; the engine core exits", self.parent_pid)
            os._exit(0)

    def run(self) -> None:
        while True:
            self.exit_if_orphaned()
            busy = self.broken is None and self.engine.has_unfinished_requests()
            outputs = self.take_inputs(block=not busy)
            if self.broken is None and self.engine.has_unfinished_requests():
                outputs += self.step()
            self.publish(outputs)

    def take_inputs(self, block: bool) -> list[core_messages.Output]:
        """Everything the front sent so far; when idle, wait for the first message (checking on the parent)."""
        answers: list[core_messages.Output] = []
        while block and not self.inbox.poll(IDLE_POLL_MS):
            self.exit_if_orphaned()
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return answers
            message = self.decoder.decode(frame.buffer)
            if isinstance(message, core_messages.Abort):
                for request_id in message.request_ids:
                    if request_id in self.active:
                        self.active.discard(request_id)
                        self.engine.abort_request(request_id)  # frees its KV blocks now
            elif isinstance(message, core_messages.LoRAAdmin):
                answers.append(self.lora_admin(message))
            else:
                answer = self.add(message)
                if answer is not None:
                    answers.append(answer)
            self.stats_sent = False

    def add(self, req: core_messages.AddRequest) -> core_messages.Output | None:
        if self.broken is not None:
            message = f"the engine is unavailable: {self.broken}"
            return core_messages.Output.failure(req.request_id, ErrorKind.UNAVAILABLE, message)
        try:
            params = req.sampling_params()
            lora = LoRARequest(req.lora_name) if req.lora_name is not None else None
            self.engine.add_request(
                req.request_id, req.prompt_token_ids, params, req.arrival_time, req.priority, lora_request=lora
            )
        except InvalidRequestError as e:
            return core_messages.Output.failure(req.request_id, e.kind, str(e), e.field)
        except Exception as e:
            log.error("add_request failed:\n%s", traceback.format_exc())
            message = f"the engine could not take the request: {e!r}"
            return core_messages.Output.failure(req.request_id, ErrorKind.INTERNAL, message)
        self.active.add(req.request_id)
        return None

    def lora_admin(self, req: core_messages.LoRAAdmin) -> core_messages.Output:
        """Load or unload an adapter between steps; the answer finishes the admin request's id."""
        try:
            if req.action == "load":
                self.engine.add_lora(LoRARequest(req.lora_name, lora_path=req.lora_path))
            elif req.action == "unload":
                self.engine.remove_lora(req.lora_name)
            else:
                raise InvalidRequestError(f"action={req.action!r} is invalid: must be load or unload", "action")
        except InvalidRequestError as e:
            return core_messages.Output.failure(req.request_id, e.kind, str(e), e.field)
        log.info("LoRA adapter %r %sed", req.lora_name, req.action)
        return core_messages.Output(req.request_id, [], finished=True, finish_reason="stop")

    def step(self) -> list[core_messages.Output]:
        steps_before = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:
            self.rank_failed(str(e))
        except Exception as e:
            return self.recover(e)
        self.stats_sent = False
        stats = self.engine.last_step_stats
        if stats is not None and self.engine.num_steps != steps_before:
            self.max_spread = max(self.max_spread, stats.arrival_spread_s)
            if self.step_log is not None:
                self.log_step()
        sent = []
        for out in outputs:
            if out.request_id not in self.active:  # the echo of an abort the front asked for
                continue
            if out.finished:
                self.active.discard(out.request_id)
            sent.append(core_messages.Output.of(out))
        return sent

    def recover(self, error: Exception) -> list[core_messages.Output]:
        """A step failed: fail every request in flight, then try to bring the engine back to empty."""
        log.error("engine step failed:\n%s", traceback.format_exc())
        message = f"the engine failed while running this request: {error!r}"
        failed = [core_messages.Output.failure(r, ErrorKind.INTERNAL, message) for r in self.active]
        active, self.active = self.active, set()
        try:
            for request_id in active:
                self.engine.abort_request(request_id)
            for _ in range(3):  # the abort outputs come back from the next step
                if not self.engine.has_unfinished_requests():
                    return failed
                self.engine.step()
            raise RuntimeError("requests still unfinished after aborting all of them")
        except Exception as e:
            log.error("engine could not recover; refusing new requests:\n%s", traceback.format_exc())
            self.broken = f"it failed and could not recover ({e!r}; first failure: {error!r})"
            self.publish(failed)
            self.send(core_messages.Broken(self.broken))
            return []

    def publish(self, outputs: list[core_messages.Output]) -> None:
        """One message for the step: its outputs, and the stats when due (or when the engine went idle)."""
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        if not self.stats_sent and (now >= self.next_stats or idle):
            snapshot = self.engine.snapshot()
            state = SchedulerStats.of(snapshot, self.max_spread)
            counts = IterationStats.between(self.counted, snapshot)
            self.counted = snapshot
            self.next_stats = now + STATS_INTERVAL_S
            self.stats_sent = True
            self.send(core_messages.StepOutputs(outputs, state, counts))
        elif outputs:
            self.send(core_messages.StepOutputs(outputs))

    def log_step(self) -> None:
        stats = self.engine.last_step_stats
        if stats is not None:
            record = dataclasses.asdict(stats) | {"wall_time": time.time()}
            self.step_log.write(json.dumps(record) + "\n")
