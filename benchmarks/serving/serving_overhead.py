"""Serving overhead: the same trace through a running tritonserver (gRPC streaming) vs the engine in-process.

    python -m benchmarks.serving.serving_overhead                      # launches a server on free ports
    python -m benchmarks.serving.serving_overhead --url localhost:8001 # or uses one already serving the same model

Both sides keep `--concurrency` requests in flight (closed loop: a finished request is replaced at once),
send the same text prompts with exact output lengths, and are timed where a user would see them: the
client for the server, the engine's outputs for in-process. Targets: served ÷ in-process tok/s >= 0.95,
engine busy >= 95% in the server, TTFT p50 served <= 1.1x in-process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from benchmarks.common.metrics import cpu_contention, percentiles
from benchmarks.common.models import resolve_model
from benchmarks.common.replay import exact_params, warm_up
from benchmarks.common.trace import TraceSpec, make_trace, prompt_texts
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine


@dataclass
class Job:
    request_id: str
    prompt: str
    output_len: int


@dataclass
class Measured:
    name: str
    wall_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per token: gap between deliveries ÷ tokens delivered
    latency_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    contention: float | None = None
    client_cpu_share: float | None = None
    engine_busy: float | None = None  # Σ step time ÷ wall: how much of the run the engine spent stepping
    mean_running: float | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.output_tokens / self.wall_s if self.wall_s else 0.0,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "ttft_s": percentiles(self.ttft_s),
            "itl_s": percentiles(self.itl_s),
            "latency_s": percentiles(self.latency_s),
            "num_requests": len(self.latency_s),
            "failures": self.failures[:10],
            "num_failures": len(self.failures),
            "contention": self.contention,
            "client_cpu_share": self.client_cpu_share,
            "engine_busy": self.engine_busy,
            "mean_running": self.mean_running,
        }


def run_in_process(model_dir: Path, config: EngineConfig, jobs: Sequence[Job], concurrency: int) -> Measured:
    engine = LLMEngine(model_dir, config)
    warm_up(engine)
    m = Measured("in-process")
    pending = deque(jobs)
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    busy, running = 0.0, []
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_unfinished < concurrency:
            job = pending.popleft()
            sent[job.request_id] = time.monotonic()
            engine.add_request(job.request_id, job.prompt, exact_params(job.output_len), sent[job.request_id])
        before = engine.num_steps
        outputs = engine.step()
        now = time.monotonic()
        if engine.num_steps != before and engine.last_step_stats is not None:
            busy += engine.last_step_stats.step_time_s
            running.append(engine.last_step_stats.num_running)
        for out in outputs:
            rid = out.request_id
            n = len(out.new_token_ids)
            m.output_tokens += n
            if rid in last:
                m.itl_s.append((now - last[rid]) / max(1, n))
            else:
                m.ttft_s.append(now - sent[rid])
            last[rid] = now
            if out.finished:
                m.latency_s.append(now - sent[rid])
    m.wall_s = time.monotonic() - t0
    m.engine_busy = busy / m.wall_s
    m.mean_running = sum(running) / len(running) if running else None
    return m


def step_log_stats(path: Path, start: float, end: float) -> tuple[float | None, float | None]:
    """(engine busy share, mean running) of the server's steps between two wall-clock times."""
    if not path.is_file():
        return None, None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if start <= r["wall_time"] <= end]
    if not rows:
        return None, None
    return sum(r["step_time_s"] for r in rows) / (end - start), sum(r["num_running"] for r in rows) / len(rows)


def run_served(url: str, jobs: Sequence[Job], concurrency: int, timeout_s: float = 600.0) -> Measured:
    from inflight_client import InferenceError, LLMClient

    client = LLMClient(url, timeout_s=timeout_s)
    client.generate("warm up", {"max_tokens": 4, "min_tokens": 4, "ignore_eos": True})
    m = Measured("served (gRPC streaming)")
    work: queue.Queue[Job] = queue.Queue()
    for job in jobs:
        work.put(job)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                job = work.get_nowait()
            except queue.Empty:
                return
            params = {"max_tokens": job.output_len, "min_tokens": job.output_len, "ignore_eos": True, "temperature": 0}
            try:
                done = client.generate(job.prompt, params)
            except InferenceError as e:
                with lock:
                    m.failures.append(f"{job.request_id}: {e}")
                continue
            gaps = [(b.time_s - a.time_s) / max(1, b.num_tokens) for a, b in zip(done.deltas, done.deltas[1:])]
            with lock:
                m.output_tokens += done.num_output_tokens
                if done.ttft_s is not None:
                    m.ttft_s.append(done.ttft_s)
                m.itl_s.extend(gaps)
                m.latency_s.append(done.e2e_s)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    own0, t0 = os.times(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.wall_s = time.monotonic() - t0
    own1 = os.times()
    m.client_cpu_share = ((own1.user + own1.system) - (own0.user + own0.system)) / (m.wall_s * (os.cpu_count() or 1))
    return m


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="demo | llama50m | a checkpoint directory")
    p.add_argument("--url", default=None, help="a running server's gRPC address (default: launch one)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 512), metavar=("MIN", "MAX"))
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=64, help="client streams in flight")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="both sides' device")
    p.add_argument(
        "--stream-interval", type=int, default=1, help="the server's stream_interval (tokens per streamed response)"
    )
    p.add_argument("--dtype", default="auto", help="both sides' dtype")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


