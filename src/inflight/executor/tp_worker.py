"""A tensor-parallel worker: rank 1..N-1 of a group whose rank 0 is the engine (executor/tensor_parallel.py).

A worker holds its shard of the weights and of the KV cache (models/parallel.py) and runs every step rank 0
sends it: the same forward over the whole batch, meeting the other ranks in the layers' all-reduces and the
logits' gather (rank 0 alone samples). Between steps it waits on its pipe from rank 0, not in a collective, so
an idle engine never runs into the group's timeout. It exits when rank 0 goes away (the pipe closes, or its
parent pid changes: checked every PARENT_POLL_S even inside a collective), when a collective fails (a peer is
gone), or when rank 0 tells it to stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from inflight.config import EngineConfig
from inflight.executor.attention import AttentionMetadata
from inflight.executor.shm_group import join_shm
from inflight.log import setup as log_setup
from inflight.models.parallel import TensorParallel

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
# A collective that waits this long has a peer that hangs (a dead one closes its sockets and fails it at once)
COLLECTIVE_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 900.0  # every rank loads its shard before the group forms


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is built from (pickled to the spawned process)."""

    model_dir: str
    config: EngineConfig
    dtype: torch.dtype
    size: int
    store_port: int  # rank 0's TCPStore, where the ranks meet
    num_threads: int  # torch threads per rank: the host's cores shared among the ranks
    parent_pid: int


@dataclass
class StepInputs:
    """One step as rank 0 sends it: host arrays (a small pickle), made tensors again on each rank's device."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    logit_rows: np.ndarray  # the forward's output rows whose logits rank 0 samples

    @classmethod
    def of(
        cls, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logit_rows: np.ndarray
    ) -> StepInputs:
        def host(t: torch.Tensor) -> np.ndarray:
            return t.cpu().numpy()

        return cls(
            host(input_ids),
            host(positions),
            host(meta.slot_mapping),
            host(meta.query_start_loc),
            host(meta.seq_lens),
            host(meta.block_tables),
            meta.query_start_loc_np,
            meta.seq_lens_np,
            logit_rows,
        )

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        def on_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        meta = AttentionMetadata(
            slot_mapping=on_device(self.slot_mapping),
            query_start_loc=on_device(self.query_start_loc),
            seq_lens=on_device(self.seq_lens),
            block_tables=on_device(self.block_tables),
            query_start_loc_np=self.query_start_loc_np,
            seq_lens_np=self.seq_lens_np,
        )
        return on_device(self.input_ids), on_device(self.positions), meta


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the engine's CPU, or the r-th GPU from the engine's (cuda:N -> cuda:N+r)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def join_group(store: dist.Store, rank: int, size: int, device: torch.device):
    """This rank's process group: NCCL between GPUs, gloo on CPUs; a collective fails after
    COLLECTIVE_TIMEOUT_S rather than hang. Made directly on the store, so no process-wide default group is
    touched (an offline process may build several engines)."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def connect(tp: TensorParallel, store: dist.Store, device: torch.device) -> None:
    """Join `tp`'s rank to its group: the process group, and on CPUs the shared-memory group the all-reduce and
    the gather run over (executor/shm_group.py; gloo where rank 0 cannot make one)."""
    tp.group = join_group(store, tp.rank, tp.size, device)
    if device.type == "cpu":
        tp.shm = join_shm(store, tp.rank, tp.size, tp.group, COLLECTIVE_TIMEOUT_S)


def run_worker(spec: WorkerSpec, rank: int, conn: Connection) -> None:
    """The worker's main (spawn target)."""
    log_setup(f"[tp{rank}]")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group: rank 0 stops us
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:  # `ps` and `top` show the rank
        comm.write(f"inflight-tp{rank}")
    threading.Thread(target=_exit_when_orphaned, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    try:
        runner, device = _start(spec, rank, conn)
    except BaseException:
        log.error("tensor-parallel rank %d could not start:\n%s", rank, traceback.format_exc())
        with contextlib.suppress(OSError):
            conn.send(("failed", traceback.format_exc(limit=3)))
        os._exit(1)
    try:
        _serve(runner, device, conn)
    except EOFError:  # rank 0 closed the pipe without a word: it is gone
        os._exit(0)
    except BaseException:
        log.error("tensor-parallel rank %d failed; it exits:\n%s", rank, traceback.format_exc())
        os._exit(1)
    os._exit(0)  # told to stop; nothing of the group's is worth a clean teardown


def _start(spec: WorkerSpec, rank: int, conn: Connection):
    from inflight.executor.model_runner import ModelRunner
    from inflight.models.loader import load_model

    device = rank_device(spec.config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = TensorParallel(rank, spec.size)
    model, _ = load_model(spec.model_dir, spec.dtype, device, spec.config.weight_format, tp)
    conn.send(("loaded", None))
    timeout = timedelta(seconds=STARTUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, False, timeout=timeout)
    connect(tp, store, device)
    runner_args = conn.recv()
    runner = ModelRunner(model, **runner_args, dtype=spec.dtype, device=device, num_threads=spec.num_threads)
    conn.send(("ready", None))
    return runner, device


@torch.inference_mode()
def _serve(runner, device: torch.device, conn: Connection) -> None:
    while True:
        step: StepInputs | None = pickle.loads(conn.recv_bytes())
        if step is None:
            return
        input_ids, positions, meta = step.tensors(device)
        runner.run_model(input_ids, positions, meta, step.logit_rows)  # its logits go to rank 0


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)
