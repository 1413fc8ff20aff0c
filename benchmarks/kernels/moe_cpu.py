"""Our CPU MoE op (`inflight.ops.cpu.fused_moe`, csrc/cpu/moe.cpp) against the per-expert torch loop
(`reference.fused_moe`) and against the memory floor: the bytes of the experts a step touches over the
machine's streaming bandwidth.

    python -m benchmarks.kernels.moe_cpu
    python -m benchmarks.kernels.moe_cpu --tokens 1 32 --dtype bfloat16 --threads 1

Decode-shaped: T tokens routed at random to top-k of E experts (hidden H, intermediate I). The weights of
several layers are cycled through so that no call finds its experts in the last-level cache, as in a real step.
Bandwidth: the median of big fp32 sums (reads only, like the op's weights) on the same threads.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from inflight import omp

omp.apply()  # before torch loads

import torch  # noqa: E402

from inflight.config import DTYPES  # noqa: E402
from inflight.ops import cpu, reference  # noqa: E402


def median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def stream_gbps(mib: int = 1024, reps: int = 7) -> float:
    """Streaming read bandwidth: a sum over a buffer far beyond the caches."""
    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / median(times) / 1e9


def time_cycled(fn, layers: int, min_s: float, min_calls: int) -> float:
    """Median seconds a call, layer after layer (each call's weights cold in the caches)."""
    for layer in range(layers):
        fn(layer)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_s:
        layer = len(times) % layers
        t0 = time.perf_counter()
        fn(layer)
        times.append(time.perf_counter() - t0)
    return median(times)


def bench(args: argparse.Namespace, dtype: torch.dtype, gbps: float) -> list[dict[str, Any]]:
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(args.layers):
        w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
        w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
        weights.append((w13, w2, cpu.moe_pack(w13, w2)))
    expert_bytes = 3 * h * i * dtype.itemsize
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=gen).to(dtype)
        routes = [reference.select_experts(torch.randn(t, e, generator=gen), k, True) for _ in range(args.layers)]

        def ours(layer: int) -> torch.Tensor:
            return cpu.fused_moe(x, weights[layer][2], *routes[layer])  # noqa: B023

        def loop(layer: int) -> torch.Tensor:
            return reference.fused_moe(x, *weights[layer][:2], *routes[layer])  # noqa: B023

        touched = sum(len(ids.unique()) for _, ids in routes) / args.layers * expert_bytes
        t_ours = time_cycled(ours, args.layers, args.min_s, 5)
        t_loop = time_cycled(loop, args.layers, args.min_s, 3)
        floor = touched / (gbps * 1e9)
        same = torch.equal(ours(0)[-1:], cpu.fused_moe(x[-1:], weights[0][2], *(r[-1:] for r in routes[0])))
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "tokens": t,
                "touched_MB": touched / 1e6,
                "ours_ms": t_ours * 1e3,
                "loop_ms": t_loop * 1e3,
                "speedup": t_loop / t_ours,
                "floor_ms": floor * 1e3,
                "vs_floor": t_ours / floor,
                "GBps": touched / t_ours / 1e9,
                "invariant": same,
            }
        )
        r = rows[-1]
        print(
            f"{r['dtype']:>8} {t:>4} {r['touched_MB']:>8.1f} {r['ours_ms']:>8.2f} {r['loop_ms']:>8.2f} "
            f"{r['speedup']:>6.1f}x {r['floor_ms']:>8.2f} {r['vs_floor']:>6.2f}x {r['GBps']:>6.1f} "
            f"{'yes' if same else 'NO'}"
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="weight copies cycled through (beyond the caches)")
    p.add_argument("--min-s", type=float, default=0.5, help="seconds of calls per measurement, at least")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.available():
        raise SystemExit("the C++ CPU ops did not build here")
    gbps = stream_gbps()
    threads = torch.get_num_threads()
    print(
        f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate}, {threads} thread(s), "
        f"streaming {gbps:.1f} GB/s; floor = touched experts' bytes / streaming bandwidth"
    )
    print(
        f"{'dtype':>8} {'T':>4} {'touch MB':>8} {'ours ms':>8} {'loop ms':>8} {'speed':>7} {'floor ms':>8} "
        f"{'/floor':>7} {'GB/s':>6} invariant"
    )
    results: dict[str, Any] = {"threads": threads, "stream_GBps": gbps, "rows": []}
    for name in args.dtype:
        results["rows"] += bench(args, DTYPES[name], gbps)
    return results


if __name__ == "__main__":
    main()
