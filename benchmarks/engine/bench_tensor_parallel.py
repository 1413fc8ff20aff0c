"""Tensor parallelism on this host: decode steps of one model over 1 and N ranks, and the collectives' share.

    python -m benchmarks.engine.bench_tensor_parallel                          # demo and llama50m, TP 1 and 2
    python -m benchmarks.engine.bench_tensor_parallel --model llama50m --tp 1 2 --batch 1 32
    python -m benchmarks.engine.bench_tensor_parallel --collectives shm         # N ranks over shared memory only

Each run is an LLMEngine (fp32) with `batch` requests of `context` prompt tokens decoding together; after the
prefills, `steps` decode steps are timed: the engine's whole step, its forward (rank 0's view: the forward
waits for the slowest rank), and the time rank 0 spends inside collectives (the layers' all-reduces, the
embedding's, the logits' gather), which is communication plus waiting for the other ranks. N ranks run twice,
their collectives over shared memory (`shm`, the CPU default) and over gloo, in one run, so the two compare under
the same load. With N ranks on one host the ranks share its cores (one thread each for two ranks on two cores,
against two threads for one rank).
`load`: the host's 1-minute load average after the run (its 2 cores are shared with other jobs: above 2, the run
competed for them). Figures, no target. JSON goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.host import describe_host
from benchmarks.common.models import resolve_model
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.executor.shm_group import OFF_VARIABLE
from inflight.sampling_params import SamplingParams

RESULTS = Path("benchmarks/results")


class CollectiveTimer:
    """Wraps rank 0's TensorParallel: the seconds spent in its all-reduces and gathers, and how many."""

    def __init__(self, tp) -> None:
        self.seconds, self.calls = 0.0, 0
        tp.all_reduce, tp.gather_logits = self.timed(tp.all_reduce), self.timed(tp.gather_logits)

    def timed(self, collective):
        def run(*args):
            t0 = time.perf_counter()
            try:
                return collective(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return run


def decode_steps(model_dir: Path, tp: int, batch: int, context: int, steps: int, collectives: str) -> dict[str, Any]:
    threads = len(os.sched_getaffinity(0))
    os.environ[OFF_VARIABLE] = "1" if collectives == "shm" else "0"  # read by rank 0 as the ranks join
    torch.set_num_threads(threads)  # one rank takes every core; N ranks share them (the engine splits them)
    blocks = batch * -(-(context + steps + 8) // 16) + 16
    config = EngineConfig(dtype="float32", num_kv_blocks=blocks, max_num_seqs=batch, tensor_parallel_size=tp,
                          max_num_batched_tokens=max(2048, batch * context), enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(model_dir, config)
    try:
        if tp > 1:
            assert (engine.model.tp.shm is not None) == (collectives == "shm"), f"the ranks did not take {collectives}"
        timer = CollectiveTimer(engine.model.tp) if tp > 1 else None
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            prompt = [(7 + 31 * i + 13 * j) % (vocab - 3) + 3 for j in range(context)]
            engine.add_request(f"r{i}", prompt, params)
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()  # the prefills
        engine.step()  # a decode step of warm-up
        step_s, forward_s, collective_s = [], [], []
        calls = timer.calls if timer else 0
        for _ in range(steps):
            before = timer.seconds if timer else 0.0
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            forward_s.append(engine.last_step_stats.forward_time_s)
            if timer:
                collective_s.append(timer.seconds - before)
        calls = (timer.calls - calls) / steps if timer else 0
        step, forward = statistics.median(step_s), statistics.median(forward_s)
        collective = statistics.median(collective_s) if collective_s else 0.0
        return {
            "tp": tp,
            "collectives": collectives if tp > 1 else None,
            "batch": batch,
            "context": context,
            "threads_per_rank": max(1, threads // tp),
            "step_ms": step * 1e3,
            "forward_ms": forward * 1e3,
            "collective_ms": collective * 1e3,
            "collective_share_of_forward": collective / forward if forward else None,
            "collectives_per_step": round(calls) if timer else 0,
            "tokens_per_s": batch / step,
            "load_average_1min": os.getloadavg()[0],  # a shared host slows a run for reasons not its own
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["demo", "llama50m"])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--collectives", nargs="+", choices=["shm", "gloo"], default=["shm", "gloo"],
                   help="what N > 1 ranks all-reduce and gather over (each a row)")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/tensor_parallel.json)")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"host": describe_host(), "context": args.context, "steps": args.steps, "runs": []}
    print(f"{describe_host()}; fp32, context {args.context}, median of {args.steps} decode steps")
    print(f"{'model':<10}{'TP':>3}{'coll':>5}{'batch':>6}{'step ms':>9}{'fwd ms':>8}{'coll ms':>9}{'coll/fwd':>9}"
          f"{'tok/s':>9}{'load':>6}")  # fmt: skip
    for name in args.model:
        model_dir = resolve_model(name)
        for batch in args.batch:
            for tp, collectives in [(n, c) for n in args.tp for c in (args.collectives if n > 1 else ["-"])]:
                run = {"model": name} | decode_steps(model_dir, tp, batch, args.context, args.steps, collectives)
                result["runs"].append(run)
                share = run["collective_share_of_forward"]
                print(f"{name:<10}{tp:>3}{collectives:>5}{batch:>6}{run['step_ms']:>9.2f}{run['forward_ms']:>8.2f}"
                      f"{run['collective_ms']:>9.2f}{'' if share is None else f'{share:.0%}':>9}"
                      f"{run['tokens_per_s']:>9.0f}{run['load_average_1min']:>6.1f}")  # fmt: skip
    out = Path(args.out) if args.out else RESULTS / "tensor_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
