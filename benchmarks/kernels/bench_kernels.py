"""Kernel benchmark: achieved memory bandwidth of the Triton kernels vs torch baselines (CUDA only).

Decode attention is memory-bound: each step streams every sequence's K and V once, so the figure of
merit is bytes moved / time against the device's HBM peak. The sweep uses Llama-3-8B's attention
geometry (32 query heads, 8 KV heads, head_dim 128, block_size 16) at batch 1..256 and context
512..8k, one layer. Baselines: the torch path a paged cache forces (gather the blocks, then SDPA)
and SDPA over already-dense KV (what a contiguous cache would cost).

    python -m benchmarks.kernels.bench_kernels                      # full sweep, fp16
    python -m benchmarks.kernels.bench_kernels --batches 1 32 --contexts 2048 --json out.json
    python -m benchmarks.kernels.bench_kernels --smoke              # tiny shapes; checks the script on a CPU

Timings use triton.testing.do_bench (L2 flushed between runs). Targets: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

# Peak HBM bandwidth in GB/s by device name, where the driver's clock x bus width misleads.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "L40S": 864.0,
    "A10": 600.0,
    "L4": 300.0,
}
HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B attention


@dataclass
class Row:
    kernel: str
    shape: str
    triton_ms: float
    torch_ms: float
    gbps: float
    pct_peak: float
    note: str = ""


def peak_gbps(torch, override: float | None) -> float:
    if override:
        return override
    props = torch.cuda.get_device_properties(0)
    for name, gbps in PEAK_GBPS.items():
        if name in props.name:
            return gbps
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    sys.exit(f"unknown peak bandwidth for {props.name!r}: pass --peak-gbps")


def make_timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    if smoke:

        def once(fn):  # the interpreter's time means nothing; run once to exercise the code path
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return once
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=100)


def bench_decode(torch, dtype, device, batch: int, ctx: int, peak: float, timer) -> Row:
    from inflight.ops.triton.paged_attention import paged_attention, plan_attention

    elem = torch.empty((), dtype=dtype).element_size()
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    query = torch.randn(batch, HQ, HEAD_DIM, dtype=dtype, device=device)
    qsl_np = np.arange(batch + 1, dtype=np.int32)
    seq_lens_np = np.full(batch, ctx, dtype=np.int32)
    qsl, seq_lens = torch.from_numpy(qsl_np).to(device), torch.from_numpy(seq_lens_np).to(device)
    scale = HEAD_DIM**-0.5
    plan = plan_attention(qsl_np, seq_lens_np, HQ, HKV, query.device)
    single = plan_attention(qsl_np, seq_lens_np, HQ, HKV, query.device, num_splits=1)

    def triton_fn(plan=plan):
        return paged_attention(query, k_cache, v_cache, qsl, seq_lens, block_tables, scale, plan)

    def gathered_kv():  # what a torch path over a paged cache has to do first
        k = k_cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
        return k, v

    def sdpa(k, v):
        q = query[:, :, None, :]  # [B, Hq, 1, D]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    dense_k, dense_v = (t.contiguous() for t in gathered_kv())
    torch.testing.assert_close(triton_fn(), sdpa(dense_k, dense_v)[:, :, 0], atol=2e-2, rtol=2e-2)

    t_triton = timer(triton_fn)
    t_paged_torch = timer(lambda: sdpa(*gathered_kv()))
    note = f"dense-KV sdpa {timer(lambda: sdpa(dense_k, dense_v)):.3f} ms"
    if plan.num_splits > 1:
        note += f"; split-K x{plan.num_splits} (1-pass {timer(lambda: triton_fn(single)):.3f} ms)"
    moved = 2 * batch * ctx * HKV * HEAD_DIM * elem + 2 * query.numel() * elem + block_tables.numel() * 4
    gbps = moved / (t_triton * 1e-3) / 1e9
    return Row("decode_attention", f"B={batch} ctx={ctx}", t_triton, t_paged_torch, gbps, 100 * gbps / peak, note)


def bench_pointwise(torch, dtype, device, tokens: int, peak: float, timer) -> list[Row]:
    from inflight.executor.attention import TorchBackend
    from inflight.ops.triton.kv_write import write_kv
    from inflight.ops.triton.rms_norm import fused_add_rms_norm
    from inflight.ops.triton.rope import rotary_embedding

    ref = TorchBackend()
    elem = torch.empty((), dtype=dtype).element_size()
    hidden = HQ * HEAD_DIM
    rows = []

    def row(kernel: str, shape: str, t_tri: float, t_ref: float, moved: int) -> Row:
        gbps = moved / (t_tri * 1e-3) / 1e9
        return Row(kernel, shape, t_tri, t_ref, gbps, 100 * gbps / peak)

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    t_tri = timer(lambda: fused_add_rms_norm(x, residual, weight, 1e-5))
    t_ref = timer(lambda: ref.fused_add_rms_norm(x, residual, weight, 1e-5))
    # read x and residual, write the output and the new residual
    rows.append(row("fused_add_rms_norm", f"T={tokens} H={hidden}", t_tri, t_ref, 4 * x.numel() * elem))

    q = torch.randn(tokens, HQ, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(tokens, HKV, HEAD_DIM, dtype=dtype, device=device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    cos = torch.randn(8192, HEAD_DIM // 2, device=device)
    sin = torch.randn_like(cos)
    t_tri = timer(lambda: rotary_embedding(q, k, positions, cos, sin))
    t_ref = timer(lambda: ref.rope(q, k, positions, (cos, sin)))
    moved = 2 * (q.numel() + k.numel()) * elem + tokens * HEAD_DIM * 4  # q, k in and out; cos/sin rows
    rows.append(row("rope", f"T={tokens}", t_tri, t_ref, moved))

    num_blocks = -(-tokens // BLOCK_SIZE) * 4
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:tokens]
    t_tri = timer(lambda: write_kv(k, k, k_cache, v_cache, slots))
    t_ref = timer(lambda: ref.write_kv(k, k, k_cache, v_cache, slots))
    rows.append(row("kv_write", f"T={tokens}", t_tri, t_ref, 4 * k.numel() * elem))  # read K, V; write both
    return rows


def print_table(rows: list[Row], device_name: str, peak: float) -> None:
    print(f"device: {device_name}   HBM peak: {peak:.0f} GB/s")
    head = f"{'kernel':<20}{'shape':<22}{'triton ms':>10}{'torch ms':>10}{'speedup':>9}{'GB/s':>9}{'% peak':>8}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.kernel:<20}{r.shape:<22}{r.triton_ms:>10.3f}{r.torch_ms:>10.3f}{r.torch_ms / r.triton_ms:>8.2f}x"
            f"{r.gbps:>9.0f}{r.pct_peak:>7.1f}%  {r.note}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 4096], help="for norm/rope/kv_write")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--peak-gbps", type=float, help="override the device's HBM peak")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on a CPU")
    args = parser.parse_args(argv)

    import torch

    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.batches, args.contexts, args.tokens, args.dtype = [1, 2], [48, 600], [5], "float16"
        device, device_name, peak = torch.device("cpu"), "cpu (interpreter; timings meaningless)", 1.0
    elif not torch.cuda.is_available():
        sys.exit(
            "bench_kernels measures GPU memory bandwidth and needs a CUDA device; none is visible here. "
            "Run it on a GPU machine (see docs/BENCHMARKS.md), or pass --smoke to check the script on a CPU."
        )
    else:
        device, device_name = torch.device("cuda"), torch.cuda.get_device_name(0)
        peak = peak_gbps(torch, args.peak_gbps)
    dtype = getattr(torch, args.dtype)
    timer = make_timer(args.smoke)
    torch.manual_seed(0)

    rows = [bench_decode(torch, dtype, device, b, c, peak, timer) for c in args.contexts for b in args.batches]
    for tokens in args.tokens:
        rows += bench_pointwise(torch, dtype, device, tokens, peak, timer)
    print_table(rows, device_name, peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": device_name, "peak_gbps": peak, "dtype": args.dtype, "rows": [asdict(r) for r in rows]},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
