"""The forward pass alone: decode steps (and one prefill) timed against the hardware's floors.

    python -m benchmarks.engine.bench_decode_step --model llama50m --dtype float32 bfloat16
    python -m benchmarks.engine.bench_decode_step --profile      # + the top ops and the op count of one decode step

Floors: batch 1 reads every weight once per step, so its floor is weight bytes / the copy bandwidth
measured here; batch B is GEMM-bound, so its floor is 2 * parameters * B FLOP (plus attention's
4 * layers * heads * head_dim * context per row) / the GEMM rate measured here on one large matmul in
the same dtype (on a CPU, torch's or our own GEMM's, whichever is faster). Both are printed with the step
times and their ratios. A third figure, `+kv`, adds the time to read every row's cached K/V once at that
bandwidth: on a CPU the same cores run the GEMMs and then the attention, so at batch 64 x 300 tokens the KV
reads (which the compute floor leaves out) cost a third as much again.

Where the runner runs the layer stack as one C++ call (executor/cpu_forward.py), each step is also timed
op by op (`LlamaForCausalLM.forward`, what that call replaces), the two taking turns: `per-op` and the
ratio to the runner's time.

`--device cuda` runs the same steps on a GPU through the Triton kernels (the floors measured there on a
1 GiB copy and an 8192^3 matmul); `--profile` then also sums the GPU's kernel time of one step, so that
step time minus kernel time is what launching from Python costs (what CUDA graphs would remove).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from benchmarks.common.models import resolve_model
from inflight.config import DTYPES
from inflight.executor.attention.metadata import consecutive_batch
from inflight.executor.model_runner import ModelRunner
from inflight.models.loader import load_model
from inflight.models.packed_linear import PackedLinear
from inflight.ops import cpu


def _forward(runner: ModelRunner, path: str):
    if path == "per_op":  # LlamaForCausalLM.forward op by op, what cpu_forward replaces
        return lambda ids, positions, meta: runner.model(ids, positions, meta, runner.kv_caches, runner.ops)
    return runner.forward


def paths(runner: ModelRunner) -> list[str]:
    """The runner's own forward, and the per-op path too where the runner replaces it (the one-call CPU
    step, or CUDA graphs for decode steps)."""
    return ["runner", "per_op"] if runner.cpu_forward is not None or runner.cuda_graphs is not None else ["runner"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(runner: ModelRunner, seq_lens, query_lens, repeats: int) -> dict[str, float]:
    """Median seconds of one forward (all layers + logits of the last token of each sequence) per path,
    the paths taking turns so that a noisy minute hits both alike."""
    positions, meta0, _ = consecutive_batch(seq_lens, query_lens, runner.block_size, runner.device)
    ids = torch.randint(0, runner.model.cfg.vocab_size, (len(positions),)).to(runner.device)
    last = torch.from_numpy(meta0.query_start_loc_np[1:] - 1).to(runner.device)
    times: dict[str, list[float]] = {path: [] for path in paths(runner)}
    with torch.inference_mode():
        for i in range(repeats + 1):
            for path, seconds in times.items():
                forward = _forward(runner, path)
                meta = consecutive_batch(seq_lens, query_lens, runner.block_size, runner.device)[1]  # fresh cache
                _sync(runner.device)
                t0 = time.perf_counter()
                hidden = forward(ids, positions, meta)
                runner.model.compute_logits(hidden[last])
                _sync(runner.device)
                if i:  # the first is a warm-up
                    seconds.append(time.perf_counter() - t0)
    return {path: float(np.median(seconds)) for path, seconds in times.items()}


def profile_step(runner: ModelRunner, seq_lens, query_lens, top: int = 12, path: str = "runner") -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    positions, meta, _ = consecutive_batch(seq_lens, query_lens, runner.block_size, runner.device)
    ids = torch.randint(0, runner.model.cfg.vocab_size, (len(positions),)).to(runner.device)
    last = torch.from_numpy(meta.query_start_loc_np[1:] - 1).to(runner.device)
    forward = _forward(runner, path)
    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        forward(ids, positions, meta)
        meta = consecutive_batch(seq_lens, query_lens, runner.block_size, runner.device)[1]
        _sync(runner.device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            hidden = forward(ids, positions, meta)
            runner.model.compute_logits(hidden[last])
            _sync(runner.device)
            wall = time.perf_counter() - t0
    events = prof.key_averages()
    # Top-level ops only (an op called from inside another op is not a separate dispatch): aten ops and
    # the C++ CPU ops (`inflight::*`, recorded by name).
    counts = Counter()
    for e in prof.events():
        op = e.name.startswith(("aten::", "mkldnn::", "inflight::"))
        nested = e.cpu_parent is not None and e.cpu_parent.name.startswith(("aten::", "mkldnn::", "inflight::"))
        if op and not nested:
            counts[e.name] += 1
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    gpu = {}
    if cuda:  # kernels on the GPU (their own time, not the CPU-side launch) and how many were launched
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = {
            "wall_ms": round(wall * 1e3, 3),
            "gpu_kernel_ms": round(sum(e.device_time_total for e in kernels) / 1e3, 3),
            "kernel_launches": len(kernels),
        }
    return gpu | {
        "top_level_ops": sum(counts.values()),
        "op_counts": dict(counts.most_common(top)),
        "self_time_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in rows},
    }


def measure_floors(dtype: torch.dtype, tries: int = 10, device: torch.device | None = None) -> tuple[float, float]:
    """(copy bandwidth bytes/s, GEMM FLOP/s) on this machine in `dtype`: the best of `tries`, since the
    hardware's limit is what it reaches when nothing else runs, not the mean over a shared minute. On a CPU
    the GEMM rate is the faster of torch's matmul and our own packed GEMM (where it runs this dtype): a floor
    below what our own kernel reaches would flatter every step measured against it."""
    device = device or torch.device("cpu")
    gpu = device.type == "cuda"
    copy_bytes, (m, k, n) = (2**30, (8192, 8192, 8192)) if gpu else (64 * 2**20, (512, 2048, 2048))
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    a = torch.randn(m, k, device=device).to(dtype)  # random, not zeros: a GPU multiplies zeros faster
    b = torch.randn(k, n, device=device).to(dtype)
    ours = None
    if not gpu and cpu.gemm_supports(dtype, k):
        ours = (a.contiguous(), cpu.pack(b.t().contiguous()))
    t_copy, t_mm = [], []
    for _ in range(tries):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        t_copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        t_mm.append(time.perf_counter() - t0)
        if ours is not None:
            t0 = time.perf_counter()
            cpu.linear(ours[0], ours[1], n, None)
            t_mm.append(time.perf_counter() - t0)
    return 2 * src.numel() / min(t_copy), 2 * m * k * n / min(t_mm)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model_dir = resolve_model(args.model)
    results = []
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        device = torch.device(args.device)
        model, cfg = load_model(model_dir, dtype, device)
        ctx = args.context
        blocks = -(-(ctx + args.prefill) // 16) * max(args.batch) + 64
        backend = "triton" if device.type == "cuda" else "torch"
        runner = ModelRunner(model, blocks, 16, 4096, dtype, device, backend)
        # GEMM weights (packed bf16 linears are not parameters any more) and the rest (norms, embeddings).
        gemm = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
        matmul_params = sum(m.in_features * m.out_features for m in gemm)
        elem = torch.empty((), dtype=dtype).element_size()
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        weight_bytes = (matmul_params + norms) * elem  # what one decode step must read (not the embedding table)
        bandwidth, flops = measure_floors(dtype, device=device)
        attn_flops_per_row = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * ctx
        row = {
            "dtype": dtype_name,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "layer_stack": "cpu_forward" if runner.cpu_forward else "cuda_graphs" if runner.cuda_graphs else "per_op",
            "bandwidth_GBps": bandwidth / 1e9,
            "gemm_GFLOPs": flops / 1e9,
            "steps": [],
        }
        for b in args.batch:
            both = time_step(runner, [ctx] * b, [1] * b, args.repeats)
            t = both["runner"]
            bw_floor = weight_bytes / bandwidth
            compute_floor = b * (2 * matmul_params + attn_flops_per_row) / flops
            floor = max(bw_floor, compute_floor)
            kv_bytes = b * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
            floor_kv = floor + kv_bytes / bandwidth
            row["steps"].append(
                {
                    "batch": b,
                    "context": ctx,
                    "ms": t * 1e3,
                    "floor_ms": floor * 1e3,
                    "x_floor": t / floor,
                    "bound": "weights" if bw_floor >= compute_floor else "compute",
                    "floor_with_kv_ms": floor_kv * 1e3,
                    "x_floor_with_kv": t / floor_kv,
                    "per_op_ms": both["per_op"] * 1e3 if "per_op" in both else None,
                }
            )
        if args.prefill:
            t = time_step(runner, [args.prefill], [args.prefill], max(2, args.repeats // 4))["runner"]
            floor = args.prefill * 2 * matmul_params / flops
            row["prefill"] = {"tokens": args.prefill, "ms": t * 1e3, "floor_ms": floor * 1e3, "x_floor": t / floor}
        if args.profile:
            for path in paths(runner):
                key = "profile_decode" if path == "runner" else f"profile_decode_{path}"
                row[key] = profile_step(runner, [ctx] * args.profile_batch, [1] * args.profile_batch, path=path)
        results.append(row)
        print_row(row)
    return results


def print_row(row: dict[str, Any]) -> None:
    print(f"{row['dtype']}: copy bandwidth {row['bandwidth_GBps']:.1f} GB/s, GEMM {row['gemm_GFLOPs']:.0f} GFLOP/s")
    for s in row["steps"]:
        print(
            f"  decode batch {s['batch']:>3} ctx {s['context']}: {s['ms']:7.2f} ms  floor {s['floor_ms']:6.2f} ms "
            f"({s['bound']})  {s['x_floor']:.2f}x floor  | +kv {s['floor_with_kv_ms']:6.2f} ms "
            f"{s['x_floor_with_kv']:.2f}x"
            + (f"  | per-op {s['per_op_ms']:7.2f} ms ({s['per_op_ms'] / s['ms']:.2f}x)" if s["per_op_ms"] else "")
        )
    if "prefill" in row:
        p = row["prefill"]
        print(f"  prefill {p['tokens']} tokens: {p['ms']:.1f} ms  floor {p['floor_ms']:.1f} ms  {p['x_floor']:.2f}x")
    for key in ("profile_decode", "profile_decode_per_op"):
        if key in row:
            prof, name = row[key], row["layer_stack"] if key == "profile_decode" else "per_op"
            print(f"  {name}: top-level ops per decode step: {prof['top_level_ops']}; counts {prof['op_counts']}")
            if "gpu_kernel_ms" in prof:
                print(
                    f"  {name}: step {prof['wall_ms']:.2f} ms, GPU kernels {prof['gpu_kernel_ms']:.2f} ms "
                    f"({prof['kernel_launches']} launches); the rest is host time (launches, Python, the profiler)"
                )
            print(f"  {name}: self-time share: {prof['self_time_share']}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama50m")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--context", type=int, default=300, help="context length of every decode row")
    p.add_argument("--prefill", type=int, default=256, help="one fresh prompt of this length (0: skip)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
