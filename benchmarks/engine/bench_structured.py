"""Structured outputs: what a JSON-schema constraint costs, side by side in one run.

1. Throughput (wall tok/s, and CPU ms per token): 32 concurrent JSON-schema requests vs the same 32
   requests unconstrained, generating the same number of tokens each (the unconstrained twin gets
   the constrained output's length as max_tokens with ignore_eos), grammars already compiled.
   Rounds alternate A/B; medians reported.
2. Grammar compile time for a typical schema (a fresh schema each time, so no cache hit), and the
   one-off cost of building the compiler (xgrammar import + tokenizer info).
3. TTFT of one JSON-schema request with a cold grammar cache vs a warm one (and unconstrained).
4. The bitmask application alone on a [32, 128256] batch (a Llama-3-sized vocabulary), CPU.

    python -m benchmarks.engine.bench_structured --model demo --out benchmarks/results/structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch  # noqa: E402

from benchmarks.common.models import resolve_model  # noqa: E402
from inflight.config import EngineConfig  # noqa: E402
from inflight.engine.engine import LLMEngine  # noqa: E402
from inflight.engine.structured_output.compile_pool import CompileJob  # noqa: E402
from inflight.llm import LLM  # noqa: E402
from inflight.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

PROMPTS = ["Hello world", "The model runs", "A quiet river flows", "Tell me a story about the ocean"]


def schema(variant: int = 0) -> dict:
    """A typical extraction schema: nested object, array, enum, bounded integers, required fields.
    Variants differ in a property name, so each compiles from scratch (no cache below ours hits)."""
    return {
        "type": "object",
        "properties": {
            f"name{variant}": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 16},
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                },
                "required": ["city", "zip"],
            },
            "active": {"type": "boolean"},
        },
        "required": [f"name{variant}", "age", "role", "address"],
    }


def run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]], tag: str) -> dict:
    """All requests at once; wall time, generated tokens and each request's TTFT and token count."""
    t0, c0 = time.perf_counter(), time.process_time()
    engine = LLM.from_engine(engine)  # with the output processor: text
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                counts[out.request_id] = out.num_output_tokens
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    order = [f"{tag}-{i}" for i in range(len(requests))]
    return {
        "wall_s": wall,
        "tokens": sum(counts.values()),
        "tok_per_s": sum(counts.values()) / wall,
        # CPU seconds of this process per token: far less sensitive than wall time to other processes
        # taking the cores (PASSIVE OpenMP threads do not spin, so waiting costs no CPU time).
        "cpu_ms_per_tok": 1e3 * cpu / sum(counts.values()),
        "counts": [counts[r] for r in order],
        "ttft_s": [first[r] for r in order],
        "texts": [texts[r] for r in order],
    }


def throughput(engine: LLMEngine, n: int, rounds: int) -> dict:
    so = {"json": schema(), "disable_any_whitespace": True}
    constrained = [
        (PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=so))
        for i in range(n)
    ]
    run(engine, constrained[:1], "warm")  # compile once: the figure is for compiled grammars
    ref = run(engine, constrained, "ref")
    valid = sum(_valid_json(t) for t in ref["texts"])
    free = [
        (p, SamplingParams(temperature=1.0, seed=i, max_tokens=c, ignore_eos=True))
        for i, ((p, _), c) in enumerate(zip(constrained, ref["counts"]))
    ]
    a, b, a_cpu, b_cpu = [], [], [], []
    grammar_s = []
    for r in range(rounds):  # alternate so that drift on a shared machine hits both sides
        pair = [("json", constrained), ("free", free)]
        for name, reqs in pair if r % 2 == 0 else reversed(pair):
            with _GrammarTimer(engine) as timer:
                res = run(engine, reqs, f"{name}{r}")
            (a if name == "json" else b).append(res["tok_per_s"])
            (a_cpu if name == "json" else b_cpu).append(res["cpu_ms_per_tok"])
            if name == "json":
                grammar_s.append(timer.seconds / res["wall_s"])
    return {
        "requests": n,
        "output_tokens_per_round": ref["tokens"],
        "valid_json_outputs": valid,
        "json_tok_per_s_median": statistics.median(a),
        "free_tok_per_s_median": statistics.median(b),
        "cost_pct_median": 100 * (1 - statistics.median(a) / statistics.median(b)),
        "cost_pct_best": 100 * (1 - max(a) / max(b)),
        "json_cpu_ms_per_tok_median": statistics.median(a_cpu),
        "free_cpu_ms_per_tok_median": statistics.median(b_cpu),
        "cost_pct_cpu_time": 100 * (statistics.median(a_cpu) / statistics.median(b_cpu) - 1),
        "grammar_share_of_wall_pct": 100 * statistics.median(grammar_s),
        "json_rounds": a,
        "free_rounds": b,
    }


