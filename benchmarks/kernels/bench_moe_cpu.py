"""Our CPU MoE op (`inflight.ops.cpu.fused_moe`, csrc/cpu/moe.cpp) against the per-expert torch loop
(`reference.fused_moe`) and against the memory floor: the bytes of the experts a call touches over the
machine's streaming bandwidth.

    python -m benchmarks.kernels.bench_moe_cpu
    python -m benchmarks.kernels.bench_moe_cpu --tokens 1 32 --dtype bfloat16 --threads 1

Decode-shaped: T tokens routed at random to top-k of E experts (hidden H, intermediate I). Calls cycle through
several layers' weights and routings, so that no call finds its experts in the last-level cache, as in a real
step. The bandwidth is measured between the op's calls (a sum over a quarter of a 1 GiB buffer, reads only like
the op's weights), so that a busy machine slows both alike; the floor is the touched bytes over its median.
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

ROUTINGS = 16  # routings a row cycles through (with the layers: a call's experts are rarely the last call's)
STREAM_CHUNKS = 4  # parts of the bandwidth buffer, one summed after each call


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(args: argparse.Namespace, dtype: torch.dtype, stream: torch.Tensor) -> list[dict[str, Any]]:
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
        w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
        layers.append((w13, w2, cpu.moe_pack(w13, w2)))
    expert_bytes = 3 * h * i * dtype.itemsize
    chunk = stream.numel() // STREAM_CHUNKS
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=gen).to(dtype)
        routes = [reference.select_experts(torch.randn(t, e, generator=gen), k, True) for _ in range(ROUTINGS)]
        touched = sum(len(ids.unique()) for _, ids in routes) / ROUTINGS * expert_bytes

        def ours(n: int) -> torch.Tensor:
            return cpu.fused_moe(x, layers[n % args.layers][2], *routes[n % ROUTINGS])  # noqa: B023

        def loop(n: int) -> torch.Tensor:
            return reference.fused_moe(x, *layers[n % args.layers][:2], *routes[n % ROUTINGS])  # noqa: B023

        for n in range(ROUTINGS):  # warm-up: first touches, the pool
            ours(n)
        t_ours: list[float] = []
        gbps: list[float] = []
        start = time.perf_counter()
        while len(t_ours) < 8 or time.perf_counter() - start < args.min_s:
            n = len(t_ours)
            t_ours.append(timed(lambda: ours(n)))  # noqa: B023
            part = stream[(n % STREAM_CHUNKS) * chunk : (n % STREAM_CHUNKS + 1) * chunk]
            gbps.append(part.numel() * 4 / timed(part.sum) / 1e9)
        t_loop = [timed(lambda: loop(n)) for n in range(args.loop_calls)]  # noqa: B023
        ms, loop_ms, bw = median(t_ours) * 1e3, median(t_loop) * 1e3, median(gbps)
        floor_ms = touched / (bw * 1e9) * 1e3
        alone = cpu.fused_moe(x[-1:], layers[0][2], *(r[-1:] for r in routes[0]))
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "tokens": t,
                "touched_MB": touched / 1e6,
                "ours_ms": ms,
                "loop_ms": loop_ms,
                "speedup": loop_ms / ms,
                "stream_GBps": bw,
                "floor_ms": floor_ms,
                "vs_floor": ms / floor_ms,
                "ours_GBps": touched / ms / 1e6,
                "invariant": torch.equal(ours(0)[-1:], alone),
            }
        )
        r = rows[-1]
        print(
            f"{r['dtype']:>8} {t:>4} {r['touched_MB']:>8.1f} {ms:>8.2f} {loop_ms:>8.2f} {r['speedup']:>6.1f}x "
            f"{bw:>7.1f} {floor_ms:>8.2f} {r['vs_floor']:>6.2f}x {r['ours_GBps']:>6.1f} "
            f"{'yes' if r['invariant'] else 'NO'}",
            flush=True,
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
    p.add_argument("--min-s", type=float, default=1.0, help="seconds of our op's calls a row, at least")
    p.add_argument("--loop-calls", type=int, default=3, help="calls of the reference loop a row")
    p.add_argument("--stream-mib", type=int, default=1024, help="the bandwidth buffer (far beyond the caches)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.available():
        raise SystemExit("the C++ CPU ops did not build here")
    stream = torch.ones(args.stream_mib * 2**20 // 4)
    threads = torch.get_num_threads()
    print(
        f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate}, {threads} thread(s); "
        "floor = touched experts' bytes / streaming read bandwidth (measured between calls)"
    )
    print(
        f"{'dtype':>8} {'T':>4} {'touch MB':>8} {'ours ms':>8} {'loop ms':>8} {'speed':>7} {'GB/s':>7} "
        f"{'floor ms':>8} {'/floor':>7} {'ours GB/s':>6} invariant"
    )
    results: dict[str, Any] = {"threads": threads, "rows": []}
    for name in args.dtype:
        results["rows"] += bench(args, DTYPES[name], stream)
    return results


if __name__ == "__main__":
    main()
