"""The CPU paged-attention op alone (`cpu_ops.paged_attention`), decode rows, with the cache cold.

    python -m benchmarks.kernels.bench_cpu_attention                      # GB/s by dtype, block size and block order
    python -m benchmarks.kernels.bench_cpu_attention --against HEAD~1     # this tree's op vs a git revision's, in turns

A decode step reads every layer's K/V cache once, so one layer's cache timed over and over (20-40 MB at 64
rows x 300 tokens) partly stays in the CPU's caches and flatters changes to the arithmetic. Each sample here
runs `--layers` caches in turn, as a step does. Geometry: llama50m's (8 query / 4 KV heads of 64).
Reported: median seconds per layer and the K/V bytes read per second; `--against` also prints new ÷ old.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from inflight.ops import cpu as cpu_ops
from inflight.ops import native

HQ, HKV, D = 8, 4, 64


def _caches(dtype: torch.dtype, rows: int, ctx: int, block_size: int, layers: int, in_order: bool):
    per_row = -(-ctx // block_size)
    num_blocks = rows * per_row + 8
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, HKV, D)
    ks = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    vs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    order = torch.arange(num_blocks) if in_order else torch.randperm(num_blocks, generator=gen)
    tables = order[: rows * per_row].view(rows, per_row).to(torch.int32).contiguous()
    query = torch.randn(rows, HQ, D, generator=gen).to(dtype)
    return ks, vs, tables, query, torch.full((rows,), ctx, dtype=torch.int32)


def time_ops(mods: dict[str, Any], dtype, rows, ctx, block_size, layers, repeats, in_order=False) -> dict[str, float]:
    """Median seconds per layer for each module, the modules taking turns."""
    ks, vs, tables, query, lens = _caches(dtype, rows, ctx, block_size, layers, in_order)
    out = torch.empty_like(query)
    times: dict[str, list[float]] = {name: [] for name in mods}
    for i in range(repeats + 2):
        for name, mod in mods.items():
            t0 = time.perf_counter()
            for k, v in zip(ks, vs):
                mod.paged_attention(out, query, k, v, tables, lens, D**-0.5)
            if i >= 2:  # warm-ups
                times[name].append((time.perf_counter() - t0) / layers)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def module_at(rev: str) -> Any:
    """The C++ ops as of a git revision (its src/inflight/ops/csrc/cpu/), built under a name of their own."""
    root = Path(__file__).resolve().parents[2]
    tree = Path(tempfile.mkdtemp(prefix="inflight-csrc-"))
    archive = subprocess.run(
        ["git", "archive", rev, "src/inflight/ops/csrc/cpu"], cwd=root, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return native.build(tree / "src/inflight/ops/csrc/cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--layers", type=int, default=16, help="caches read in turn per sample (1: cache hot)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--against", default=None, help="a git revision whose op is timed in turns with this tree's")
    args = p.parse_args(argv)
    new = cpu_ops.load()
    if new is None:
        raise SystemExit("the C++ ops could not be built on this machine")
    for dtype in (torch.float32, torch.bfloat16):
        elem = torch.empty((), dtype=dtype).element_size()
        kv_bytes = args.rows * args.context * HKV * D * 2 * elem
        name = str(dtype).removeprefix("torch.")
        if args.against:
            t = time_ops(
                {"old": module_at(args.against), "new": new},
                dtype,
                args.rows,
                args.context,
                16,
                args.layers,
                args.repeats,
            )
            print(
                f"{name:9s} {args.against}: {t['old'] * 1e3:.3f} ms ({kv_bytes / t['old'] / 1e9:.1f} GB/s)  "
                f"this tree: {t['new'] * 1e3:.3f} ms ({kv_bytes / t['new'] / 1e9:.1f} GB/s)  "
                f"new / old {t['new'] / t['old']:.2f}"
            )
            continue
        for block_size in (16, 32, 64):
            for in_order in (False, True):
                t = time_ops(
                    {"op": new}, dtype, args.rows, args.context, block_size, args.layers, args.repeats, in_order
                )["op"]
                order = "in order" if in_order else "random"
                print(
                    f"{name:9s} blocks of {block_size:2d}, {order:8s}: {t * 1e3:.3f} ms  {kv_bytes / t / 1e9:5.1f} GB/s"
                )
    x = torch.randn(args.layers, args.rows * args.context * HKV * D * 2)
    start = time.perf_counter()
    for row in x:
        row.sum()
    per = (time.perf_counter() - start) / args.layers
    print(f"plain sum over {x[0].numel() * 4 / 1e6:.0f} MB a layer: {x[0].numel() * 4 / per / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
