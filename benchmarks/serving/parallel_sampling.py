"""`n` choices of one prompt vs n separate requests, through the OpenAI port of a real tritonserver.

    python -m benchmarks.serving.parallel_sampling                  # SmolLM2 (the default model), ~5 min on 2 cores
    python -m benchmarks.serving.parallel_sampling --prompts 8 --prompt-words 300 --n 4 --rounds 2

The same work both ways: `--prompts` prompts of ~`--prompt-words` words, `--n` samples each of `--max-tokens`
tokens (temperature 1, a seed per sample), all sent at once: one `n` request per prompt, or n single requests
per prompt with the seeds `n` derives (seed + j). Rounds alternate the two. Figures: output tokens per second
(client clock) and the prompt tokens the prefix cache served (the server's counter), per mode; JSON and a bar
plot go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx2 as httpx

from benchmarks.common.host import describe_host
from benchmarks.common.plots import throughput_bars
from inflight.launcher.server import TritonServer
from inflight.serving.openai import OpenAIServer
from inflight.serving.prometheus_text import scrape

RESULTS = Path("benchmarks/results")
_WORDS = "the model runs fast while a city of light sings under the mountain and the river keeps the queue".split()  # noqa: SIM905


def make_prompts(count: int, words: int) -> list[str]:
    rng = random.Random(0)
    return [f"Story {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(count)]


async def run(url: str, prompts: list[str], n: int, max_tokens: int, together: bool) -> int:
    """Output tokens of one round: an `n` request per prompt (`together`), or n single requests per prompt."""
    body = {"model": "llm", "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=1800) as client:

        async def one(prompt: str, seed: int, k: int) -> int:
            answer = await client.post(f"{url}/v1/completions", json=body | {"prompt": prompt, "seed": seed, "n": k})
            answer.raise_for_status()
            return answer.json()["usage"]["completion_tokens"]

        if together:
            jobs = [one(p, 1000 * i, n) for i, p in enumerate(prompts)]
        else:
            jobs = [one(p, 1000 * i + j, 1) for i, p in enumerate(prompts) for j in range(n)]
        return sum(await asyncio.gather(*jobs))


def cache_hits(server: TritonServer) -> float:
    samples = scrape(server.metrics_url, timeout_s=10)
    return sum(v for (name, _), v in samples.items() if name == "vllm:prefix_cache_hits_total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct, the default model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    parameters = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 2048}
    if args.model:
        parameters["model"] = args.model
    prompts = make_prompts(args.prompts, args.prompt_words)
    rates: dict[str, list[float]] = {"n": [], "separate": []}
    hits: dict[str, float] = {"n": 0.0, "separate": 0.0}
    with TritonServer(parameters=parameters, http_port=0, grpc_port=0, metrics_port=0) as server:
        server.wait_ready(timeout_s=600)
        with OpenAIServer(server.grpc_url, port=0) as api:
            asyncio.run(run(api.url, make_prompts(2, 20), 2, 4, True))  # warm
            for r in range(args.rounds):
                for mode in ("n", "separate") if r % 2 == 0 else ("separate", "n"):
                    # a round's prompts differ from every other round's: no prefix hits across rounds
                    batch = [f"Round {r} {mode}. {p}" for p in prompts]
                    before = cache_hits(server)
                    t0 = time.perf_counter()
                    tokens = asyncio.run(run(api.url, batch, args.n, args.max_tokens, mode == "n"))
                    rates[mode].append(tokens / (time.perf_counter() - t0))
                    hits[mode] += cache_hits(server) - before
                    print(f"round {r} {mode}: {rates[mode][-1]:.1f} output tok/s", flush=True)
    best = {mode: max(v) for mode, v in rates.items()}
    result = {
        "host": describe_host(),
        "model": args.model or "SmolLM2-135M-Instruct (default GGUF)",
        "prompts": args.prompts,
        "prompt_words": args.prompt_words,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "output_tok_s": rates,
        "best_output_tok_s": best,
        "ratio_n_vs_separate": best["n"] / best["separate"],
        "prefix_cache_hit_tokens_per_round": {m: hits[m] / args.rounds for m in hits},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "parallel_sampling.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    throughput_bars({f"n={args.n} requests": best["n"], f"{args.n}x single requests": best["separate"]},
                    RESULTS / "parallel_sampling.png")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
