"""Our CPU GEMM (`inflight.ops.cpu`, csrc/cpu/gemm.cpp) against oneDNN's pre-packed weights, on a model's layer shapes.

    python -m benchmarks.kernels.bench_gemm --model llama50m --dtype float32 bfloat16 --rows 1 8 32 64 256
    python -m benchmarks.kernels.bench_gemm --threads 1

Per shape (K inputs -> N outputs) and row count M: the median time of each, their ratio, our GFLOP/s and
GB/s of weights, and whether every row came out the same bits alone as in the batch (batch invariance;
oneDNN's lone-row kernel sums some shapes in another order). One process, the two alternated per shape.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks.common.models import resolve_model
from inflight.config import DTYPES
from inflight.ops import cpu as cpu_gemm


def layer_shapes(model_dir) -> list[tuple[str, int, int]]:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, d = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return [
        ("qkv_proj", h, (nq + 2 * nkv) * d),
        ("o_proj", nq * d, h),
        ("gate_up_proj", h, 2 * i),
        ("down_proj", i, h),
        ("lm_head", h, cfg["vocab_size"]),
    ]


def median_time(fn, min_s: float = 0.1, min_calls: int = 5) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_shape(k: int, n: int, rows: list[int], dtype: torch.dtype) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    ours = cpu_gemm.pack(weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def onednn(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    out = []
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(dtype)
        t_ours = median_time(lambda: cpu_gemm.linear(x, ours, n, None))  # noqa: B023
        t_dnn = median_time(lambda: onednn(x))  # noqa: B023
        together = cpu_gemm.linear(x, ours, n, None)
        dnn = onednn(x)
        lone = range(min(m, 8))
        out.append(
            {
                "rows": m,
                "ours_us": t_ours * 1e6,
                "onednn_us": t_dnn * 1e6,
                "speedup": t_dnn / t_ours,
                "ours_GFLOPs": 2 * m * n * k / t_ours / 1e9,
                "ours_weight_GBps": weight.numel() * weight.element_size() / t_ours / 1e9,
                "ours_invariant": all(
                    torch.equal(cpu_gemm.linear(x[i : i + 1], ours, n, None)[0], together[i]) for i in lone
                ),
                "onednn_invariant": all(torch.equal(onednn(x[i : i + 1])[0], dnn[i]) for i in lone),
            }
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama50m")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = layer_shapes(resolve_model(args.model))
    results: dict[str, Any] = {"model": args.model, "threads": torch.get_num_threads(), "shapes": []}
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        if not cpu_gemm.gemm_supports(dtype, 2):
            print(f"{dtype_name}: this CPU's build has no kernel for it (fp32: AVX-512 or AVX2; bf16: AVX512-BF16)")
            continue
        print(f"{dtype_name}, {results['threads']} thread(s): time ours / oneDNN (speedup), ours GFLOP/s, invariant")
        for name, k, n in shapes:
            rows = bench_shape(k, n, args.rows, dtype)
            results["shapes"].append({"dtype": dtype_name, "layer": name, "K": k, "N": n, "rows": rows})
            cells = [
                f"M{r['rows']}: {r['ours_us']:.0f}/{r['onednn_us']:.0f} us ({r['speedup']:.2f}x) "
                f"{r['ours_GFLOPs']:.0f} GF{'' if r['ours_invariant'] else ' NOT INVARIANT'}"
                f"{'' if r['onednn_invariant'] else ' (oneDNN not invariant)'}"
                for r in rows
            ]
            print(f"  {name} K={k} N={n}\n    " + "\n    ".join(cells))
    return results


if __name__ == "__main__":
    main()
