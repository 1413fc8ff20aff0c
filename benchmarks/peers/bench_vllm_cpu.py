"""vLLM on CPU over the benchmark's trace. Runs inside the virtualenv `vllm_cpu.sh` makes, where inflight
is not installed: only the numpy-level helpers of benchmarks.common are imported.

Writes a run summary in the benchmark's shape; `bench_batching --vllm-result FILE` adds it to the table,
and `bench_batching --peers vllm` runs this through `vllm_cpu.sh` itself, once per model and dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.metrics import RunResult, summarize
from benchmarks.common.trace import OUTPUT_DISTRIBUTIONS, TraceRequest, TraceSpec, digest, make_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 512))
    p.add_argument("--output-dist", choices=OUTPUT_DISTRIBUTIONS, default="pareto")
    p.add_argument("--pareto-alpha", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_cpu.json"))
    p.add_argument(
        "--dry-run-wall-s",
        type=float,
        default=None,
        metavar="S",
        help="no vLLM: write the summary as if every requested token came in S seconds (checks the plumbing)",
    )
    return p.parse_args(argv)


def make_args_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """The benchmark's trace from the same spec and vocabulary (make_trace is deterministic)."""
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    spec = TraceSpec(
        args.num_requests,
        tuple(args.prompt_len),
        tuple(args.output_len),
        output_dist=args.output_dist,
        pareto_alpha=args.pareto_alpha,
        seed=args.seed,
    )
    return make_trace(spec, vocab)


def trace_info(trace: Sequence[TraceRequest], seed: int) -> dict[str, Any]:
    return {"num_requests": len(trace), "seed": seed, "digest": digest(trace)}


def result(
    args: argparse.Namespace, trace: Sequence[TraceRequest], output_tokens: int, wall_s: float, version: str
) -> dict[str, Any]:
    """What this run writes: a run summary in the benchmark's shape, the trace it served (the reader
    checks the digest against its own) and the settings vLLM ran with."""
    run = RunResult(
        name="vllm-cpu",
        output_tokens=output_tokens,
        wall_s=wall_s,
        ttft_s=[],  # offline generate() returns whole requests; no per-request timing comparable to ours
        latency_s=[],
        max_num_seqs=args.max_num_seqs,
        note=f"vLLM {version} CPU, {args.dtype}, offline LLM.generate, all requests at t = 0",
    )
    settings = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.prompt_len[1] + args.output_len[1],
        "vllm": version,
    } | {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_CPU_", "OMP_"))}
    return summarize(run) | {"trace": trace_info(trace, args.seed), "settings": settings}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    trace = make_args_trace(args)
    if args.dry_run_wall_s is not None:
        return write(args, result(args, trace, sum(r.output_len for r in trace), args.dry_run_wall_s, "dry-run"))

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(args.model_dir),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len[1] + args.output_len[1],
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in trace]
    params = [
        SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        for r in trace
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    started, t0 = time.time(), time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall, ended = time.perf_counter() - t0, time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = result(args, trace, tokens, wall, vllm.__version__)
    summary["window_unix_s"] = [started, ended]  # the caller measures other processes' CPU over this window
    summary["sample_text"] = outputs[0].outputs[0].text[:200]  # shows that vLLM detokenized what it sampled
    return write(args, summary)


def write(args: argparse.Namespace, summary: dict[str, Any]) -> dict[str, Any]:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"vllm-cpu: {summary['output_tokens']} tokens = {summary['tokens_per_s']:.0f} tok/s -> {args.out}")
    return summary


if __name__ == "__main__":  # vLLM's CPU workers are spawned processes that re-import this module
    main()
