"""Seeded request traces: prompt lengths, exact output lengths and arrival times.

Output lengths are exact (`ignore_eos`, `min_tokens = max_tokens`) so every system does the same work,
and the default bounded Pareto makes most requests short and a few very long: the stragglers that
static batching waits for.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

OUTPUT_DISTRIBUTIONS = ("pareto", "uniform", "fixed")


@dataclass(frozen=True)
class TraceSpec:
    num_requests: int = 256
    prompt_len: tuple[int, int] = (16, 256)  # inclusive bounds, uniform
    output_len: tuple[int, int] = (8, 512)  # inclusive bounds
    output_dist: str = "pareto"  # pareto (bounded, alpha) | uniform | fixed (always the upper bound)
    pareto_alpha: float = 0.8
    rate: float | None = None  # Poisson arrivals per second; None: every request arrives at t = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be >= 1")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={(lo, hi)} must satisfy 1 <= low <= high")
        if self.output_dist not in OUTPUT_DISTRIBUTIONS:
            raise ValueError(f"output_dist={self.output_dist!r} must be one of {', '.join(OUTPUT_DISTRIBUTIONS)}")
        if self.pareto_alpha <= 0:
            raise ValueError(f"pareto_alpha={self.pareto_alpha} must be > 0")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate={self.rate} must be > 0 requests/s (or None for all at t = 0)")

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len[1] + self.output_len[1]


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float  # offset from the start of the run

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def bounded_pareto(rng: np.random.Generator, alpha: float, low: float, high: float, size: int) -> np.ndarray:
    """Inverse-CDF draws from a Pareto(alpha) truncated to [low, high]."""
    u = rng.random(size)
    tail = (low / high) ** alpha
    return low / (1.0 - u * (1.0 - tail)) ** (1.0 / alpha)


def make_trace(spec: TraceSpec, vocab_size: int, first_token_id: int = 3) -> list[TraceRequest]:
    """Deterministic for a given spec and vocabulary. Prompt ids avoid the special tokens below `first_token_id`."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    plo, phi = spec.prompt_len
    olo, ohi = spec.output_len
    prompt_lens = rng.integers(plo, phi + 1, size=n)
    if spec.output_dist == "pareto":
        out = np.clip(np.rint(bounded_pareto(rng, spec.pareto_alpha, olo, ohi, n)), olo, ohi).astype(int)
    elif spec.output_dist == "uniform":
        out = rng.integers(olo, ohi + 1, size=n)
    else:
        out = np.full(n, ohi)
    if spec.rate is None:
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
        arrivals -= arrivals[0]  # the first request opens the run
    return [
        TraceRequest(
            request_id=f"req-{i:05d}",
            prompt_token_ids=tuple(int(t) for t in rng.integers(first_token_id, vocab_size, size=int(prompt_lens[i]))),
            output_len=int(out[i]),
            arrival_s=float(arrivals[i]),
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class SharedPrefixSpec:
    """Chat/agent/RAG traffic: every request is one of `num_prefixes` system prompts + its own suffix."""

    num_requests: int = 256
    num_prefixes: int = 8
    prefix_len: int = 1000
    suffix_len: tuple[int, int] = (32, 256)  # inclusive bounds, uniform
    output_len: tuple[int, int] = (16, 128)  # inclusive bounds, uniform
    rate: float | None = None  # Poisson arrivals per second; None: every request arrives at t = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_prefixes <= self.num_requests:
            raise ValueError(f"num_prefixes={self.num_prefixes} must be in [1, num_requests={self.num_requests}]")
        if self.prefix_len < 1:
            raise ValueError(f"prefix_len={self.prefix_len} must be >= 1")
        for name in ("suffix_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={(lo, hi)} must satisfy 1 <= low <= high")

    @property
    def max_seq_len(self) -> int:
        return self.prefix_len + self.suffix_len[1] + self.output_len[1]


def make_shared_prefix_trace(spec: SharedPrefixSpec, vocab_size: int, first_token_id: int = 3) -> list[TraceRequest]:
    """Deterministic; request i uses system prompt i % num_prefixes, so the groups interleave in arrival order."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prefixes = rng.integers(first_token_id, vocab_size, size=(spec.num_prefixes, spec.prefix_len))
    suffix_lens = rng.integers(spec.suffix_len[0], spec.suffix_len[1] + 1, size=n)
    out = rng.integers(spec.output_len[0], spec.output_len[1] + 1, size=n)
    if spec.rate is None:
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
        arrivals -= arrivals[0]
    return [
        TraceRequest(
            request_id=f"req-{i:05d}",
            prompt_token_ids=tuple(
                int(t)
                for t in np.concatenate(
                    [prefixes[i % spec.num_prefixes], rng.integers(first_token_id, vocab_size, size=suffix_lens[i])]
                )
            ),
            output_len=int(out[i]),
            arrival_s=float(arrivals[i]),
        )
        for i in range(n)
    ]


def static_batches(trace: Sequence[TraceRequest], batch_size: int) -> list[list[TraceRequest]]:
    """Arrival-order batches, as a static batcher with a full queue forms them."""
    ordered = sorted(trace, key=lambda r: r.arrival_s)
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def ideal_continuous_ratio(trace: Sequence[TraceRequest], batch_size: int) -> float:
    """Padded ÷ useful decode token-steps: the most continuous batching can gain over static batching
    when a step costs the same however many of its slots are busy (every slot of a static batch is held
    until the batch's longest request ends)."""
    batches = static_batches(trace, batch_size)
    padded = sum(len(b) * max(r.output_len for r in b) for b in batches)
    useful = sum(r.output_len for r in trace)
    return padded / useful


def cost_model_ratio(trace: Sequence[TraceRequest], batch_size: int, fixed_s: float, per_seq_s: float) -> float:
    """The continuous÷static ratio when a decode step costs `fixed_s + per_seq_s × running` (a CPU: work grows
    with the batch). Static runs Σ(longest per batch) steps, continuous useful ÷ batch_size full steps; both
    pay `per_seq_s` for every useful token. With per_seq_s = 0 this is `ideal_continuous_ratio`."""
    useful = sum(r.output_len for r in trace)
    static_steps = sum(max(r.output_len for r in b) for b in static_batches(trace, batch_size))
    static = fixed_s * static_steps + per_seq_s * useful
    continuous = fixed_s * useful / batch_size + per_seq_s * useful
    return static / continuous


def kv_blocks_needed(trace: Sequence[TraceRequest], block_size: int) -> int:
    """Blocks to hold every request's full sequence at once (a KV budget that never preempts)."""
    return sum(math.ceil((r.prompt_len + r.output_len) / block_size) for r in trace)


def digest(trace: Sequence[TraceRequest]) -> str:
    """A fingerprint of the work a trace asks for (prompts, exact output lengths, arrivals): two systems
    that report the same digest served the same requests, even when each built the trace itself."""
    h = hashlib.sha256()
    for r in trace:
        h.update(f"{r.request_id}:{r.output_len}:{r.arrival_s!r}:{','.join(map(str, r.prompt_token_ids))};".encode())
    return h.hexdigest()[:16]


def summarize(trace: Sequence[TraceRequest]) -> dict[str, float]:
    out = np.array([r.output_len for r in trace])
    prompt = np.array([r.prompt_len for r in trace])
    return {
        "num_requests": len(trace),
        "output_tokens": int(out.sum()),
        "prompt_tokens": int(prompt.sum()),
        "output_len_mean": float(out.mean()),
        "output_len_p50": float(np.percentile(out, 50)),
        "output_len_max": int(out.max()),
        "prompt_len_mean": float(prompt.mean()),
        "last_arrival_s": max(r.arrival_s for r in trace),
    }


def prompt_texts(trace: Sequence[TraceRequest], tokenizer) -> list[str]:
    """Text prompts for the paths that take text (the server, Locust): each trace prompt decoded. The server
    re-tokenizes them, so their token counts differ a little from the trace's; the output lengths do not."""
    return [tokenizer.decode(list(r.prompt_token_ids)) for r in trace]


_WORDS = (  # noqa: SIM905 - a word list reads better as text
    "the a of to in on with from model token batch block cache request stream server engine kernel memory queue "
    "step sequence prompt answer river mountain city light night morning story music garden window ocean forest "
    "bright quiet fast slow small large new old red blue green warm cold runs flows sings reads writes builds"
).split()


def word_prompts(trace: Sequence[TraceRequest], seed: int = 0) -> list[str]:
    """Model-agnostic text prompts of about `prompt_len` tokens (one common word is about one token), for
    clients that do not have the served model's tokenizer."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=r.prompt_len)) for r in trace]


def main(argv: list[str] | None = None) -> dict:
    """Builds a trace and prints what it asks for (JSON): the summary, digest, the ideal continuous ÷ static
    ratio, the KV blocks it needs, and with --per-request each request's lengths and arrival."""
    import argparse
    import json

    p = argparse.ArgumentParser(description="Inspect a seeded request trace (what the benchmarks replay).")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"), help="or suffix")
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-dist", choices=OUTPUT_DISTRIBUTIONS, default="pareto")
    p.add_argument("--pareto-alpha", type=float, default=0.8)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals (requests/s); default: all at t = 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--shared-prefixes", type=int, default=None, help="a shared-prefix trace with this many prompts")
    p.add_argument("--prefix-len", type=int, default=1000, help="with --shared-prefixes")
    p.add_argument("--batch-size", type=int, default=32, help="for the ideal continuous ÷ static ratio")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--per-request", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.shared_prefixes is None:
            spec = TraceSpec(
                args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.output_dist,
                args.pareto_alpha, args.rate, args.seed,
            )  # fmt: skip
            trace = make_trace(spec, args.vocab_size)
        else:
            shared = SharedPrefixSpec(
                args.num_requests, args.shared_prefixes, args.prefix_len, tuple(args.prompt_len),
                tuple(args.output_len), args.rate, args.seed,
            )  # fmt: skip
            trace = make_shared_prefix_trace(shared, args.vocab_size)
    except ValueError as e:
        p.error(str(e))
    ids = [t for r in trace for t in r.prompt_token_ids]
    out = summarize(trace) | {
        "digest": digest(trace),
        "distinct_request_ids": len({r.request_id for r in trace}),
        "token_id_range": [min(ids), max(ids)],
        "ideal_continuous_over_static": ideal_continuous_ratio(trace, args.batch_size),
        "kv_blocks_needed": kv_blocks_needed(trace, args.block_size),
    }
    if args.per_request:
        prefixes: dict[tuple[int, ...], int] = {}
        out["requests"] = [
            {"prompt_len": r.prompt_len, "output_len": r.output_len, "arrival_s": r.arrival_s}
            | ({"prefix": prefixes.setdefault(r.prompt_token_ids[: args.prefix_len], len(prefixes))}
               if args.shared_prefixes else {})
            for r in trace
        ]  # fmt: skip
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
