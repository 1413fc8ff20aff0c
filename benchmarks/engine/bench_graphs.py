"""CUDA graphs against eager launches on the batching trace (GPU): the same continuous + paged run with and
without graphs, in alternating rounds; throughput, and the forward time of decode-only and mixed steps.

    python -m benchmarks.engine.bench_graphs --model llama1b --dtype bfloat16 --max-num-seqs 64

Decode-only steps replay one graph either way when graphs are on; steps with prompt tokens or drafts replay
pieces around an eager attention (executor/cuda_graphs.py). The trace is bench_batching's default.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common.metrics import RunResult
from benchmarks.common.models import resolve_model
from benchmarks.common.replay import run_engine
from benchmarks.common.trace import TraceSpec, make_trace
from inflight.config import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama1b", help="demo | llama50m | llama1b | a checkpoint directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: both modes are eager (a smoke run)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2, help="rounds of eager then graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/graphs.json"))
    return p.parse_args(argv)


def step_times(run: RunResult) -> dict[str, float | int]:
    """Median forward ms of decode-only steps (one token per running sequence) and of the others."""
    decode = [s.forward_time_s for s in run.steps if s.num_scheduled_tokens == s.num_running]
    mixed = [s.forward_time_s for s in run.steps if s.num_scheduled_tokens != s.num_running]
    med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"decode_steps": len(decode), "decode_ms": med(decode), "mixed_steps": len(mixed), "mixed_ms": med(mixed)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model_dir = resolve_model(args.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    spec = TraceSpec(num_requests=args.num_requests, seed=args.seed)
    trace = make_trace(spec, vocab)
    rows = []
    for r in range(args.rounds):
        for eager in (True, False):
            config = EngineConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=spec.max_seq_len,
                device=args.device,
                dtype=args.dtype,
                enforce_eager=eager,
            )
            mode = "eager" if eager else "graphs"
            run = run_engine(mode, model_dir, config, trace, progress=False)
            row = {"round": r, "mode": mode, "tokens_per_s": run.tokens_per_s, "wall_s": run.wall_s}
            row |= step_times(run)
            rows.append(row)
            print(json.dumps(row), flush=True)
    ratios = [g["tokens_per_s"] / e["tokens_per_s"] for e, g in zip(rows[::2], rows[1::2])]
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "graphs_over_eager": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"graphs_over_eager": ratios}))
    return result


if __name__ == "__main__":
    main()
