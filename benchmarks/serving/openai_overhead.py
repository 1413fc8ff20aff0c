"""What the OpenAI port costs: the same requests through `/v1/completions` (SSE) and straight over Triton's
gRPC stream, against one tritonserver, in one run.

    python -m benchmarks.serving.openai_overhead                      # demo model, ~3 minutes on 2 cores
    python -m benchmarks.serving.openai_overhead --requests 128 --concurrency 32 --rounds 6

Under load: A/B rounds (gRPC, then OpenAI, `--rounds` times) of `--requests` at `--concurrency`.
One at a time: request pairs (the same prompt through both, the order alternating), so that both sides of
a pair see the same machine; TTFT overhead is reported as the difference of the p50s and as the median of
the paired differences.

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

import psutil

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "num_kv_blocks": 16 * 48, "max_model_len": 768}
_WORDS = "the model runs fast while a city of light sings under the mountain and the river keeps the queue".split()  # noqa: SIM905


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=48, help="requests per loaded run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--sequential-pairs", type=int, default=60, help="request pairs one at a time")
    p.add_argument("--rounds", type=int, default=4, help="loaded A/B rounds (gRPC then OpenAI, each round)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/openai_overhead.json"))
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


class Clients:
    """One gRPC client and one HTTP client (a pool of kept-alive connections) for the whole run, as a
    long-lived application would hold them; both live in one event loop."""

    def __init__(self, grpc_url: str, api_url: str, concurrency: int) -> None:
        import httpx2

        from inflight.serving.openai.triton_stream import TritonLLM

        self.llm = TritonLLM(grpc_url)
        self.http = httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=concurrency))
        self.completions_url = f"{api_url}/v1/completions"

    async def one(self, kind: str, prompt: str, params: dict) -> tuple[float | None, int]:
        t0 = time.perf_counter()
        if kind == "grpc":
            return await _grpc_one(self.llm, prompt, params, t0)
        return await _openai_one(self.http, self.completions_url, prompt, params, t0)

    async def close(self) -> None:
        await self.http.aclose()
        await self.llm.close()


async def run_load(clients: Clients, kind: str, texts: list[str], params: dict, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> tuple[float | None, int]:
        async with gate:
            return await clients.one(kind, prompt, params)

    start, cpu, t0 = time.perf_counter(), time.process_time(), time.monotonic()
    results = await asyncio.gather(*(one(p) for p in texts))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(n for _, n in results)
    ttfts = [t for t, _ in results if t is not None]
    return {
        "kind": kind,
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "client_cpu_ms_per_token": 1000 * cpu / max(tokens, 1),
        "ttfts_s": ttfts,
        "window": (t0, time.monotonic()),  # the engine's step log uses the same clock
    }


def _p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def summarize(runs: list[dict], pairs: list[tuple[float, float]]) -> dict[str, Any]:
    grpc = [r for r in runs if r["kind"] == "grpc"]
    oai = [r for r in runs if r["kind"] == "openai"]
    g_tps = statistics.mean(r["tokens_per_s"] for r in grpc)
    o_tps = statistics.mean(r["tokens_per_s"] for r in oai)
    g_ttft = _p50_ms([t for r in grpc for t in r["ttfts_s"]])
    o_ttft = _p50_ms([t for r in oai for t in r["ttfts_s"]])
    seq_g, seq_o = _p50_ms([g for g, _ in pairs]), _p50_ms([o for _, o in pairs])
    return {
        "loaded": {
            "grpc_tokens_per_s": round(g_tps, 1),
            "openai_tokens_per_s": round(o_tps, 1),
            "throughput_ratio": round(o_tps / g_tps, 3),
            "throughput_ratio_per_round": [round(o["tokens_per_s"] / g["tokens_per_s"], 3) for g, o in zip(grpc, oai)],
            "grpc_ttft_p50_ms": round(g_ttft, 2),
            "openai_ttft_p50_ms": round(o_ttft, 2),
            "ttft_overhead_p50_ms": round(o_ttft - g_ttft, 2),
            "client_cpu_ms_per_token": {
                "grpc": round(statistics.mean(r["client_cpu_ms_per_token"] for r in grpc), 3),
                "openai": round(statistics.mean(r["client_cpu_ms_per_token"] for r in oai), 3),
            },
            "api_cpu_ms_per_token": round(statistics.mean(r["api_cpu_ms_per_token"] for r in oai), 3),
            "engine": {
                kind: {k: round(statistics.mean(r["engine"][k] for r in rs), 3) for k in rs[0]["engine"]}
                for kind, rs in (("grpc", grpc), ("openai", oai))
                if rs[0].get("engine")
            },
        },
        "one_at_a_time": {
            "pairs": len(pairs),
            "grpc_ttft_p50_ms": round(seq_g, 2),
            "openai_ttft_p50_ms": round(seq_o, 2),
            "ttft_overhead_p50_ms": round(seq_o - seq_g, 2),
            "ttft_overhead_median_of_pairs_ms": round(_p50_ms([o - g for g, o in pairs]), 2),
        },
    }


def engine_view(step_log: Path, window: tuple[float, float]) -> dict[str, float]:
    """What the engine saw during a run: how full its batch was and how long its steps took."""
    steps = []
    for line in step_log.read_text().splitlines():
        step = json.loads(line)
        if window[0] <= step["time"] <= window[1]:
            steps.append(step)
    if not steps:
        return {}
    busy = sum(s["step_time_s"] for s in steps)
    return {
        "mean_running": round(statistics.mean(s["num_running"] for s in steps), 2),
        "mean_step_ms": round(1000 * busy / len(steps), 2),
        "engine_busy": round(busy / (window[1] - window[0]), 3),
    }


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def run_pairs(clients: Clients, texts: list[str], params: dict) -> list[tuple[float, float]]:
    """(gRPC TTFT, OpenAI TTFT) per prompt, one request at a time, the order alternating."""
    pairs = []
    for i, prompt in enumerate(texts):
        ttft = {}
        for kind in ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc"):
            ttft[kind], _ = await clients.one(kind, prompt, params)
        pairs.append((ttft["grpc"], ttft["openai"]))
    return pairs


async def bench(args: argparse.Namespace, grpc_url: str, api_url: str, api_pid: int) -> tuple[list, list]:
    loaded, sequential = prompts(args.requests, 0), prompts(args.sequential_pairs, 1)
    params = sampling(args.output_tokens)
    clients = Clients(grpc_url, api_url, args.concurrency)
    runs: list[dict] = []
    try:
        for kind in ("grpc", "openai"):  # warm both paths: connections, the server's first shapes
            await run_load(clients, kind, loaded[: args.concurrency], params, args.concurrency)
        for rnd in range(args.rounds):
            for kind in ("grpc", "openai"):
                cpu = _cpu_s(api_pid)
                run = await run_load(clients, kind, loaded, params, args.concurrency)
                run |= {"round": rnd, "api_cpu_ms_per_token": 1000 * (_cpu_s(api_pid) - cpu) / run["output_tokens"]}
                runs.append(run)
                print(f"round {rnd} {kind:6s} {run['tokens_per_s']:7.1f} tok/s  "
                      f"TTFT p50 {_p50_ms(run['ttfts_s']):7.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
        pairs = await run_pairs(clients, sequential, params)
    finally:
        await clients.close()
    return runs, pairs


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
    from inflight.demo_model import cached_demo_model
    from inflight.launcher.server import TritonServer, free_port

    model = str(cached_demo_model())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    step_log = args.out.resolve().with_suffix(".steps.jsonl")  # the server runs in its own directory
    step_log.unlink(missing_ok=True)
    params_server = dict(SERVER_ARGS, model=model, step_log=str(step_log))
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
            runs, pairs = asyncio.run(bench(args, srv.grpc_url, api_url, api.pid))
        finally:
            api.terminate()
            api.wait(timeout=30)
    for run in runs:
        run["engine"] = engine_view(step_log, run["window"])
    summary = summarize(runs, pairs)
    setup = vars(args) | {"out": str(args.out), "server_args": SERVER_ARGS, "cpus": os.cpu_count()}
    record = {"setup": setup, "summary": summary, "runs": runs, "pairs_ttft_s": pairs}
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