class _GrammarTimer:
    """Time spent in the structured-output work of a step: bitmask fill, bitmask apply, matcher advance
    (a noise-robust view of the cost next to the A/B throughput, which a shared machine blurs)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.targets = [(engine.structured_outputs, "grammar_bitmask"), (engine.sampler, "_apply_grammar")]
        self.seconds = 0.0

    def __enter__(self) -> _GrammarTimer:
        for obj, name in self.targets:
            fn = getattr(obj, name)

            def timed(*args, _fn=fn, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(obj, name, timed)
        manager = self.targets[0][0]
        accept = type(manager).accept

        def timed_accept(request_id, tok):
            t0 = time.perf_counter()
            try:
                return accept(manager, request_id, tok)
            finally:
                self.seconds += time.perf_counter() - t0

        manager.accept = timed_accept
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in self.targets:
            delattr(obj, name)
        del self.targets[0][0].accept


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def compile_times(engine: LLMEngine, reps: int) -> dict:
    manager = engine.structured_outputs.pool
    t0 = time.perf_counter()
    manager._get_compiler()  # first use: xgrammar import, tokenizer info (once per engine)
    setup = time.perf_counter() - t0
    times = []
    for v in range(reps):
        p = StructuredOutputsParams.from_value({"json": schema(1000 + v), "disable_any_whitespace": True})
        t0 = time.perf_counter()
        manager._compile(p, CompileJob())  # the job records when the compile starts (the pool's own timing)
        times.append(time.perf_counter() - t0)
    return {"compiler_setup_s": setup, "compile_ms_median": 1e3 * statistics.median(times), "compile_ms": times}


def ttft(engine: LLMEngine, reps: int) -> dict:
    cold, warm, free = [], [], []
    for v in range(reps):
        so = {"json": schema(2000 + v), "disable_any_whitespace": True}  # unseen: a cold cache
        params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=so)
        cold.append(run(engine, [(PROMPTS[0], params)], f"cold{v}")["ttft_s"][0])
        warm.append(run(engine, [(PROMPTS[0], params)], f"warm{v}")["ttft_s"][0])
        free.append(run(engine, [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))], f"free{v}")["ttft_s"][0])
    med = statistics.median
    return {"cold_ms": 1e3 * med(cold), "warm_ms": 1e3 * med(warm), "unconstrained_ms": 1e3 * med(free)}


def bitmask_apply(rows: int = 32, vocab: int = 128256, reps: int = 50) -> dict:
    import xgrammar as xgr

    logits = torch.randn(rows, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))
    t0 = time.perf_counter()
    for _ in range(reps):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(rows)))
    return {"rows": rows, "vocab": vocab, "apply_ms": 1e3 * (time.perf_counter() - t0) / reps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="demo | llama50m | a checkpoint directory")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model_dir = resolve_model(args.model)
    config = EngineConfig.from_kwargs(
        dict(device="cpu", max_num_seqs=args.requests, max_num_batched_tokens=2048, num_kv_blocks=1024)
    )
    engine = LLMEngine(model_dir, config)
    result = {
        "model": args.model,
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "compile": compile_times(engine, args.reps),
        "ttft": ttft(engine, args.reps),
        "throughput": throughput(engine, args.requests, args.rounds),
        "bitmask_apply": bitmask_apply(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
