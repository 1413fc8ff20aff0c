"""Multi-LoRA's cost: decode steps mixing adapters vs the base model's, throughput with many adapters, and a cold
adapter's first request.

    python -m benchmarks.engine.bench_lora                      # SmolLM2-135M-Instruct, the engine's dtype
    python -m benchmarks.engine.bench_lora --model demo --rank 16 --adapters 8

Random PEFT adapters (every projection targeted, rank `--rank`) are written in PEFT's format. Three figures:
- step: the median forward time of a decode step at `--rows` rows, base-only on an engine without LoRA, and
  with the rows spread over 4 adapters (a LoRA engine);
- throughput: `--requests` requests, the adapters round-robin (max_loras = the number of adapters) vs the same
  requests on the base model without LoRA, output tokens per second: `--rounds` rounds taking turns, new prompts
  each round, the median of the rounds' ratios;
- cold start: time to the first token of a request whose adapter is in no slot and not in host memory (read
  from disk), beside one whose adapter is resident.
`--peers vllm` runs the throughput requests through vLLM-CPU with `enable_lora` too (benchmarks/peers/vllm_cpu.sh,
its own virtualenv), the same adapter directories and token ids. JSON and a bar plot go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common.host import describe_host
from benchmarks.common.models import resolve_model
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.lora_request import LoRARequest
from inflight.models.config import ModelConfig
from inflight.models.lora import LORA_LINEARS, module_shape
from inflight.sampling_params import SamplingParams

RESULTS = Path("benchmarks/results")
MODULES = [m for names in LORA_LINEARS.values() for m in names]


def write_adapter(cfg: ModelConfig, path: Path, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter on every projection of every layer (the files `peft` would save)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in MODULES:
            in_f, out_f = module_shape(cfg, module)
            part = "self_attn" if module in LORA_LINEARS["qkv_proj"] + ("o_proj",) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def decode_step_times(engine: LLMEngine, loras: list[str | None], steps: int) -> list[float]:
    """Forward times of `steps` decode steps once every row is past its prefill."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, name in enumerate(loras):
        engine.add_request(
            f"s{i}", list(range(100 + i, 132 + i)), params, lora_request=LoRARequest(name) if name else None
        )
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step_stats
        if stats.num_decode_seqs == len(loras) and stats.num_scheduled_tokens == len(loras) and len(times) < steps:
            times.append(stats.forward_time_s)
    return times


def throughput_prompts(n: int, prompt_len: int, run: int = 0) -> list[list[int]]:
    """`n` prompts; each `run` its own, so that no run finds another's prompts in the prefix cache."""
    return [[(7 * i + 13 * run + j) % 1000 + 10 for j in range(prompt_len)] for i in range(n)]


def throughput(engine: LLMEngine, loras: list[str | None], prompt_len: int, max_tokens: int, run: int = 0) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, (name, prompt) in enumerate(zip(loras, throughput_prompts(len(loras), prompt_len, run))):
        engine.add_request(f"t{i}-{t0}", prompt, params, lora_request=LoRARequest(name) if name else None)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t0)


