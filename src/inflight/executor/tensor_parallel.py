"""Rank 0's side of a tensor-parallel group: the engine's process starts ranks 1..N-1 as worker processes
(executor/tp_worker.py, spawned), forms the process group with them, sends them every step's inputs, and watches
them. A rank that dies (or a step that fails once the workers have its inputs: the ranks are then out of step)
is the engine's death: `EngineDeadError` from the next step, and `on_failure` called at once from the watching
thread (the engine core exits there, and its supervisor restarts every rank).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from inflight.config import ConfigError, EngineConfig
from inflight.errors import EngineDeadError
from inflight.executor.attention import AttentionMetadata
from inflight.executor.tp_worker import (
    STARTUP_TIMEOUT_S,
    StepInputs,
    WorkerSpec,
    connect,
    rank_device,
    run_worker,
)
from inflight.models.parallel import TensorParallel

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
R = TypeVar("R")


class TensorParallelWorkers:
    """Ranks 1..N-1 as seen from rank 0; `tp` is rank 0's place in the group (its model is built with it)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, dtype: torch.dtype) -> None:
        """Start ranks 1..N-1 loading their shards (rank 0 loads its own meanwhile, then calls `join`)."""
        size = config.tensor_parallel_size
        self.tp = TensorParallel(0, size)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and torch.cuda.device_count() < rank_device(config.device, size - 1).index + 1:
            raise ConfigError(
                f"tensor_parallel_size={size} from device={config.device!r} needs {size} GPUs from there; "
                f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)"
            )
        # The ranks' share of this host's cores (one thread each for two ranks on two cores)
        self.num_threads = max(1, len(os.sched_getaffinity(0)) // size)
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._closing = False
        timeout = timedelta(seconds=STARTUP_TIMEOUT_S)
        self.store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        spec = WorkerSpec(str(model_dir), config, dtype, size, self.store.port, self.num_threads, os.getpid())
        ctx = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        # Stopped with the engine, or when it is dropped without close() (a failed start)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=run_worker, args=(spec, rank, theirs), name=f"inflight-tp{rank}", daemon=True)
            process.start()
            theirs.close()  # the worker's end lives in the worker only: its death closes the pipe
            self.processes.append(process)
            self.conns.append(ours)
        log.info("tensor parallel: %d ranks, %d thread(s) each; workers %s", size, self.num_threads,
                 [p.pid for p in self.processes])  # fmt: skip

    # ---- start ------------------------------------------------------------------------------------------

    def join(self) -> None:
        """Once rank 0's shard is loaded: wait for the workers' shards, then form the process group."""
        self._expect("loaded")
        connect(self.tp, self.store, self.device)

    def start_runners(self, runner_args: dict[str, Any]) -> None:
        """The workers build their model runners as rank 0 did (`runner_args`: ModelRunner's sizes); then the watch
        on them starts."""
        for conn in self.conns:
            conn.send(runner_args)
        self._expect("ready")
        threading.Thread(target=self._watch, name="inflight-tp-watch", daemon=True).start()

    def _expect(self, what: str) -> None:
        """Every worker's `what` message; EngineDeadError naming the first that fails or dies instead."""
        waiting = dict(zip(self.conns, range(1, self.tp.size)))
        while waiting:
            sentinels = [self.processes[rank - 1].sentinel for rank in waiting.values()]
            ready = multiprocessing.connection.wait([*waiting, *sentinels], STARTUP_TIMEOUT_S)
            if not ready:
                raise self._fail(f"tensor-parallel workers did not report {what!r} within {STARTUP_TIMEOUT_S:.0f} s")
            for conn, rank in list(waiting.items()):
                if conn not in ready and self.processes[rank - 1].sentinel not in ready:
                    continue
                kind, detail = None, None
                with contextlib.suppress(EOFError, OSError):
                    if conn.poll():
                        kind, detail = conn.recv()
                if kind == what:
                    del waiting[conn]
                elif kind is None:
                    raise self._fail(f"tensor-parallel rank {rank} {self._exit_of(rank)} while starting")
                else:
                    raise self._fail(f"tensor-parallel rank {rank} failed to start: {detail}")

    # ---- steps ------------------------------------------------------------------------------------------

    def run(
        self,
        run_model: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray], R],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: np.ndarray,
    ) -> R:
        """Send the step to every worker, then run rank 0's part of it. Past the send, any failure leaves the ranks
        out of step (a worker may wait in a collective rank 0 will never join): the group is dead."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        data = pickle.dumps(StepInputs.of(input_ids, positions, meta, logit_rows), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
            return run_model(input_ids, positions, meta, logit_rows)
        except Exception as e:
            # A collective fails as soon as a peer's sockets close: give its process a moment to be reaped
            multiprocessing.connection.wait([p.sentinel for p in self.processes], 0.5)
            dead = next((r for r, p in enumerate(self.processes, 1) if p.exitcode is not None), None)
            why = f"tensor-parallel rank {dead} {self._exit_of(dead)}" if dead else "a step failed on rank 0"
            raise self._fail(f"{why} ({e!r})") from e

    # ---- failure and stop -------------------------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        rank = sentinels[multiprocessing.connection.wait(list(sentinels))[0]]
        if self._closing:
            return
        error = self._fail(f"tensor-parallel rank {rank} {self._exit_of(rank)}")
        if self.on_failure is not None:
            self.on_failure(str(error))

    def _fail(self, reason: str) -> EngineDeadError:
        """Mark the group dead (the first reason stays) and end every worker: none is left waiting on a peer."""
        if self.failure is None:
            self.failure = reason
            log.error("%s", reason)
        self._closing = True
        if self.tp.shm is not None:  # rank 0's collective in flight, if any, fails now rather than at its timeout
            self.tp.shm.abort()
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        return EngineDeadError(self.failure)

    def _exit_of(self, rank: int) -> str:
        process = self.processes[rank - 1]
        process.join(0.5)  # a process whose pipe closed may still be exiting
        code = process.exitcode
        if code is None:
            return f"(pid {process.pid}) stopped answering"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"(pid {process.pid}) was killed by signal {signal.Signals(-code).name}"
        return f"(pid {process.pid}) exited with code {code}"

    def close(self) -> None:
        """Stop every worker (told to, then terminated, then killed). Idempotent."""
        self._closing = True
        self._finalizer()


def _stop(processes: list[multiprocessing.Process], conns: list[multiprocessing.connection.Connection]) -> None:
    stop = pickle.dumps(None)
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(stop)
    for process in processes:
        process.join(STOP_TIMEOUT_S)
        if process.exitcode is None:
            process.terminate()
            process.join(STOP_TIMEOUT_S)
        if process.exitcode is None:
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
