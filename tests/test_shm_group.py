"""The shared-memory collectives of CPU tensor-parallel ranks (executor/shm_group.py, csrc/cpu/shm*.cpp), run by
2 and 3 spawned processes: the all-reduce equals the ranks' values added in rank order in fp32 (bf16 rounded
once), bit for bit on every rank, for tensors of 0 elements to several slots, many rounds back to back, with the
gather to rank 0 between them; a rank that never arrives fails the others' call at their timeout, and an abort
fails a call that waits. The engine over two ranks: tests/test_tensor_parallel.py."""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.executor.shm_group import SEGMENT_PREFIX, SHM_DIR, ShmGroup, join_shm, remove_orphans
from inflight.ops import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the shared-memory collectives are C++ ops")

SLOT_BYTES = 4096  # small slots: most sizes below go through in several chunks
TIMEOUT_S = 30.0  # a hang fails the test instead of stalling it
# (numel, dtype): empty, under a slot, exactly one fp32 slot, several slots with a tail, bf16 ones
SIZES = [(0, torch.float32), (1, torch.float32), (576, torch.float32), (1024, torch.float32),
         (5000, torch.float32), (3 * 576 * 2 + 7, torch.float32), (1, torch.bfloat16), (2048, torch.bfloat16),
         (9000, torch.bfloat16)]  # fmt: skip
ROUNDS = 60  # back-to-back calls over the sizes above, gathers among them


