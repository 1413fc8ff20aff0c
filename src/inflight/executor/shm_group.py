"""The collectives of CPU tensor-parallel ranks on one host through one shared-memory segment, in place of gloo's
loopback sockets: the all-reduce (every rank adds all ranks' values in rank order, so all hold the same bits)
and the logits' gather to rank 0, both C++ ops (csrc/cpu/shm.h lays the segment out).

Rank 0 creates the segment in /dev/shm once the process group has formed and publishes its name in the group's
store; the other ranks map it, and once every rank has (a barrier of the process group) rank 0 unlinks it, so
nothing is left in /dev/shm whatever later ends the ranks. A rank 0 killed before that barrier leaves its segment
behind: the next rank 0 removes the segments of processes that are gone (`remove_orphans`). A rank that does not
arrive within the timeout fails the collective on the others; `abort` fails every rank's at once (rank 0 calls it
when it sees a rank die).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from pathlib import Path

import torch

from inflight.ops import cpu

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # a rank's slot in each of two banks; a larger tensor goes through in slot-sized chunks
STORE_KEY = "inflight/shm_segment"
SEGMENT_PREFIX = "inflight-tp-"  # then rank 0's pid and a random suffix
OFF_VARIABLE = "INFLIGHT_TP_SHM"  # "0": the CPU ranks keep gloo
_LINE = 64  # one flag word a cache line


class ShmGroup:
    """One rank's mapping of its group's segment: an int64 [size + 1, 8] flag table (the abort word, each rank's
    last round) and two banks of one slot per rank, uint8 [2, size, slot_bytes]."""

    def __init__(
        self, path: Path, rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES, create: bool = False
    ) -> None:
        self.path, self.rank, self.size, self.timeout_s = path, rank, size, timeout_s
        header = -(-_LINE * (size + 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        nbytes = header + 2 * size * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # every page allocated now: a full /dev/shm fails here, not with SIGBUS in a step
                os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.flags = buffer[: _LINE * (size + 1)].view(torch.int64).view(size + 1, _LINE // 8)
        self.slots = buffer[header:].view(2, size, slot_bytes)

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether `all_reduce` takes `x` (others go through the process group)."""
        return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` summed, in place, in rank order (fp32 sums, bf16 rounded once)."""
        if x.is_contiguous():
            cpu.shm_all_reduce(x, self.flags, self.slots, self.rank, self.timeout_s)
        else:
            y = x.contiguous()
            cpu.shm_all_reduce(y, self.flags, self.slots, self.rank, self.timeout_s)
            x.copy_(y)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[size, *x.shape] on rank 0, every rank's `x` in rank order; None on the other ranks."""
        x = x.contiguous()
        out = x.new_empty((self.size, *x.shape)) if self.rank == 0 else None
        cpu.shm_gather(out, x, self.flags, self.slots, self.rank, self.timeout_s)
        return out

    def abort(self) -> None:
        """Fail every rank's collective, now and from now on (a rank is gone: the others must not wait for it)."""
        self.flags[0, 0] = 1


def remove_orphans(directory: Path = SHM_DIR) -> list[Path]:
    """Unlinks the segments whose creator (the pid in the name) is no longer running; returns them."""
    removed = []
    for path in directory.glob(f"{SEGMENT_PREFIX}*"):
        pid = path.name[len(SEGMENT_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def join_shm(store, rank: int, size: int, group, timeout_s: float, enabled: bool = True) -> ShmGroup | None:
    """This rank's ShmGroup, or None where the ranks keep the process group: rank 0 decides (`enabled`,
    INFLIGHT_TP_SHM not "0", the C++ ops built, room in /dev/shm) and the others follow. Every rank calls it
    once the CPU process group `group` has formed."""
    shm = None
    if rank == 0:
        if enabled and os.environ.get(OFF_VARIABLE) != "0" and cpu.available():
            for orphan in remove_orphans():
                log.info("tensor parallel: removed %s, left by a rank 0 that is gone", orphan)
            path = SHM_DIR / f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                shm = ShmGroup(path, 0, size, timeout_s, create=True)
            except OSError as e:
                log.warning("tensor parallel: no shared-memory segment (%s); the ranks all-reduce over gloo", e)
                path.unlink(missing_ok=True)
        store.set(STORE_KEY, str(shm.path) if shm else "")
        try:
            group.barrier().wait()  # every rank has mapped it
        finally:
            if shm:
                shm.path.unlink(missing_ok=True)
    else:
        path = store.get(STORE_KEY).decode()
        shm = ShmGroup(Path(path), rank, size, timeout_s) if path else None
        group.barrier().wait()
    if rank == 0:
        log.info("tensor parallel: collectives over %s", "shared memory" if shm else "gloo")
    return shm
