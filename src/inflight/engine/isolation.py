"""Failure isolation: when a step fails, find the sequences it fails on, so that one request's failure is its own.

Rows do not depend on their neighbours, so the other sequences' tokens are the ones the whole step would have
given. If both halves of the whole step fail too, the failure is the engine's, not a request's: it is raised at
once (three forwards, not 2N - 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from inflight.errors import EngineDeadError

if TYPE_CHECKING:
    from inflight.engine.scheduler import SchedulerOutput
    from inflight.engine.sequence import Sequence

logger = logging.getLogger(__name__)

R = TypeVar("R")


def run_isolating(
    sched: SchedulerOutput, run: Callable[[SchedulerOutput], R]
) -> tuple[list[tuple[SchedulerOutput, R]], list[tuple[Sequence, Exception]]]:
    """`run(sched)`, or, if it raises, `run` over halves of `sched` down to the sequences that fail alone.
    Returns (each part that ran, its result) and (each sequence that failed alone, its error). `run` must
    change no engine state before it returns."""
    try:
        return [(sched, run(sched))], []
    except EngineDeadError:  # the engine's death: nothing to isolate, no part can run
        raise
    except Exception as error:
        if len(sched.seqs) == 1:
            return [], [(sched.seqs[0], error)]
        logger.exception("a step of %d sequences failed; finding the one(s) it failed on", len(sched.seqs))
        first = error
    halves = _halves(sched)
    results = [_result_or_none(half, run) for half in halves]
    if results[0] is None and results[1] is None:
        raise first
    parts, failed = [], []
    for half, result in zip(halves, results):
        if result is not None:
            parts.append((half, result))
        else:
            p, f = _bisect(half, run)
            parts += p
            failed += f
    return parts, failed


def _bisect(sched: SchedulerOutput, run: Callable[[SchedulerOutput], R]) -> tuple[list, list]:
    try:
        return [(sched, run(sched))], []
    except Exception as error:
        if len(sched.seqs) == 1:
            return [], [(sched.seqs[0], error)]
    parts, failed = [], []
    for half in _halves(sched):
        p, f = _bisect(half, run)
        parts += p
        failed += f
    return parts, failed


def _halves(sched: SchedulerOutput) -> list[SchedulerOutput]:
    mid = len(sched.seqs) // 2
    return [sched.subset(0, mid), sched.subset(mid, len(sched.seqs))]


def _result_or_none(sched: SchedulerOutput, run: Callable[[SchedulerOutput], R]) -> R | None:
    try:
        return run(sched)
    except Exception:
        return None