def rank_input(case: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s tensor in call `case`: magnitudes from 1e-3 to 1e3, so the order of the sum shows."""
    gen = torch.Generator().manual_seed(1000 * case + rank)
    scale = 10.0 ** torch.randint(-3, 4, (numel,), generator=gen)
    return (torch.randn(numel, generator=gen) * scale).to(dtype)


def in_rank_order(case: int, size: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The expected all-reduce: the ranks' values added left to right in fp32, rounded once to `dtype`."""
    total = rank_input(case, 0, numel, dtype).float()
    for rank in range(1, size):
        total = total + rank_input(case, rank, numel, dtype).float()
    return total.to(dtype)


def bits(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # an empty view may keep its strides through contiguous()
    return dense.view(torch.uint8).numpy().tobytes()


def run_rank(path: str, rank: int, size: int, conn) -> None:
    """A rank's calls (spawn target): each call's result as bytes, or the error's traceback."""
    try:
        shm = ShmGroup(Path(path), rank, size, TIMEOUT_S, slot_bytes=SLOT_BYTES)
        results = []
        for case in range(ROUNDS):
            numel, dtype = SIZES[case % len(SIZES)]
            x = rank_input(case, rank, numel, dtype)
            if case % 7 == 3:  # a gather: rank 0 receives every rank's tensor in rank order
                out = shm.gather(x.view(-1, 1) if numel else x)
                results.append(None if out is None else bits(out))
            elif case % 5 == 4:  # a non-contiguous view is reduced in place too
                wide = torch.zeros(numel, 2, dtype=dtype)
                wide[:, 0] = x
                shm.all_reduce(wide[:, 0])
                results.append(bits(wide[:, 0]) + bits(wide[:, 1]))
            else:
                results.append(bits(shm.all_reduce(x)))
        conn.send(("ok", results))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_ranks(size: int) -> list[list[bytes | None]]:
    """Every rank's results, from `size` spawned processes over one segment."""
    path = SHM_DIR / f"inflight-test-{size}-{np.random.randint(1 << 30)}"
    ShmGroup(path, 0, size, TIMEOUT_S, slot_bytes=SLOT_BYTES, create=True)
    ctx = multiprocessing.get_context("spawn")
    try:
        pipes = [ctx.Pipe() for _ in range(size)]
        procs = [ctx.Process(target=run_rank, args=(str(path), r, size, pipes[r][1]), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        replies = [pipes[r][0].recv() for r in range(size)]
        for p in procs:
            p.join(TIMEOUT_S)
    finally:
        path.unlink(missing_ok=True)
    for rank, (kind, detail) in enumerate(replies):
        assert kind == "ok", f"rank {rank} failed:\n{detail}"
    return [detail for _, detail in replies]


@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_is_the_sum_in_rank_order_bit_for_bit_on_every_rank(size):
    results = run_ranks(size)
    for case in range(ROUNDS):
        numel, dtype = SIZES[case % len(SIZES)]
        if case % 7 == 3:
            expected = bits(torch.stack([rank_input(case, r, numel, dtype) for r in range(size)]))
            assert results[0][case] == expected, f"gather {case}: {numel} {dtype}"
            assert all(results[r][case] is None for r in range(1, size))
            continue
        expected = bits(in_rank_order(case, size, numel, dtype))
        if case % 5 == 4:
            expected += bits(torch.zeros(numel, dtype=dtype))  # the view's neighbours are untouched
        for rank in range(size):
            assert results[rank][case] == expected, f"call {case} ({numel} {dtype}) on rank {rank}"


def test_the_order_of_three_ranks_sum_shows_in_the_bits():
    # What the exact comparison above can catch: another order of three ranks' sum gives other bits
    x = [rank_input(5, r, 5000, torch.float32) for r in range(3)]
    assert not torch.equal((x[0] + x[1]) + x[2], x[0] + (x[1] + x[2]))
    assert not torch.equal((x[0] + x[1]) + x[2], (x[2] + x[1]) + x[0])


def test_a_rank_that_never_arrives_fails_the_call_at_the_timeout(tmp_path):
    shm = ShmGroup(tmp_path / "segment", 0, 2, 0.3, slot_bytes=SLOT_BYTES, create=True)
    with pytest.raises(RuntimeError, match="rank 1 did not reach round 1 within 0.3 s"):
        shm.all_reduce(torch.ones(8))
    with pytest.raises(RuntimeError, match="rank 1 did not reach round 2"):
        shm.gather(torch.ones(8))


def test_an_abort_fails_a_waiting_call_and_every_later_one(tmp_path):
    shm = ShmGroup(tmp_path / "segment", 1, 3, TIMEOUT_S, slot_bytes=SLOT_BYTES, create=True)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            shm.all_reduce(torch.ones(8))
        except RuntimeError as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()  # the call waits for ranks 0 and 2, which never come
    waiter.join(0.2)
    assert waiter.is_alive() and not errors
    shm.abort()
    waiter.join(TIMEOUT_S / 2)
    assert not waiter.is_alive(), "the abort did not end the waiting call"
    assert len(errors) == 1 and "aborted" in str(errors[0])
    with pytest.raises(RuntimeError, match="aborted"):
        shm.all_reduce(torch.ones(8, dtype=torch.bfloat16))


def test_only_float32_and_bfloat16_go_through_shared_memory(tmp_path):
    assert ShmGroup.supports(torch.ones(2)) and ShmGroup.supports(torch.ones(2, dtype=torch.bfloat16))
    assert not ShmGroup.supports(torch.ones(2, dtype=torch.float16))
    assert not ShmGroup.supports(torch.ones(2, dtype=torch.int64))


class _Barrier:
    """A process group's barrier for threads of one process."""

    def __init__(self, parties: int) -> None:
        self.parties = threading.Barrier(parties)

    def barrier(self):
        self.parties.wait(TIMEOUT_S)
        return self

    def wait(self) -> None:
        pass


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.set_once = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.values[key] = value
        self.set_once.set()

    def get(self, key: str) -> bytes:
        self.set_once.wait(TIMEOUT_S)
        return self.values[key].encode()


@pytest.mark.parametrize("enabled", [True, False])
def test_join_unlinks_the_segment_once_every_rank_has_mapped_it(enabled):
    before = set(SHM_DIR.glob("inflight-tp-*"))
    store, group = _Store(), _Barrier(3)
    shms: list[ShmGroup | None] = [None] * 3

    def join(rank: int) -> None:
        shms[rank] = join_shm(store, rank, 3, group, TIMEOUT_S, enabled=enabled)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert set(SHM_DIR.glob("inflight-tp-*")) <= before, "a segment was left in /dev/shm"
    if not enabled:
        assert shms == [None] * 3 and store.values
        return
    assert all(s is not None for s in shms)
    # The unlinked segment still joins the ranks: three threads all-reduce over it
    outs = [None] * 3

    def reduce(rank: int) -> None:
        outs[rank] = shms[rank].all_reduce(torch.full((3,), float(rank + 1)))

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert all(torch.equal(o, torch.full((3,), 6.0)) for o in outs)


def test_a_segment_whose_rank_0_is_gone_is_removed_by_the_next(tmp_path):
    """A rank 0 killed before its barrier leaves its segment in /dev/shm; the next rank 0 removes it (and leaves a
    living process's segment alone)."""
    gone = multiprocessing.get_context("spawn").Process(target=int)
    gone.start()
    gone.join()
    orphan = tmp_path / f"{SEGMENT_PREFIX}{gone.pid}-0a1b2c3d"
    alive = tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}-0a1b2c3d"
    other = tmp_path / "not-ours-1"
    for path in (orphan, alive, other):
        path.write_bytes(b"x")
    assert remove_orphans(tmp_path) == [orphan]
    assert not orphan.exists() and alive.exists() and other.exists()
