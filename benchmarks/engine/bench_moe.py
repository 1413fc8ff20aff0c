"""Mixture-of-Experts decode steps against their floor, and the experts' op against a per-expert loop.

    python -m benchmarks.engine.bench_moe                     # moe32: 32 experts, top-4, hidden 512, fp32
    python -m benchmarks.engine.bench_moe --batch 1 8 32 --dtype bfloat16

The floor of a decode step is what it must read: every non-expert weight, the experts the step's tokens were
routed to (counted from the router's choices during the timed steps) and every row's cached K/V, at the copy
bandwidth measured here. On 2 cores a step at 32 rows may be compute-bound instead; the compute floor (2 FLOP
per multiply-add of the weights each token uses, at the GEMM rate measured here) is printed beside it, and the
larger of the two is the step's real floor. The same steps are also timed with the experts run by
`reference.fused_moe` (a torch loop over experts) op by op. Where the runner runs the layer stack as one C++
call (executor/cpu_forward.py), the steps are also timed op by op (`op by op`), the two taking turns.
Throughput beside vLLM-CPU on the same checkpoint and trace: `python -m benchmarks.engine.bench_batching
--model moe32 --peers vllm`. JSON goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common.host import describe_host
from benchmarks.common.models import resolve_model
from benchmarks.engine.bench_decode_step import measure_floors, time_step
from inflight.config import DTYPES
from inflight.executor.attention.metadata import consecutive_batch
from inflight.executor.model_runner import ModelRunner
from inflight.models.loader import load_model
from inflight.models.moe import FusedExperts, SparseMoeBlock
from inflight.ops import cpu, reference

RESULTS = Path("benchmarks/results")


class ExpertCounter:
    """Wraps the backend's fused_moe: the experts each call touched (distinct ids), summed over calls."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.inner = ops, ops.fused_moe
        self.touched = self.calls = 0

    def __call__(self, x, experts, topk_weights, topk_ids):
        self.touched += int(topk_ids.unique().numel())
        self.calls += 1
        return self.inner(x, experts, topk_weights, topk_ids)


def step_bytes(model, cfg, rows: int, context: int, dtype: torch.dtype, experts_per_layer: float) -> dict:
    elem = torch.empty((), dtype=dtype).element_size()
    stacks = [m for m in model.modules() if isinstance(m, FusedExperts)]
    per_expert = (stacks[0].w13[0].numel() + stacks[0].w2[0].numel()) * elem
    expert_params = sum(m.w13.numel() + m.w2.numel() for m in stacks)
    dense = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) - expert_params
    dense += sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "packed"))
    kv = rows * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
    return {"dense": dense * elem, "experts": experts_per_layer * len(stacks) * per_expert, "kv": kv,
            "per_expert": per_expert, "moe_layers": len(stacks)}  # fmt: skip


