"""Forward steps of a GGUF model on its blocks (`weight_format="packed"`) against the same file dequantized.

    python -m benchmarks.engine.bench_gguf_decode --dtype bfloat16 float32 --batch 1 32 --prefill 2048
    python -m benchmarks.engine.bench_gguf_decode --dtype float32 --formats packed dequantized onednn
    python -m benchmarks.engine.bench_gguf_decode --dtype float32 --formats packed dequantized onednn --rss

The models are loaded in one process and their steps take turns (benchmarks/engine/bench_decode_step.py's
`time_step`): decode steps at each batch size (context --context) and one prefill; the median step time of
each, each one's ratio to the first format's (> 1 where the first is faster) and the weight bytes each holds.
`onednn` is the dequantized model as a CPU without our GEMM runs it: its linears on oneDNN, op by op.
`--rss`: instead, each format served by the offline `LLM` in a process of its own (32 requests of 64 tokens at
once, then one): the resident size after loading, after serving, and at its peak.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator

import torch

from benchmarks.engine.bench_decode_step import time_step
from inflight.config import DTYPES
from inflight.executor.model_runner import ModelRunner
from inflight.model_source import default_model_path
from inflight.models.loader import load_model, weight_bytes
from inflight.ops import cpu as cpu_ops

FORMATS = {"packed": "packed", "dequantized": "dequantized", "onednn": "dequantized"}  # name -> weight_format


@contextlib.contextmanager
def loading_as(fmt: str) -> Iterator[None]:
    """`onednn`: our GEMM reported missing while the model (and its runner) is built, so its linears go to oneDNN
    and the step runs op by op, as on a CPU our GEMM does not run on."""
    if fmt != "onednn":
        yield
        return
    supports = cpu_ops.gemm_supports
    cpu_ops.gemm_supports = lambda dtype, in_features: False
    try:
        yield
    finally:
        cpu_ops.gemm_supports = supports


def _status_mib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key))


def serve_and_measure(path: str, fmt: str, dtype: str) -> None:
    from inflight import LLM, SamplingParams

    with loading_as(fmt):
        llm = LLM(path, dtype=dtype, weight_format=FORMATS[fmt], num_kv_blocks=192)
    loaded = _status_mib("VmRSS:")
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    llm.generate(["Tell me a story about the sea."] * 32, [params] * 32, use_tqdm=False)
    llm.generate(["Tell me a story about the sea."], [params], use_tqdm=False)
    print(
        f"{dtype} {fmt:11}: RSS {loaded} MiB loaded, {_status_mib('VmRSS:')} MiB after serving, "
        f"peak {_status_mib('VmHWM:')} MiB",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=list(DTYPES))
    ap.add_argument("--formats", nargs="+", default=["packed", "dequantized"], choices=list(FORMATS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--prefill", type=int, default=0, help="one fresh prompt of this length (0: skip)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rss", action="store_true", help="each format's process RSS instead of step times")
    ap.add_argument("--rss-child", nargs=3, metavar=("PATH", "FORMAT", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        serve_and_measure(*args.rss_child)
        return
    path = args.gguf or str(default_model_path())
    if args.rss:
        for name in args.dtype:
            for fmt in args.formats:
                child = [sys.executable, "-m", "benchmarks.engine.bench_gguf_decode", "--rss-child", path, fmt, name]
                subprocess.run(child, check=True)
        return
    blocks = -(-(args.context + args.prefill) // 16) * max(args.batch) + 64
    cpu = torch.device("cpu")
    for name in args.dtype:
        dtype = DTYPES[name]
        runners = {}
        for fmt in args.formats:
            with loading_as(fmt):
                model, _ = load_model(path, dtype, cpu, FORMATS[fmt])
                runners[fmt] = ModelRunner(model, blocks, 16, 4096, dtype, cpu, "torch")
            stack = "layer stack" if runners[fmt].cpu_forward is not None else "per-op"
            print(f"{name} {fmt:11}: {weight_bytes(model) / 2**20:7.1f} MiB of weights, {stack}", flush=True)
        cases = [(f"decode batch {b:3d}", [args.context] * b, [1] * b) for b in args.batch]
        if args.prefill:
            cases.append((f"prefill {args.prefill}", [args.prefill], [args.prefill]))
        first = args.formats[0]
        for label, seq_lens, query_lens in cases:
            reps = args.repeats if query_lens[0] == 1 else max(2, args.repeats // 4)
            t = {fmt: [] for fmt in runners}
            for _ in range(3):  # taking turns: a noisy minute hits all alike
                for fmt, runner in runners.items():
                    t[fmt].append(time_step(runner, seq_lens, query_lens, reps)["runner"])
            best = {fmt: min(times) for fmt, times in t.items()}
            cells = [f"{fmt} {s * 1e3:8.2f} ms ({s / best[first]:4.2f}x)" for fmt, s in best.items()]
            print(f"{name} {label}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