def first_token_s(engine: LLMEngine, name: str) -> float:
    t0 = time.perf_counter()
    engine.add_request(
        f"c-{name}-{t0}", list(range(50, 82)), SamplingParams(max_tokens=1), lora_request=LoRARequest(name)
    )
    while engine.has_unfinished_requests():
        if any(o.new_token_ids for o in engine.step()):
            elapsed = time.perf_counter() - t0
            while engine.has_unfinished_requests():
                engine.step()
            return elapsed
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8, help="adapters for the throughput run (round-robin)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds (base, then adapters, each round)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--peers", nargs="*", default=[], choices=["vllm"])
    ap.add_argument("--vllm-timeout", type=float, default=1800)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.load(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    # "cold" is registered first: the others push it out of host memory (max_cpu_loras), so its first request
    # reads it from disk again
    names = ["cold", *(f"a{i}" for i in range(args.adapters))]
    adapters = {name: write_adapter(cfg, tmp / name, args.rank, seed=i) for i, name in enumerate(names)}
    common = dict(dtype=args.dtype, max_num_seqs=max(args.rows, 64), num_kv_blocks=1024, max_lora_rank=args.rank)

    base = LLMEngine(model_dir, EngineConfig(**common))
    dtype = str(base.dtype).removeprefix("torch.")
    n = args.adapters
    lora_args = dict(enable_lora=True, max_loras=n, max_cpu_loras=n, lora_modules=adapters)
    lora = LLMEngine(model_dir, EngineConfig(**common, **lora_args))
    four = [f"a{i % 4}" for i in range(args.rows)]
    decode_step_times(lora, four, 4)  # warm: slots seated, threads chosen
    decode_step_times(base, [None] * args.rows, 4)
    step_base, step_lora, step_lora_base = [], [], []
    for _ in range(3):  # interleaved: a slow spell of the host lands on both
        step_base += decode_step_times(base, [None] * args.rows, args.steps)
        step_lora += decode_step_times(lora, four, args.steps)
        step_lora_base += decode_step_times(lora, [None] * args.rows, args.steps)
    rr = [f"a{i % args.adapters}" for i in range(args.requests)]
    # Rounds taking turns, each with prompts of its own (no prefix-cache hits across rounds); the ratio is the
    # median of the rounds' ratios, each of two runs next to each other in time (this host drifts by ~10%).
    rounds = []
    for r in range(1, args.rounds + 1):
        b = throughput(base, [None] * args.requests, args.prompt_len, args.max_tokens, run=r)
        lo = throughput(lora, rr, args.prompt_len, args.max_tokens, run=r)
        rounds.append((b, lo))
        print(f"round {r}: base {b:.1f}, {args.adapters} adapters {lo:.1f} output tok/s", flush=True)
    tput_base = statistics.median(b for b, _ in rounds)
    tput_lora = statistics.median(lo for _, lo in rounds)
    warm = first_token_s(lora, "a0")
    cold_s = first_token_s(lora, "cold")

    med = statistics.median
    result = {
        "host": describe_host(),
        "model": args.model,
        "dtype": dtype,
        "rank": args.rank,
        "rows": args.rows,
        "step_ms": {
            "base": 1e3 * med(step_base),
            "4 adapters": 1e3 * med(step_lora),
            "base rows, LoRA engine": 1e3 * med(step_lora_base),
        },  # fmt: skip
        "step_ratio": med(step_lora) / med(step_base),
        "throughput_tok_s": {"base": tput_base, f"{args.adapters} adapters": tput_lora},
        "throughput_ratio": statistics.median(lo / b for b, lo in rounds),
        "throughput_rounds": rounds,
        "first_token_s": {"resident adapter": warm, "cold adapter": cold_s},
    }
    if "vllm" in args.peers:
        base.close(), lora.close()
        del base, lora  # vLLM's process needs the memory and the cores
        result["vllm_cpu"] = vllm_peer(args, model_dir, dtype, rr, {k: v for k, v in adapters.items() if k != "cold"})
        if "lora" in result["vllm_cpu"]:
            result["throughput_vs_vllm"] = tput_lora / result["vllm_cpu"]["lora"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"lora_{args.model}_{dtype}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    _plot(result, RESULTS / f"lora_{args.model}_{dtype}.png")
    print(f"wrote {out}")


def vllm_peer(args, model_dir: Path, dtype: str, loras: list[str], adapters: dict[str, str]) -> dict:
    """vLLM-CPU's output tokens per second on the same requests, base-only and with the adapters."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        requests = [{"prompt": p, "lora": n} for p, n in zip(throughput_prompts(len(loras), args.prompt_len), loras)]
        (Path(tmp) / "requests.json").write_text(json.dumps(requests))
        (Path(tmp) / "adapters.json").write_text(json.dumps(adapters))
        out = Path(tmp) / "vllm.json"
        files = ["--requests-file", str(Path(tmp) / "requests.json")]
        files += ["--adapters-file", str(Path(tmp) / "adapters.json")]
        command = ["bash", str(root / "benchmarks/peers/vllm_cpu.sh"), str(model_dir), *files,
                   "--max-tokens", str(args.max_tokens), "--max-lora-rank", str(args.rank), "--dtype", dtype,
                   "--out", str(out)]  # fmt: skip
        env = os.environ | {"VLLM_PEER_MODULE": "benchmarks.peers.bench_vllm_lora"}
        print("vLLM-CPU:", subprocess.list2cmdline(command), flush=True)
        try:
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            return {"unavailable": f"ran past {args.vllm_timeout:.0f} s"}
        if done.returncode != 0 or not out.is_file():
            return {"unavailable": f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"}
        return json.loads(out.read_text())


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = result["step_ms"]
    a.bar(list(steps), list(steps.values()), color=["#888", "#3a7", "#9cb"])
    a.set_ylabel("ms per decode step")
    a.set_title(f"{result['rows']} rows, rank {result['rank']} ({result['step_ratio']:.2f}x base)")
    tput = dict(result["throughput_tok_s"])
    peer = result.get("vllm_cpu", {})
    if "lora" in peer:
        tput |= {"vLLM-CPU base": peer["base"], "vLLM-CPU adapters": peer["lora"]}
    b.bar(list(tput), list(tput.values()), color=["#888", "#3a7", "#bbb", "#c96"][: len(tput)])
    b.tick_params(axis="x", labelsize=8)
    b.set_ylabel("output tokens / s")
    b.set_title(f"round-robin adapters: {result['throughput_ratio']:.2f}x base")
    fig.suptitle(f"Multi-LoRA, {result['model']} {result['dtype']} on {result['host']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
