"""What NVIDIA Dynamo in front costs: one replica through Dynamo's frontend (`inflight cluster -n 1`: frontend
-> `inflight dynamo-worker` -> tritonserver) vs the same replica's own OpenAI port (`inflight openai` ->
tritonserver), in one run, A/B rounds.

    python -m benchmarks.serving.dynamo_overhead                                   # demo model
    python -m benchmarks.serving.dynamo_overhead --requests 16 --rounds 1 --output-tokens 8   # a smoke run

Both paths stream `/v1/completions` (SSE) with exactly `--output-tokens` tokens (ignore_eos), at
`--concurrency`, from the same standard-library client (benchmarks/serving/cluster_trace.py). Every request
has its own random prompt (no prefix-cache hits on either path). Figure: output-token throughput through
Dynamo / through the replica's own OpenAI port (the issue's target: >= 0.9), per round and pooled.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from benchmarks.serving.cluster_trace import run_trace, summary
from inflight.launcher.cluster import Cluster

_WORDS = "the model runs fast while a city of light sings under the mountain and the river keeps the queue".split()  # noqa: SIM905


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="as `inflight serve --model` (default: the demo model)")
    p.add_argument("--requests", type=int, default=64, help="per path per round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="even: each path goes first as often")
    p.add_argument("--http-port", type=int, default=18080)
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/inflight-dynamo-overhead"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/dynamo_overhead.json"))
    return p.parse_args(argv)


def prompts(n: int, words: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choices(_WORDS, k=words)) for _ in range(n)]


def _model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(0)
    params = {"max_num_seqs": max(16, args.concurrency)}
    cluster = Cluster(
        1, args.model, "kv", args.http_port, args.base_port, params, replica_openai=True, log_dir=args.log_dir
    )
    rounds: list[dict[str, Any]] = []
    with cluster:
        replica = cluster.members[0]
        direct_url = f"http://127.0.0.1:{replica.openai_port}"
        paths = {"dynamo": (cluster.url, cluster.model_name()), "openai": (direct_url, _wait_model(direct_url))}
        # A warm-up pass on each path (connections, the engine's first batches): a quarter round at full length,
        # since the first full-length round measured ran 10-20% slower whichever path it was.
        for url, model in paths.values():
            n = max(args.concurrency, args.requests // 4)
            run_trace(url, model, prompts(n, args.prompt_words, rng), args.concurrency, args.output_tokens)
        for i in range(args.rounds):
            order = ["openai", "dynamo"] if i % 2 == 0 else ["dynamo", "openai"]
            row: dict[str, Any] = {}
            for name in order:
                url, model = paths[name]
                results = run_trace(
                    url, model, prompts(args.requests, args.prompt_words, rng), args.concurrency, args.output_tokens
                )
                row[name] = summary(results)
                row[name]["errors"] = sorted({r.error[:200] for r in results if not r.ok})[:3]
            row["ratio"] = row["dynamo"]["output_tok_per_s"] / row["openai"]["output_tok_per_s"]
            print(
                f"round {i}: dynamo {row['dynamo']['output_tok_per_s']:.1f} tok/s, own OpenAI port "
                f"{row['openai']['output_tok_per_s']:.1f} tok/s, ratio {row['ratio']:.3f}",
                flush=True,
            )
            rounds.append(row)
    pooled = {name: sum(r[name]["output_tok_per_s"] for r in rounds) / len(rounds) for name in ("dynamo", "openai")}
    out = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rounds": rounds,
        "dynamo_tok_per_s": pooled["dynamo"],
        "openai_tok_per_s": pooled["openai"],
        "ratio": pooled["dynamo"] / pooled["openai"],
        "all_ok": all(r[n]["ok"] == r[n]["requests"] for r in rounds for n in ("dynamo", "openai")),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"throughput through Dynamo / own OpenAI port: {out['ratio']:.3f} (target >= 0.9); wrote {args.out}")
    return 0 if out["all_ok"] else 1


def _wait_model(url: str, timeout_s: float = 60.0) -> str:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _model(url)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