def engine_args(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    # KV for every slot at full length: neither side may preempt, so the comparison is the path alone.
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.max_num_seqs * math.ceil(max_len / 16),
        "block_size": 16,
        "device": args.device,
        "dtype": args.dtype,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = resolve_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    spec = TraceSpec(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=args.seed)
    trace = make_trace(spec, vocab)
    texts = prompt_texts(trace, Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    jobs = [Job(r.request_id, text, r.output_len) for r, text in zip(trace, texts)]
    eargs = engine_args(args, model_dir)

    with cpu_contention() as busy:
        local = run_in_process(model_dir, EngineConfig(**eargs), jobs, args.concurrency)
    local.contention = busy["share"]
    print(f"  in-process: {local.output_tokens / local.wall_s:.0f} tok/s", flush=True)
    served = _served(args, model_dir, eargs, jobs)
    print(f"  served: {served.output_tokens / served.wall_s:.0f} tok/s", flush=True)

    result = {
        "model": str(model_dir),
        "trace": {"num_requests": len(jobs), "output_tokens": sum(j.output_len for j in jobs)},
        "concurrency": args.concurrency,
        "engine": eargs,
        "stream_interval": args.stream_interval,
        "in_process": local.summary(),
        "served": served.summary(),
    }
    ratio = result["served"]["tokens_per_s"] / result["in_process"]["tokens_per_s"]
    result["served_over_in_process"] = ratio
    local_ttft, served_ttft = result["in_process"]["ttft_s"]["p50"], result["served"]["ttft_s"]["p50"]
    result["ttft_p50_served_over_in_process"] = served_ttft / local_ttft if local_ttft and served_ttft else None
    result["target_met"] = ratio >= 0.95 and not served.failures
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"serving_overhead_c{args.concurrency}.json").write_text(json.dumps(result, indent=2))
    _print(result)
    return result


def _served(args, model_dir: Path, eargs: dict[str, Any], jobs: Sequence[Job]) -> Measured:
    """(The server is another process, so no contention figure here: its own CPU would count as others'.)"""
    if args.url:
        return run_served(args.url, jobs, args.concurrency)
    from inflight.launcher.server import TritonServer

    args.out.mkdir(parents=True, exist_ok=True)
    step_log = (args.out / "server_steps.jsonl").resolve()
    step_log.unlink(missing_ok=True)
    params = dict(eargs, model=str(model_dir.resolve()), step_log=str(step_log), stream_interval=args.stream_interval)
    log = args.out / "tritonserver.log"
    with TritonServer(parameters=params, http_port=0, grpc_port=0, metrics_port=0, log=log) as srv:
        srv.wait_ready(timeout_s=300)
        start = time.time()
        m = run_served(srv.grpc_url, jobs, args.concurrency)
        m.engine_busy, m.mean_running = step_log_stats(step_log, start, time.time())
    return m


def _print(result: dict[str, Any]) -> None:
    def pct(d: dict) -> str:
        return " / ".join("—" if d[k] is None else f"{1000 * d[k]:.0f}" for k in ("p50", "p90", "p99"))

    def share(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.0f}%"

    head = f"{'tok/s':>7}  {'TTFT ms p50/p90/p99':<22}{'ITL ms p50/p90/p99':<22}failures  engine busy  running"
    print(f"\n{'':<12}{head}")
    for key in ("in_process", "served"):
        r = result[key]
        running = "—" if r["mean_running"] is None else f"{r['mean_running']:.1f}"
        print(
            f"{key:<12}{r['tokens_per_s']:>7.0f}  {pct(r['ttft_s']):<22}{pct(r['itl_s']):<22}{r['num_failures']:<10}"
            f"{share(r['engine_busy']):<13}{running}"
        )
    ratio = result["served_over_in_process"]
    print(f"\nserved ÷ in-process: {ratio:.2f} (target >= 0.95: {'MET' if result['target_met'] else 'MISSED'})")
    if result["ttft_p50_served_over_in_process"] is not None:
        print(f"TTFT p50 served ÷ in-process: {result['ttft_p50_served_over_in_process']:.2f} (target <= 1.1)")


if __name__ == "__main__":
    main()
