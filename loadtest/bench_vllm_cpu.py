"""Run 7: vLLM on CPU over the benchmark's trace. Runs inside the virtualenv `vllm_cpu.sh` makes, where
inflight is not installed: only numpy-level helpers of loadtest are imported.

Writes a run summary in the benchmark's shape; `bench_batching --vllm-result FILE` adds it to the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loadtest.metrics import RunResult, summarize
from loadtest.trace import TraceSpec, make_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 512))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=Path("loadtest/results/vllm_cpu.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = parse_args(argv)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    spec = TraceSpec(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=args.seed)
    trace = make_trace(spec, vocab)
    llm = LLM(
        model=str(args.model_dir),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len[1] + args.output_len[1],
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in trace]
    params = [
        SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        for r in trace
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    run = RunResult(
        name="vllm-cpu",
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        wall_s=wall,
        ttft_s=[],  # offline generate() returns whole requests; no per-request timing comparable to ours
        latency_s=[],
        max_num_seqs=args.max_num_seqs,
        note=f"vLLM CPU, {args.dtype}, offline LLM.generate, all requests at t = 0",
    )
    summary = summarize(run) | {"trace": {"num_requests": len(trace), "seed": args.seed}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"vllm-cpu: {run.output_tokens} tokens in {wall:.1f} s = {run.tokens_per_s:.0f} tok/s -> {args.out}")
    return summary


if __name__ == "__main__":  # vLLM's CPU workers are spawned processes that re-import this module
    main()
