"""Host time of the runner's prepare() (step tensors) and of the sampler, per engine step (demo model by default).

    python -m benchmarks.engine.bench_prepare --num-seqs 32 256
    python -m benchmarks.engine.bench_prepare --model smollm2 --params sampled --num-seqs 32   # a 49k vocabulary

Each run admits N requests (random prompts of --prompt-len tokens; --params mixed: half greedy, half sampled
with top-p/top-k and a repetition penalty; sampled: temperature 1 alone, what an OpenAI client sends by
default; greedy), steps until all are decoding, then times --steps decode steps;
a second phase ("churn") gives requests staggered lengths, so rows finish and new requests join
every few steps. Prints the median and p90 milliseconds of prepare() and of the sampler call.
It times the engine's own methods, so it runs unchanged on any revision that has them.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np

from benchmarks.common.models import resolve_model
from inflight.config import EngineConfig
from inflight.demo_model import cached_demo_model
from inflight.engine.engine import LLMEngine
from inflight.sampling_params import SamplingParams


def _timed(log: list[float], fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        log.append(time.perf_counter() - t0)
        return out

    return wrapper


def _params(i: int, max_tokens: int, kind: str = "mixed") -> SamplingParams:
    if kind == "sampled":
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
    if kind == "greedy" or i % 2:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(
        temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, max_tokens=max_tokens, ignore_eos=True, seed=i
    )


def run_one(
    model_dir: str, num_seqs: int, prompt_len: int, steps: int, churn: bool, params: str = "mixed"
) -> dict[str, Any]:
    cfg = EngineConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs * prompt_len // 4),
        num_kv_blocks=num_seqs * (-(-(prompt_len + 4 * steps) // 16) + 1) + 64,
        max_model_len=2048,
    )
    engine = LLMEngine(model_dir, cfg)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prep: list[float] = []
    samp: list[float] = []
    engine.runner.prepare = _timed(prep, engine.runner.prepare)
    engine.sampler = _timed(samp, engine.sampler)
    counter = 0

    def add(max_tokens: int) -> None:
        nonlocal counter
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"r{counter}", prompt, _params(counter, max_tokens, params))
        counter += 1

    for i in range(num_seqs):
        # churn: lengths spread so about num_seqs / steps requests finish (and are replaced) every step
        add(steps + 1 + (i * steps) // num_seqs if churn else 4 * steps)

    def prefilling() -> bool:
        return bool(engine.scheduler.waiting) or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
        )

    while prefilling():
        engine.step()
    prep.clear()
    samp.clear()
    for _ in range(steps):
        finished = sum(o.finished for o in engine.step())
        if churn:
            for _ in range(finished):
                add(steps)
    return {
        "num_seqs": num_seqs,
        "phase": "churn" if churn else "decode",
        "prepare_ms_p50": 1e3 * float(np.median(prep)),
        "prepare_ms_p90": 1e3 * float(np.percentile(prep, 90)),
        "sampler_ms_p50": 1e3 * float(np.median(samp)),
        "sampler_ms_p90": 1e3 * float(np.percentile(samp, 90)),
        "running": len(engine.scheduler.running),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256])
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default="demo", help="demo | smollm2 | another benchmark model or a checkpoint directory")
    p.add_argument("--params", choices=["mixed", "sampled", "greedy"], default="mixed")
    args = p.parse_args(argv)
    model_dir = str(cached_demo_model() if args.model == "demo" else resolve_model(args.model))
    rows = []
    for n in args.num_seqs:
        for churn in (False, True):
            r = run_one(model_dir, n, args.prompt_len, args.steps, churn, args.params)
            rows.append(r)
            print(
                f"{r['num_seqs']:>4} seqs {r['phase']:<6}: prepare {r['prepare_ms_p50']:.3f} ms "
                f"(p90 {r['prepare_ms_p90']:.3f})  sampler {r['sampler_ms_p50']:.3f} ms "
                f"(p90 {r['sampler_ms_p90']:.3f})  running {r['running']}"
            )
    return rows


if __name__ == "__main__":
    main()
