"""Replays a trace through an in-process `LLMEngine`, recording every step and every request's timing.

Requests join when their arrival time has come (the loop sleeps only when the engine is idle), and
TTFT / latency are measured from that arrival, so queueing counts against the system, as a user sees it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.common.metrics import RunResult, StepRecord
from benchmarks.common.trace import TraceRequest
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.sampling_params import SamplingParams


def exact_params(output_len: int) -> SamplingParams:
    # Exact lengths: every system does the same work whatever the random weights would sample.
    return SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)


def warm_up(engine: LLMEngine) -> None:
    """One short request through prefill and decode, so one-time kernel setup stays out of the timing."""
    engine.add_request("warmup", list(range(3, 35)), exact_params(4))
    while engine.has_unfinished_requests():
        engine.step()


def run_engine(
    name: str,
    model_dir: str | Path,
    config: EngineConfig,
    trace: Sequence[TraceRequest],
    progress: bool = True,
    stop_when_queue_empty: bool = False,
) -> RunResult:
    """`stop_when_queue_empty`: abort what is still running once nothing waits (overhead-only runs)."""
    engine = LLMEngine(model_dir, config)
    warm_up(engine)
    snap0 = engine.snapshot()
    pending = sorted(trace, key=lambda r: r.arrival_s)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[StepRecord] = []
    tokens = 0
    bar = tqdm(total=len(pending), desc=name, unit="req", disable=not progress, leave=False)
    t0 = time.monotonic()
    nxt = 0
    while nxt < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic()
        while nxt < len(pending) and t0 + pending[nxt].arrival_s <= now:
            req = pending[nxt]
            arrival[req.request_id] = at = t0 + req.arrival_s
            engine.add_request(req.request_id, list(req.prompt_token_ids), exact_params(req.output_len), at)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + pending[nxt].arrival_s - time.monotonic()))
            continue
        before = engine.num_steps
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            tokens += len(out.new_token_ids)
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
                bar.update(1)
        stats = engine.last_step_stats
        if stats is not None and engine.num_steps != before:
            steps.append(
                StepRecord(
                    t=now - t0,
                    num_running=stats.num_running,
                    num_waiting=stats.num_waiting,
                    num_kv_blocks_used=stats.num_kv_blocks_used,
                    num_scheduled_tokens=stats.num_scheduled_tokens,
                    step_time_s=stats.step_time_s,
                    forward_time_s=stats.forward_time_s,
                    num_kv_blocks_cached=stats.num_kv_blocks_cached,
                )
            )
        if stop_when_queue_empty and nxt == len(pending) and not engine.scheduler.waiting:
            break
    wall = (max(done.values()) if done else time.monotonic()) - t0
    snap = engine.snapshot()
    bar.close()
    result = RunResult(
        name=name,
        output_tokens=tokens,
        wall_s=wall,
        ttft_s=[first[r] - arrival[r] for r in done],
        latency_s=[done[r] - arrival[r] for r in done],
        max_num_seqs=config.max_num_seqs,
        steps=steps,
        num_kv_blocks_total=engine.num_kv_blocks,
        num_preemptions=engine.scheduler.num_preemptions,
        prefix_cache_queries=snap.prefix_cache_queries - snap0.prefix_cache_queries,
        prefix_cache_hits=snap.prefix_cache_hits - snap0.prefix_cache_hits,
        config={
            "scheduling_policy": config.scheduling_policy,
            "kv_reservation": config.kv_reservation,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_kv_blocks": engine.num_kv_blocks,
            "block_size": config.block_size,
            "max_model_len": engine.max_model_len,
            "enable_prefix_caching": config.enable_prefix_caching,
        },
    )
    del engine
    gc.collect()  # the next run's KV cache should not have to share memory with this one's
    return result
