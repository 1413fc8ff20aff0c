"""Does torch.compile (inductor) pay for the CPU forward? The plain-torch layer stack, eager and compiled,
against the runner's own forward (the layer stack as one C++ call), in decode steps.

    python -m benchmarks.engine.bench_compile --model llama50m --dtype float32 bfloat16

The compiled path is `LlamaForCausalLM.forward` with `nn.Linear` weights (not packed for our GEMM, which
inductor could not see into) and `TorchBackend(native=False)` (plain torch ops, gather + SDPA attention),
compiled once with `dynamic=True` so that one graph set serves every batch size. It runs under `no_grad`:
under `inference_mode` dynamo's guards failed on the numpy arrays of the step's metadata (torch 2.13).
The two plain paths take turns; the runner is timed before them, alone. Printed: compile time, graph
breaks, step times and the compiled path's largest difference from eager.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any
from unittest import mock

import numpy as np
import torch

from benchmarks.common.models import resolve_model
from inflight.config import DTYPES
from inflight.executor.attention import TorchBackend
from inflight.executor.attention.metadata import consecutive_batch
from inflight.executor.model_runner import ModelRunner
from inflight.models import loader

# Inductor's pool of compile workers keeps compiling in the background into the timed steps: compile on
# the calling thread instead.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch._dynamo.utils import counters

    path, cpu = resolve_model(args.model), torch.device("cpu")
    blocks = -(-args.context // 16) * max(args.batch) + 64
    results = []
    for name in args.dtype:
        dtype = DTYPES[name]
        model, cfg = loader.load_model(path, dtype, cpu)
        runner = ModelRunner(model, blocks, 16, 4096, dtype, cpu, "torch")
        with mock.patch.object(loader, "pack_linears", lambda model, skip=frozenset(): 0):
            plain_model, _ = loader.load_model(path, dtype, cpu)
        plain = ModelRunner(plain_model, blocks, 16, 4096, dtype, cpu, "torch")
        ops = TorchBackend(native=False)
        torch._dynamo.reset()  # each dtype compiles from scratch
        # Batch 1 and batch 64 are two specializations (dynamo specializes sizes 0 and 1) of each of the
        # per-layer frames between graph breaks: more than the default limit of 8 recompiles.
        torch._dynamo.config.recompile_limit = 64
        compiled = torch.compile(plain_model.forward, dynamic=True)
        paths = {
            "plain eager": lambda ids, pos, meta: plain_model(ids, pos, meta, plain.kv_caches, ops),  # noqa: B023
            "plain compiled": lambda ids, pos, meta: compiled(ids, pos, meta, plain.kv_caches, ops),  # noqa: B023
        }
        # The runner first, on its own: in turns with the plain paths its steps ran slower than alone
        # (something those paths leave running), which would flatter the compiled path.
        runner_ms = {b: time_runner(runner, b, args) for b in args.batch}
        counters.clear()
        row: dict[str, Any] = {"dtype": name, "layer_stack": "cpu_forward" if runner.cpu_forward else "per_op"}
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in sorted({min(args.batch), max(args.batch)}):  # the compiles a run of both sizes needs
                positions, meta, _ = consecutive_batch([args.context] * b, [1] * b, 16, cpu)
                compiled(torch.zeros(len(positions), dtype=torch.long), positions, meta, plain.kv_caches, ops)
        row["compile_s"] = time.perf_counter() - t0
        row["steps"] = []
        with torch.no_grad():
            for b in args.batch:
                positions, _, _ = consecutive_batch([args.context] * b, [1] * b, 16, cpu)
                ids = torch.randint(0, cfg.vocab_size, (len(positions),))
                times: dict[str, list[float]] = {p: [] for p in paths}
                outs: dict[str, torch.Tensor] = {}
                for i in range(args.repeats + 1):
                    for p, forward in paths.items():
                        meta = consecutive_batch([args.context] * b, [1] * b, 16, cpu)[1]
                        t1 = time.perf_counter()
                        outs[p] = forward(ids, positions, meta)
                        if i:
                            times[p].append(time.perf_counter() - t1)
                diff = (outs["plain compiled"].float() - outs["plain eager"].float()).abs().max().item()
                ms = {p: float(np.median(t)) * 1e3 for p, t in times.items()}
                ms["runner"] = runner_ms[b]
                row["steps"].append({"batch": b, "ms": ms, "compiled_vs_eager_max_abs_diff": diff})
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["graph_break_reasons"] = sorted({str(k).splitlines()[0][:120] for k in counters["graph_break"]})
        row["graphs"] = counters["stats"]["unique_graphs"]
        results.append(row)
        print_row(row)
    return results


def time_runner(runner: ModelRunner, b: int, args: argparse.Namespace) -> float:
    """Median ms of the runner's forward at batch b (decode rows of args.context tokens)."""
    positions, _, _ = consecutive_batch([args.context] * b, [1] * b, 16, torch.device("cpu"))
    ids = torch.randint(0, runner.model.cfg.vocab_size, (len(positions),))
    times = []
    with torch.inference_mode():
        for i in range(args.repeats + 1):
            meta = consecutive_batch([args.context] * b, [1] * b, 16, torch.device("cpu"))[1]
            t0 = time.perf_counter()
            runner.forward(ids, positions, meta)
            if i:
                times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['dtype']}: compile {row['compile_s']:.0f} s, {row['graphs']} graphs, {row['graph_breaks']} graph "
        f"breaks ({'; '.join(row['graph_break_reasons'])}); the runner's forward is {row['layer_stack']}"
    )
    for s in row["steps"]:
        ms = s["ms"]
        print(
            f"  batch {s['batch']:>3}: plain eager {ms['plain eager']:7.1f} ms  "
            f"compiled {ms['plain compiled']:7.1f} ms "
            f"({ms['plain eager'] / ms['plain compiled']:.2f}x)  runner {ms['runner']:6.1f} ms "
            f"({ms['plain compiled'] / ms['runner']:.1f}x faster than compiled)  "
            f"compiled vs eager: max |diff| {s['compiled_vs_eager_max_abs_diff']:.2e}"
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama50m")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=6)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
