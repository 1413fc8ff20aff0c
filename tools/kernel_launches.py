"""Which Triton kernel specializations the engine launches: recorded from interpreter runs.

`record_launches()` swaps each `@triton.jit` kernel of `inflight.ops.triton` for a thin recorder that
notes how it was launched (Triton's own argument specialization for a CUDA target: pointer dtypes,
16-divisibility of pointers and integers, constexpr values, num_warps/num_stages) and then runs it
as before. `capture_engine_launches` drives the offline `LLM` through the Triton backend on a
scenario with prefill chunks, decode, mixed steps and a split-K decode; `geometry_checkpoint` writes
1-layer checkpoints with real models' attention geometry for the same run.

Runs only with `TRITON_INTERPRET=1` on a CPU (set before triton is imported); the specs it returns
are compiled for GPU targets by `tools.kernel_resources` in a process without the interpreter.
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# module -> the jit kernels it launches (helpers called from inside kernels are compiled with them)
KERNELS = {
    "inflight.ops.triton.paged_attention": ["_unified_attention_kernel"],
    "inflight.ops.triton.split_k_decode": ["_merge_kernel"],
    "inflight.ops.triton.kv_write": ["_kv_write_kernel"],
    "inflight.ops.triton.rms_norm": ["_rms_norm_kernel"],
    "inflight.ops.triton.rope": ["_rope_kernel"],
    "inflight.ops.triton.gguf_gemm": ["_gguf_gemv_kernel", "_gguf_gemm_kernel", "_gguf_embedding_kernel"],
    "inflight.ops.triton.lora": ["_lora_shrink_kernel", "_lora_expand_kernel"],
    "inflight.ops.triton.fused_moe": ["_fused_moe_kernel"],
}
# Triton's launch defaults (CUDAOptions) when a launch does not name them.
DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES = 4, 3

# Real models' attention geometry, 1 layer and a small MLP (the kernels never see the MLP).
GEOMETRIES: dict[str, dict[str, Any]] = {
    # Llama-3-8B: hidden 4096, 32 query heads over 8 KV heads (GQA 4), head_dim 128.
    "llama3_8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 500000.0,
    },
    # Qwen2-style (qkv bias), head_dim 80 -> padded to 128 in the kernels, GQA 3.
    "qwen2_hd80": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 960,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 80,
        "attention_bias": True,
        "rope_theta": 1000000.0,
    },
}


@dataclass
class Launch:
    """One kernel launch as Triton would specialize it for a CUDA device."""

    kernel: str  # "module:function"
    params: list[list[Any]]  # [name, type, attr-or-constexpr-value] per parameter, in order
    num_warps: int
    num_stages: int
    grid: list[int]
    tags: list[str] = field(default_factory=list)  # the scenario(s) that launched it

    def spec_key(self) -> str:
        """Launches with the same key compile to the same binary."""
        return json.dumps([self.kernel, self.params, self.num_warps, self.num_stages])


@dataclass
class LaunchLog:
    launches: list[Launch] = field(default_factory=list)
    # per attention launch: rows its programs compute vs rows holding a real (token, head) pair
    attention_rows: list[dict[str, int]] = field(default_factory=list)


class _Recorder:
    """Stands in for a jit kernel: `kernel[grid](*args, **kwargs)` records, then launches."""

    def __init__(self, kernel: Any, qualname: str, log: LaunchLog) -> None:
        self.kernel, self.qualname, self.log = kernel, qualname, log
        self.signature = inspect.signature(getattr(kernel, "fn", kernel))
        self.do_not_specialize = set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or [])

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = self.signature.bind(*args, **kwargs).arguments
            self.log.launches.append(self._describe(grid, bound, options))
            if self.qualname.endswith(":_unified_attention_kernel"):
                self.log.attention_rows.append(_attention_rows(bound, num_kv_heads=grid[1]))
            return self.kernel[grid](*args, **kwargs, **options)

        return launch

    def _describe(self, grid, bound: dict[str, Any], options: dict[str, int]) -> Launch:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        params = []
        for i, (name, param) in enumerate(self.signature.parameters.items()):
            value = bound[name]
            if "constexpr" in str(param.annotation):
                params.append([name, "constexpr", value])
            else:  # exactly what JITFunction.run does for a CUDA device
                specialize = name not in self.do_not_specialize and i not in self.do_not_specialize
                params.append([name, *native_specialize_impl(CUDABackend, value, False, specialize, True)])
        return Launch(
            kernel=self.qualname,
            params=params,
            num_warps=options.get("num_warps", DEFAULT_NUM_WARPS),
            num_stages=options.get("num_stages", DEFAULT_NUM_STAGES),
            grid=[int(g) for g in grid],
        )


def _attention_rows(bound: dict[str, Any], num_kv_heads: int) -> dict[str, Any]:
    qsl = bound["query_start_loc_ptr"].tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    tile_seq, tile_q = bound["tile_seq_ptr"].tolist(), bound["tile_q_ptr"].tolist()
    block_q, group, group_pad = bound["BLOCK_Q"], bound["GROUP"], bound["GROUP_PAD"]
    real = sum(min(block_q, q_lens[s] - q0) for s, q0 in zip(tile_seq, tile_q)) * group
    return {
        "step": (tuple(qsl), tuple(bound["seq_lens_ptr"].tolist())),  # the same for one step's launches
        "block_q": block_q,
        "block_m": block_q * group_pad,
        "decode_seqs": sum(q == 1 for q in q_lens),
        "prefill_seqs": sum(q > 1 for q in q_lens),
        "tiles": len(tile_seq),
        "decode_tiles": sum(q_lens[s] == 1 for s in tile_seq),
        "rows": len(tile_seq) * block_q * group_pad * num_kv_heads,
        "real_rows": real * num_kv_heads,
    }


@contextmanager
def record_launches() -> Iterator[LaunchLog]:
    """Records every launch of the `inflight.ops.triton` kernels inside the block (interpreter only)."""
    import importlib

    import triton

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("record_launches needs TRITON_INTERPRET=1 set before triton is imported")
    log = LaunchLog()
    saved = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            kernel = getattr(module, name)
            saved.append((module, name, kernel))
            setattr(module, name, _Recorder(kernel, f"{module_name}:{name}", log))
    try:
        yield log
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def rows_per_step(log: LaunchLog) -> list[dict[str, int]]:
    """Attention rows computed vs real, summed over each step's launches (consecutive launches with
    the same batch are one step: its layers and, in a mixed step, its decode and prefill launches)."""
    steps: list[dict[str, Any]] = []
    for r in log.attention_rows:
        if not steps or steps[-1]["step"] != r["step"]:
            steps.append(
                {
                    "step": r["step"],
                    "decode_seqs": r["decode_seqs"],
                    "prefill_seqs": r["prefill_seqs"],
                    "rows": 0,
                    "real_rows": 0,
                }
            )
        steps[-1]["rows"] += r["rows"]
        steps[-1]["real_rows"] += r["real_rows"]
    return [{k: v for k, v in s.items() if k != "step"} for s in steps]


def geometry_checkpoint(name: str, template_dir: str | Path, out_dir: str | Path) -> Path:
    """A 1-layer checkpoint with GEOMETRIES[name]'s attention ("demo": the template's own) and the
    template's tokenizer. Every layer launches the same kernels, so one layer captures them all."""
    import torch
    from safetensors.torch import save_file

    from inflight.demo_model import build_weights

    template, out = Path(template_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(template / f, out / f)
    cfg = json.loads((template / "config.json").read_text())
    cfg |= GEOMETRIES.get(name, {}) | {"num_hidden_layers": 1, "intermediate_size": 64}
    weights = build_weights(cfg)
    if cfg.get("attention_bias"):
        d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for proj, heads in (("q", nq), ("k", nkv), ("v", nkv)):
            weights[f"model.layers.0.self_attn.{proj}_proj.bias"] = 0.01 * torch.ones(heads * d)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


SCENARIO_PROMPTS = [
    "The model runs fast",
    "Why",
    "A city of light and music, a river under the mountain",
    " ".join(["kernels keep the cache warm"] * 8),
]


def capture_engine_launches(model_dir: str | Path, dtype: str) -> LaunchLog:
    """Runs the engine through the Triton backend and records every kernel launch.

    Steps of 16 tokens: the long prompts are prefilled in chunks that share steps with the short
    prompts' decode tokens (mixed steps), then decode-only steps. A second batch decodes with split-K:
    the engine splits contexts of >= 2 x MIN_TOKENS_PER_SPLIT (1024) tokens; a lowered threshold takes
    the same kernels (split count is a grid dimension) without interpreting a 512-token prefill.
    """
    import inflight.ops.triton.split_k_decode as split_k
    from inflight import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with record_launches() as log:
        llm = LLM(
            model_dir,
            attention_backend="triton",
            dtype=dtype,
            block_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            num_kv_blocks=32,
            max_model_len=128,
        )
        llm.generate(SCENARIO_PROMPTS, params, use_tqdm=False)
        saved = split_k.MIN_TOKENS_PER_SPLIT
        split_k.MIN_TOKENS_PER_SPLIT = 2
        try:
            llm.generate(SCENARIO_PROMPTS[:2], params, use_tqdm=False)
        finally:
            split_k.MIN_TOKENS_PER_SPLIT = saved
    return log


def capture_gguf_launches(dtype: str) -> LaunchLog:
    """Every GGUF block format through the GEMV (decode rows), the GEMM (prefill rows) and the embedding
    gather. The kernels do not specialize on shapes, so one small layer per format gives every binary;
    the blocks are random bytes under 64, which keeps every fp16 scale finite (the results are not looked at)."""
    import torch

    from inflight.ops.triton import gguf_gemm

    gen = torch.Generator().manual_seed(0)
    out_features, in_features = 48, 512
    with record_launches() as log:
        for qtype, (per_block, block_bytes, _) in gguf_gemm.BLOCK_LAYOUT.items():
            shape = (out_features, in_features // per_block * block_bytes)
            raw = torch.randint(0, 64, shape, generator=gen, dtype=torch.uint8)
            for rows in (1, gguf_gemm.GEMV_MAX_ROWS + 1):
                x = torch.randn(rows, in_features, generator=gen).to(getattr(torch, dtype))
                gguf_gemm.gguf_matmul(x, raw, qtype, out_features)
            gguf_gemm.gguf_embedding(torch.tensor([3, 0, 3]), raw, qtype, in_features, getattr(torch, dtype))
    return log


def capture_lora_launches(dtype: str) -> LaunchLog:
    """The LoRA shrink and expand with the decode and the prefill row tile, for a rank under 16 (one 16-wide
    rank tile, not 16-divisible) and the largest rank (the widest rank tiles), on a 3-slice and a 1-slice
    linear. Block sizes depend only on the step's token count and the rank, so small linears give every
    binary up to Triton's 16-divisibility of sizes and strides (the sizes here are 16-divisible, as real
    models' are)."""
    import torch

    from inflight.models.lora import LoRASlots
    from inflight.ops.triton import lora

    gen = torch.Generator().manual_seed(0)
    in_features, max_loras = 64, 2
    with record_launches() as log:
        for rank, slices in ((8, (32, 16, 16)), (512, (32,))):
            slots = LoRASlots.empty(slices, in_features, max_loras, rank, torch.device("cpu"))
            for tokens in (3, lora.DECODE_MAX_TOKENS + 1):
                x = torch.randn(tokens, in_features, generator=gen).to(getattr(torch, dtype))
                out = torch.zeros(tokens, sum(slices), dtype=x.dtype)
                token_slots = torch.arange(tokens, dtype=torch.int32) % (max_loras + 1) - 1
                lora.lora_apply(out, x, slots.a, slots.b, slots.offsets, token_slots)
    return log


def moe_capture_configs(dtype: str) -> list:
    """Every block-size config `fused_moe.get_config` can pick for `dtype`, on any device."""
    from inflight.ops.triton import fused_moe

    if dtype == "float32":
        return [fused_moe.FP32_CONFIG]
    return list(dict.fromkeys([fused_moe.DEFAULT_CONFIG, *fused_moe.CONFIGS.values()]))


def capture_moe_launches(dtype: str) -> LaunchLog:
    """The fused-MoE kernel's two GEMMs (gate/up, and down with the routing weight) with every config the
    table holds for `dtype`. The kernel specializes on no per-step value (token count, top-k, M-blocks), so one
    small layer per config gives every binary; its sizes are 16-divisible, as real models' are."""
    import torch

    from inflight.ops import reference
    from inflight.ops.triton import fused_moe

    gen = torch.Generator().manual_seed(0)
    num_experts, top_k, hidden, inter, tokens = 4, 2, 64, 32, 5
    torch_dtype = getattr(torch, dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen).to(torch_dtype)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen).to(torch_dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(torch_dtype)
    topk_weights, topk_ids = reference.select_experts(torch.randn(tokens, num_experts, generator=gen), top_k, True)
    with record_launches() as log:
        for config in moe_capture_configs(dtype):
            fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, config)
    return log


def with_merge_widths(specs: list[Launch]) -> list[Launch]:
    """Adds the merge kernel for every split count the engine can pick (SPLITS_PAD = next power of
    two of 2..MAX_SPLITS): which one a step takes depends on batch size and context length."""
    from inflight.ops.triton.split_k_decode import MAX_SPLITS

    out = list(specs)
    for spec in specs:
        if not spec.kernel.endswith(":_merge_kernel"):
            continue
        for pad in (2**i for i in range(1, (MAX_SPLITS - 1).bit_length() + 1)):
            params = [[n, k, pad if n == "SPLITS_PAD" else a] for n, k, a in spec.params]
            out.append(Launch(spec.kernel, params, spec.num_warps, spec.num_stages, spec.grid, list(spec.tags)))
    return out


def with_sliding_window(specs: list[Launch]) -> list[Launch]:
    """Adds each attention launch's sliding-window twin (SLIDING=True): a model with a window launches the
    same shapes with that binary; the window itself is a runtime argument that is not specialized."""
    out = list(specs)
    for spec in specs:
        if spec.kernel.endswith(":_unified_attention_kernel"):
            params = [[n, k, True if n == "SLIDING" else a] for n, k, a in spec.params]
            out.append(Launch(spec.kernel, params, spec.num_warps, spec.num_stages, spec.grid, list(spec.tags)))
    return out


def unique_specs(launches: list[Launch], tag: str) -> list[Launch]:
    out: dict[str, Launch] = {}
    for launch in launches:
        spec = out.setdefault(launch.spec_key(), launch)
        if tag not in spec.tags:
            spec.tags.append(tag)
    return list(out.values())


def dump(specs: list[Launch], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(s) for s in specs], indent=1))