def time_parts(runner: ModelRunner, rows: int, context: int, repeats: int) -> dict[str, float]:
    """Median ms of a decode step's parts, each alone: the layer stack without the output layer, the output layer,
    every MoE layer's router and experts (the per-op C++ calls), every layer's attention."""
    model, cfg = runner.model, runner.model.cfg
    positions, meta, _ = consecutive_batch([context] * rows, [1] * rows, runner.block_size, runner.device)
    ids = torch.randint(0, cfg.vocab_size, (rows,))
    h = torch.randn(rows, cfg.hidden_size, dtype=model.model.norm.weight.dtype)
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    q = torch.randn(rows, cfg.num_attention_heads, cfg.head_dim, dtype=model.model.norm.weight.dtype)
    scale = cfg.head_dim**-0.5

    def experts() -> None:
        for b in blocks:
            b(h, meta, runner.ops)

    def attention() -> None:
        for k, v in runner.kv_caches:
            cpu.paged_attention(q, k, v, meta.block_tables, meta.seq_lens, scale)

    def fresh():
        return consecutive_batch([context] * rows, [1] * rows, runner.block_size, runner.device)[1]

    parts = {"layer stack": lambda: runner.forward(ids, positions, fresh()),
             "output layer": lambda: model.compute_logits(h), "routers and experts": experts,
             "attention": attention}  # fmt: skip
    out = {}
    with torch.inference_mode():
        for name, fn in parts.items():
            for _ in range(2):
                fn()
            seconds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - t0)
            out[name] = float(np.median(seconds)) * 1e3
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moe32")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--parts", action="store_true", help="also time a step's parts alone at each batch")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    model, cfg = load_model(resolve_model(args.model), dtype, "cpu")
    moe = cfg.hf_config
    blocks = -(-(args.context + 1) // 16) * max(args.batch) + 64
    runner = ModelRunner(model, blocks, 16, 4096, dtype, torch.device("cpu"), "torch")
    counter = ExpertCounter(runner.ops)
    runner.ops.fused_moe = counter
    bandwidth, flops = measure_floors(dtype)
    # Multiply-adds a token makes: attention projections, its k experts, the router, the output layer
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    active = cfg.num_hidden_layers * (attn + moe["num_experts_per_tok"] * 3 * h * moe["moe_intermediate_size"])
    active += cfg.num_hidden_layers * h * moe["num_experts"] + h * cfg.vocab_size
    result = {"host": describe_host(), "model": args.model, "dtype": args.dtype, "context": args.context,
              "bandwidth_GBps": bandwidth / 1e9, "gemm_GFLOPs": flops / 1e9, "steps": []}  # fmt: skip
    print(f"{describe_host()}: copy {bandwidth / 1e9:.1f} GB/s, GEMM {flops / 1e9:.0f} GFLOP/s, {args.dtype}")
    for rows in args.batch:
        counter.touched = counter.calls = 0
        times = time_step(runner, [args.context] * rows, [1] * rows, args.repeats)
        t, t_per_op = times["runner"], times.get("per_op")
        touched = counter.touched / max(1, counter.calls)
        b = step_bytes(model, cfg, rows, args.context, dtype, touched)
        bw_floor = (b["dense"] + b["experts"] + b["kv"]) / bandwidth
        attn_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * d * args.context
        compute_floor = rows * (2 * active + attn_flops) / flops
        runner.ops.fused_moe = lambda x, e, w, i: reference.fused_moe(x, e.w13, e.w2, w, i)
        loop_times = time_step(runner, [args.context] * rows, [1] * rows, max(2, args.repeats // 2))
        t_loop = loop_times.get("per_op", loop_times["runner"])  # the one-call stack never calls ops.fused_moe
        runner.ops.fused_moe = counter
        step = {"rows": rows, "ms": t * 1e3, "experts_touched_per_layer": touched,
                "floor_bytes_ms": bw_floor * 1e3, "x_floor_bytes": t / bw_floor,
                "floor_compute_ms": compute_floor * 1e3, "x_floor": t / max(bw_floor, compute_floor),
                "per_op_ms": None if t_per_op is None else t_per_op * 1e3,
                "torch_loop_ms": t_loop * 1e3, "vs_torch_loop": t_loop / t}  # fmt: skip
        if args.parts:
            step["parts_ms"] = time_parts(runner, rows, args.context, args.repeats)
            print("        parts alone: " + ", ".join(f"{k} {v:.2f} ms" for k, v in step["parts_ms"].items()))
        result["steps"].append(step)
        print(f"  {rows:>3} rows: {t * 1e3:7.2f} ms | {touched:4.1f} experts/layer, bytes floor "
              f"{bw_floor * 1e3:6.2f} ms ({t / bw_floor:.2f}x), compute floor {compute_floor * 1e3:6.2f} ms, "
              f"{step['x_floor']:.2f}x the larger | torch loop {t_loop * 1e3:7.2f} ms ({t_loop / t:.2f}x)"
              + ("" if t_per_op is None else f" | op by op {t_per_op * 1e3:7.2f} ms ({t_per_op / t:.2f}x)")
        )  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"moe_{args.model}_{args.dtype}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
