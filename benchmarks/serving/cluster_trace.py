"""A shared-prefix trace through an OpenAI-compatible server, and the replicas' prefix-cache counters.

Used by `make test-cluster` (tests/test_cluster.py) and benchmarks/serving/dynamo_overhead.py. Standard
library only: a thread per concurrent client, each streaming `/v1/completions` (SSE) with a timeout, so a
hung request shows up as a timeout, never as a hung test.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from inflight.serving.prometheus_text import matching, scrape

_TEXT = "river mountain city light queue model engine block cache token router replica prefix stream batch kernel"
_WORDS = (_TEXT + " vector memory paged attention layer north south east west green blue red amber silver").split()


def shared_prefix_trace(num_prompts: int = 8, suffixes: int = 12, prefix_words: int = 150, seed: int = 0) -> list[str]:
    """`num_prompts` distinct system prompts x `suffixes` distinct user turns each, in rounds: every round
    asks each system prompt once (a new user turn), in a random order (many users of a few applications).
    A replica that sees every system prompt then reuses each only after most of the others."""
    rng = random.Random(seed)
    systems = [f"System prompt {i}: " + " ".join(rng.choices(_WORDS, k=prefix_words)) for i in range(num_prompts)]
    trace = []
    for j in range(suffixes):
        order = list(range(num_prompts))
        rng.shuffle(order)
        trace += [f"{systems[i]}\nUser {j}: {' '.join(rng.choices(_WORDS, k=12))}\nAnswer:" for i in order]
    return trace


@dataclass
class Result:
    start: float
    end: float
    ok: bool
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> Result:
    """One streamed completion (exactly `max_tokens` tokens: ignore_eos), with usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.monotonic()
    usage = None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            for line in resp:
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"no end after {timeout_s}s")
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                usage = chunk.get("usage") or usage
    except (urllib.error.URLError, OSError, RuntimeError, ValueError, TimeoutError) as e:
        detail = e.read().decode(errors="replace")[:200] if isinstance(e, urllib.error.HTTPError) else ""
        return Result(start, time.monotonic(), False, error=f"{type(e).__name__}: {e} {detail}".strip())
    end = time.monotonic()
    if usage is None:
        return Result(start, end, False, error="no usage in the stream")
    details = usage.get("prompt_tokens_details") or {}
    return Result(
        start, end, True, usage.get("completion_tokens") or 0, usage.get("prompt_tokens") or 0,
        details.get("cached_tokens") or 0,
    )  # fmt: skip


def run_trace(
    url: str, model: str, prompts: Iterable[str], concurrency: int, max_tokens: int, timeout_s: float = 60.0
) -> list[Result]:
    """Every prompt, `concurrency` at a time; results in completion order."""
    results: list[Result] = []
    lock = threading.Lock()

    def one(prompt: str) -> None:
        r = complete(url, model, prompt, max_tokens, timeout_s)
        with lock:
            results.append(r)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    return results


def summary(results: list[Result]) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    wall = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "wall_s": wall,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "usage_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
    }


def prefix_cache_counters(metrics_url: str) -> tuple[float, float]:
    """(hits, queries) in tokens: `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`."""
    samples = scrape(metrics_url)
    return sum(matching(samples, "vllm:prefix_cache_hits_total")), sum(
        matching(samples, "vllm:prefix_cache_queries_total")
    )