def load(path: str | Path) -> list[Launch]:
    return [Launch(**d) for d in json.loads(Path(path).read_text())]


def as_dtype(spec: Launch, src: str, dst: str) -> Launch:
    """The same launch with `src` tensors as `dst` (e.g. fp16 -> bf16): the launch code branches on
    dtype only for float32, so a bf16 run launches exactly its fp16 run's kernels with bf16 pointers."""
    params = [[n, f"*{dst}" if kind == f"*{src}" else kind, a] for n, kind, a in spec.params]
    tags = [t.replace(src, dst) for t in spec.tags]
    return Launch(spec.kernel, params, spec.num_warps, spec.num_stages, spec.grid, tags)


# The GGUF, LoRA and MoE kernels' runs (tagged "gguf/<dtype>", "lora/<dtype>", "moe/<dtype>"), bfloat16
# derived from float16 as for the engine runs.
GGUF_CAPTURE_DTYPES = ["float32", "float16"]
LORA_CAPTURE_DTYPES = ["float32", "float16"]
MOE_CAPTURE_DTYPES = ["float32", "float16"]

# (checkpoint, dtype) runs: the demo model in float32 (its checkpoint dtype, what `make serve` runs on
# a GPU) and float16; the real geometries in float16. bfloat16 is derived from float16 (the
# interpreter computes garbage in bf16, and the launches do not depend on it).
CAPTURE_RUNS = [("demo", "float32"), ("demo", "float16"), ("llama3_8b", "float16"), ("qwen2_hd80", "float16")]


