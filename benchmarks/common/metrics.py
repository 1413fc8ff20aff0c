"""What one benchmark run records, and the figures the report derives from it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import psutil

PERCENTILES = (50, 90, 99)


@dataclass
class StepRecord:
    t: float  # seconds since the run started, at the end of the step
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_scheduled_tokens: int
    step_time_s: float
    forward_time_s: float
    num_kv_blocks_cached: int = 0  # free blocks still holding a reusable prefix


@dataclass
class RunResult:
    name: str
    output_tokens: int  # useful tokens: what the requests asked for, never padding
    wall_s: float  # first arrival to last completion
    ttft_s: list[float]  # per request, from its arrival
    latency_s: list[float]  # per request, arrival to last token
    max_num_seqs: int
    steps: list[StepRecord] = field(default_factory=list)  # empty for systems we cannot instrument per step
    num_kv_blocks_total: int | None = None
    num_preemptions: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    contention: float | None = None  # share of the machine's CPU other processes used during the run
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache during the run
    prefix_cache_hits: int = 0  # of those, tokens served from the cache

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    arr = np.asarray(values, dtype=float)
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}


def occupancy(steps: list[StepRecord], max_num_seqs: int, queued_only: bool = True) -> float | None:
    """Mean over steps of running ÷ max_num_seqs; `queued_only`: only steps that left requests waiting,
    where an idle slot is lost throughput rather than a lack of work."""
    rows = [s.num_running / max_num_seqs for s in steps if s.num_waiting > 0 or not queued_only]
    return float(np.mean(rows)) if rows else None


def overhead_share(steps: list[StepRecord], min_running: int = 0) -> float | None:
    """Time outside the model forward ÷ step time, over steps running at least `min_running` sequences."""
    rows = [s for s in steps if s.num_running >= min_running]
    total = sum(s.step_time_s for s in rows)
    if not rows or total <= 0:
        return None
    return 1.0 - sum(s.forward_time_s for s in rows) / total


def fit_step_cost(steps: list[StepRecord]) -> tuple[float, float] | None:
    """Least-squares `step_time = fixed + per_seq × running` over pure decode steps (one token per sequence)."""
    rows = [(s.num_running, s.step_time_s) for s in steps if s.num_scheduled_tokens == s.num_running]
    if len({n for n, _ in rows}) < 2:
        return None
    per_seq, fixed = np.polyfit([n for n, _ in rows], [t for _, t in rows], 1)
    return float(fixed), float(per_seq)


def overhead_ms(steps: list[StepRecord], min_running: int = 0) -> float | None:
    """Mean time per step outside the model forward, in ms: the absolute cost behind `overhead_share`."""
    rows = [s.step_time_s - s.forward_time_s for s in steps if s.num_running >= min_running]
    return 1000 * float(np.mean(rows)) if rows else None


def summarize(run: RunResult) -> dict[str, Any]:
    steps = run.steps
    out: dict[str, Any] = {
        "name": run.name,
        "output_tokens": run.output_tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": run.tokens_per_s,
        "ttft_s": percentiles(run.ttft_s),
        "latency_s": percentiles(run.latency_s),
        "num_requests": len(run.latency_s),
        "contention": run.contention,
        "prefix_cache_hit_rate": run.prefix_cache_hit_rate,
        "note": run.note,
    }
    if steps:
        out |= {
            "num_steps": len(steps),
            "occupancy_while_queued": occupancy(steps, run.max_num_seqs),
            "occupancy_mean": occupancy(steps, run.max_num_seqs, queued_only=False),
            "peak_running": max(s.num_running for s in steps),
            "peak_kv_blocks": max(s.num_kv_blocks_used for s in steps),
            "peak_kv_blocks_cached": max(s.num_kv_blocks_cached for s in steps),
            "kv_blocks_total": run.num_kv_blocks_total,
            "preemptions": run.num_preemptions,
            "overhead_share": overhead_share(steps),
            "overhead_share_full_batch": overhead_share(steps, min_running=run.max_num_seqs),
            "overhead_ms_per_step_full_batch": overhead_ms(steps, min_running=run.max_num_seqs),
            "step_ms_full_batch": _mean_ms([s.step_time_s for s in steps if s.num_running >= run.max_num_seqs]),
        }
    return out


def _mean_ms(values: list[float]) -> float | None:
    return 1000 * float(np.mean(values)) if values else None


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy since boot (every core, every process)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def session_cpu_s(sid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live process of session `sid`, by pid: the processes a
    subprocess started with `start_new_session` runs, orphans included."""
    out = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                times = proc.cpu_times()
                out[proc.pid] = times.user + times.system
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    return out


@contextmanager
def cpu_contention() -> Iterator[dict[str, float | None]]:
    """Measures how much CPU other processes took while the block ran: on a shared machine a run that
    competed for its cores is slower for reasons that are not its own, and the report says so."""
    box: dict[str, float | None] = {"share": None}
    busy0, own0, t0 = busy_cpu_s(), os.times(), time.monotonic()
    try:
        yield box
    finally:
        busy1, own1, wall = busy_cpu_s(), os.times(), time.monotonic() - t0
        if wall > 0:
            own = (own1.user + own1.system) - (own0.user + own0.system)
            other = (busy1 - busy0) - own
            box["share"] = max(0.0, other / (wall * (os.cpu_count() or 1)))
