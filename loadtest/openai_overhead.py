"""What the OpenAI port costs: the same requests through `/v1/completions` (SSE) and straight over Triton's
gRPC stream, against one tritonserver, alternating A/B rounds in one run.

    python -m loadtest.openai_overhead                      # demo model, ~2 minutes on 2 cores
    python -m loadtest.openai_overhead --requests 128 --concurrency 32 --rounds 3

The API runs in its own process (`inflight openai`), as `inflight serve` runs it beside tritonserver. Both
clients are asyncio clients in this process doing the least work per chunk (the gRPC one is the same thin
tritonclient.grpc.aio client the API uses; the HTTP one reads SSE lines with httpx2, which comes with the
`openai` package). Figures: output-token throughput ratio (OpenAI / gRPC) under load, and the TTFT
overhead (p50 through OpenAI − p50 direct) both under load and one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SERVER_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "num_kv_blocks": 16 * 48, "max_model_len": 768}
_WORDS = "the model runs fast while a city of light sings under the mountain and the river keeps the queue".split()  # noqa: SIM905


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64, help="requests per loaded run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--sequential-requests", type=int, default=24, help="requests one at a time, per run")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds (gRPC then OpenAI, each round)")
    p.add_argument("--out", type=Path, default=Path("loadtest/results/openai_overhead.json"))
    return p.parse_args(argv)


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 64))) for _ in range(n)]


def sampling(output_tokens: int) -> dict[str, Any]:
    return {"max_tokens": output_tokens, "temperature": 0, "ignore_eos": True}


async def _grpc_one(llm, prompt: str, params: dict, t0: float) -> tuple[float | None, int]:
    ttft, tokens = None, 0
    async for out in llm.generate(prompt, params, stream=True):
        if out.text and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += out.num_output_tokens
    return ttft, tokens


async def _openai_one(client, url: str, prompt: str, params: dict, t0: float) -> tuple[float | None, int]:
    body = {"model": "llm", "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}} | params
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, tokens


async def run_load(kind: str, grpc_url: str, api_url: str, texts: list[str], params: dict, concurrency: int) -> dict:
    import httpx2

    from inflight.serving.openai.triton_stream import TritonLLM

    llm = TritonLLM(grpc_url)
    client = httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=concurrency))
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> tuple[float | None, int]:
        async with gate:
            t0 = time.perf_counter()
            if kind == "grpc":
                return await _grpc_one(llm, prompt, params, t0)
            return await _openai_one(client, f"{api_url}/v1/completions", prompt, params, t0)

    try:
        start, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(one(p) for p in texts))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        await client.aclose()
        await llm.close()
    tokens = sum(n for _, n in results)
    ttfts = [t for t, _ in results if t is not None]
    return {
        "kind": kind,
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "client_cpu_ms_per_token": 1000 * cpu / max(tokens, 1),
        "ttfts_s": ttfts,
    }


def _p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def summarize(runs: list[dict]) -> dict[str, Any]:
    def pooled(kind: str, load: str) -> list[dict]:
        return [r for r in runs if r["kind"] == kind and r["load"] == load]

    summary: dict[str, Any] = {}
    for load in ("loaded", "sequential"):
        g, o = pooled("grpc", load), pooled("openai", load)
        g_ttft = _p50_ms([t for r in g for t in r["ttfts_s"]])
        o_ttft = _p50_ms([t for r in o for t in r["ttfts_s"]])
        g_tps = statistics.mean(r["tokens_per_s"] for r in g)
        o_tps = statistics.mean(r["tokens_per_s"] for r in o)
        summary[load] = {
            "grpc_tokens_per_s": round(g_tps, 1),
            "openai_tokens_per_s": round(o_tps, 1),
            "throughput_ratio": round(o_tps / g_tps, 3),
            "grpc_ttft_p50_ms": round(g_ttft, 2),
            "openai_ttft_p50_ms": round(o_ttft, 2),
            "ttft_overhead_p50_ms": round(o_ttft - g_ttft, 2),
        }
    return summary


def wait_listening(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the OpenAI API exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the OpenAI API did not come up")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from inflight.demo_model import cached_demo_model
    from inflight.launcher.server import TritonServer, free_port

    model = str(cached_demo_model())
    loaded, sequential = prompts(args.requests, 0), prompts(args.sequential_requests, 1)
    params = sampling(args.output_tokens)
    runs: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    params_server = dict(SERVER_ARGS, model=model)
    with TritonServer(parameters=params_server, http_port=0, grpc_port=0, metrics_port=0, log=log) as srv:
        srv.wait_ready()
        port = free_port()
        api = subprocess.Popen(
            [sys.executable, "-m", "inflight.launcher.cli", "openai", "--triton-url", srv.grpc_url,
             "--port", str(port), "--host", "127.0.0.1", "--model", model],
        )  # fmt: skip
        api_url = f"http://127.0.0.1:{port}"
        try:
            wait_listening(api_url, api)
            for kind in ("grpc", "openai"):  # warm both paths (connections, first compile of shapes)
                asyncio.run(run_load(kind, srv.grpc_url, api_url, loaded[:8], params, 8))
            for rnd in range(args.rounds):
                for kind in ("grpc", "openai"):
                    for load, texts, conc in (("loaded", loaded, args.concurrency), ("sequential", sequential, 1)):
                        run = asyncio.run(run_load(kind, srv.grpc_url, api_url, texts, params, conc))
                        run |= {"load": load, "round": rnd}
                        runs.append(run)
                        print(f"round {rnd} {kind:6s} {load:10s} {run['tokens_per_s']:7.1f} tok/s  "
                              f"TTFT p50 {_p50_ms(run['ttfts_s']):7.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            api.terminate()
            api.wait(timeout=30)
    summary = summarize(runs)
    setup = vars(args) | {"out": str(args.out), "server_args": SERVER_ARGS, "cpus": os.cpu_count()}
    args.out.write_text(json.dumps({"setup": setup, "summary": summary, "runs": runs}, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