def capture_all(work_dir: str | Path, demo_dir: str | Path | None = None) -> tuple[list[Launch], dict[str, LaunchLog]]:
    """Every specialization of CAPTURE_RUNS, GGUF_CAPTURE_DTYPES, LORA_CAPTURE_DTYPES and MOE_CAPTURE_DTYPES plus
    their bf16 twins (and the attention's sliding-window twins), tagged "<model>/<dtype>", and each run's launch log."""
    from inflight.demo_model import ensure_demo_model

    work = Path(work_dir)
    demo = Path(demo_dir) if demo_dir else ensure_demo_model(work / "demo")
    specs: dict[str, Launch] = {}
    logs: dict[str, LaunchLog] = {}
    runs = (
        CAPTURE_RUNS
        + [("gguf", d) for d in GGUF_CAPTURE_DTYPES]
        + [("lora", d) for d in LORA_CAPTURE_DTYPES]
        + [("moe", d) for d in MOE_CAPTURE_DTYPES]
    )
    for model, dtype in runs:
        short = {"float32": "fp32", "float16": "fp16"}[dtype]
        if model == "gguf":
            log = logs[f"{model}/{short}"] = capture_gguf_launches(dtype)
        elif model == "lora":
            log = logs[f"{model}/{short}"] = capture_lora_launches(dtype)
        elif model == "moe":
            log = logs[f"{model}/{short}"] = capture_moe_launches(dtype)
        else:
            model_dir = geometry_checkpoint(model, demo, work / f"1layer-{model}")
            log = logs[f"{model}/{short}"] = capture_engine_launches(model_dir, dtype)
        runs = [unique_specs(with_sliding_window(with_merge_widths(log.launches)), f"{model}/{short}")]
        if short == "fp16":
            runs.append([as_dtype(s, "fp16", "bf16") for s in runs[0]])
        for spec in (s for run in runs for s in run):
            kept = specs.setdefault(spec.spec_key(), spec)
            kept.tags = sorted(set(kept.tags) | set(spec.tags))
    return list(specs.values()), logs


