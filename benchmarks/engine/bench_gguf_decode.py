"""Forward steps of a GGUF model on its blocks (`weight_format="packed"`) against the same file dequantized.

    python -m benchmarks.engine.bench_gguf_decode --dtype bfloat16 float32 --batch 1 32 --prefill 2048

Both models are loaded in one process and their steps take turns (benchmarks/engine/bench_decode_step.py's
`time_step`): decode steps at each batch size (context --context) and one prefill; the median step time of
each, their ratio (dequantized / packed: > 1 where the blocks are faster) and the weight bytes each holds.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.engine.bench_decode_step import time_step
from inflight.config import DTYPES
from inflight.executor.model_runner import ModelRunner
from inflight.model_source import default_model_path
from inflight.models.loader import load_model, weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=list(DTYPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--prefill", type=int, default=0, help="one fresh prompt of this length (0: skip)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    path = args.gguf or str(default_model_path())
    blocks = -(-(args.context + args.prefill) // 16) * max(args.batch) + 64
    cpu = torch.device("cpu")
    for name in args.dtype:
        dtype = DTYPES[name]
        runners = {}
        for fmt in ("packed", "dequantized"):
            model, _ = load_model(path, dtype, cpu, fmt)
            runners[fmt] = ModelRunner(model, blocks, 16, 4096, dtype, cpu, "torch")
            stack = "layer stack" if runners[fmt].cpu_forward is not None else "per-op"
            print(f"{name} {fmt:11}: {weight_bytes(model) / 2**20:7.1f} MiB of weights, {stack}", flush=True)
        cases = [(f"decode batch {b:3d}", [args.context] * b, [1] * b) for b in args.batch]
        if args.prefill:
            cases.append((f"prefill {args.prefill}", [args.prefill], [args.prefill]))
        for label, seq_lens, query_lens in cases:
            reps = args.repeats if query_lens[0] == 1 else max(2, args.repeats // 4)
            t = {fmt: [] for fmt in runners}
            for _ in range(3):  # taking turns: a noisy minute hits both alike
                for fmt, runner in runners.items():
                    t[fmt].append(time_step(runner, seq_lens, query_lens, reps)["runner"])
            p, d = min(t["packed"]), min(t["dequantized"])
            print(f"{name} {label}: packed {p * 1e3:8.2f} ms  dequantized {d * 1e3:8.2f} ms  {d / p:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