def main(argv: list[str] | None = None) -> None:
    """Prints attention rows computed vs real per step of the demo scenario (the launch log); with
    --capture-all DIR, records every run instead: DIR/specs.json (what `kernel_resources --specs` compiles)
    and DIR/attention_rows.json (each run's attention launches)."""
    import argparse
    import os
    import tempfile

    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default="demo", choices=["demo", *GEOMETRIES])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--capture-all", metavar="DIR", type=Path, help="record every run of CAPTURE_RUNS into DIR")
    args = parser.parse_args(argv)
    from inflight.demo_model import ensure_demo_model

    if args.capture_all:
        args.capture_all.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as work:
            specs, logs = capture_all(work)
        dump(specs, args.capture_all / "specs.json")
        rows = {run: log.attention_rows for run, log in logs.items() if log.attention_rows}
        (args.capture_all / "attention_rows.json").write_text(json.dumps(rows))
        print(f"{len(specs)} specializations from {len(logs)} runs -> {args.capture_all}")
        return
    with tempfile.TemporaryDirectory() as work:
        model_dir = geometry_checkpoint(args.model, ensure_demo_model(Path(work) / "demo"), Path(work) / "model")
        steps = rows_per_step(capture_engine_launches(model_dir, args.dtype))
    print("| step | decode seqs | prefill seqs | rows computed | real rows | wasted |")
    print("|---|---|---|---|---|---|")
    for i, s in enumerate(steps):
        wasted = s["rows"] - s["real_rows"]
        print(f"| {i} | {s['decode_seqs']} | {s['prefill_seqs']} | {s['rows']} | {s['real_rows']} | {wasted} |")
    mixed = [s for s in steps if s["decode_seqs"] and s["prefill_seqs"]]
    print(
        f"mixed steps: {len(mixed)}, wasted rows per mixed step: "
        f"{sum(s['rows'] - s['real_rows'] for s in mixed) / max(1, len(mixed)):.0f}"
    )


if __name__ == "__main__":
    main()
