"""What serving costs: CPU seconds per output token of the whole server side against the engine in-process.

    python -m benchmarks.serving.cost_per_token                  # SmolLM2 (the default model), ~15 min on 2 cores
    python -m benchmarks.serving.cost_per_token --concurrency 32 --paths grpc --requests-per-client 2

The same trace (word prompts of 32-256 tokens, exactly `--output-len` output tokens, greedy) runs at each
concurrency as a closed loop of that many clients, three ways, in turns (each concurrency: in-process, then
each served path, so that both sides see the same machine):
- in-process: `LLM` in a child process of its own (text in, text out, the same engine settings), which
  reads its own CPU time around the run;
- served over Triton's gRPC stream, and over the OpenAI API (`/v1/completions`, SSE), against one
  `inflight serve` (default model): its CPU is utime + stime from /proc/<pid>/stat of every process in its tree
  (the launcher with the OpenAI API and supervisor, tritonserver, the Python stubs, the engine core), read
  before and after each run. The clients run in this process and are not counted.
Both sides first run every prompt of the largest run for a few tokens (warm-up, not measured); prefix caching
is off on both (the runs repeat the trace's prompts). Figures: CPU ms per output token, served ÷ in-process
over all rounds (and per round), the split by process (and the busiest threads), the server's idle cost per
second, and the share of the CPU other processes took during each run (a shared machine inflates both sides).
JSON and a plot go to benchmarks/results/cost_per_token.{json,png}.
"""

from __future__ import annotations

from inflight import omp

omp.apply()  # both sides under the server's OpenMP policy, set before torch loads

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections import deque  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402

from benchmarks.common.host import describe_host  # noqa: E402
from benchmarks.common.metrics import busy_cpu_s  # noqa: E402
from benchmarks.common.plots import cost_per_token_bars  # noqa: E402
from benchmarks.common.trace import TraceSpec, make_trace, word_prompts  # noqa: E402
from benchmarks.serving.openai_overhead import Clients  # noqa: E402

RESULTS = Path("benchmarks/results")
TICKS = os.sysconf("SC_CLK_TCK")
TARGETS = {1: 1.3, 32: 1.15}  # served ÷ in-process, at most


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: str
    output_len: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="checkpoint, GGUF or 'demo' (default: the default model, SmolLM2)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="clients in the closed loop")
    p.add_argument("--paths", nargs="+", default=["grpc", "openai"], choices=["grpc", "openai"])
    p.add_argument("--requests-per-client", type=int, default=4, help="requests per run: this x concurrency ...")
    p.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="rounds over every concurrency and side")
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds the server's idle cost is measured over")
    p.add_argument("--out", type=Path, default=RESULTS / "cost_per_token.json")
    return p.parse_args(argv)


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings both sides run with (the default model: SmolLM2-135M-Instruct's GGUF)."""
    max_model_len = args.prompt_len[1] * 2 + args.output_len  # word prompts run a little over a token a word
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": max_model_len,
        "num_kv_blocks": args.max_num_seqs * -(-max_model_len // 16),  # every slot at full length: no preemption
        # Runs repeat the trace's prompts: a prefix cache would serve later runs' prompts from earlier ones.
        "enable_prefix_caching": False,
    }


def make_jobs(args: argparse.Namespace, n: int) -> list[Job]:
    """The first n requests of one seeded trace: every run serves a prefix of the same work."""
    spec = TraceSpec(max(n, 1), tuple(args.prompt_len), (args.output_len, args.output_len), "fixed", seed=0)
    trace = make_trace(spec, vocab_size=1000)  # only the lengths are used: the prompts are words
    return [Job(r.request_id, text, r.output_len) for r, text in zip(trace, word_prompts(trace))][:n]


# ---- CPU time from /proc ----------------------------------------------------------------------------------


def _stat_cpu(path: str) -> tuple[str, float] | None:
    """(command name, utime + stime in seconds) from a /proc stat file; None if it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return text[text.find("(") + 1 : text.rfind(")")], (int(fields[11]) + int(fields[12])) / TICKS


def _label(proc: psutil.Process, root: int) -> str:
    """What a process of the server's tree is: the launcher, tritonserver, a model's stub, the engine core."""
    if proc.pid == root:
        return "launcher (OpenAI API, supervisor)"
    try:
        name, argv = proc.name(), proc.cmdline()
        parent = proc.parent()
        parent_argv = parent.cmdline() if parent is not None else []
    except psutil.Error:
        return "gone"
    if name.startswith("tritonserver"):
        return "tritonserver"
    if name.startswith("triton_python"):
        instance = next((a for a in reversed(argv) if a.endswith("_0_0")), "?")
        return f"stub {instance.removesuffix('_0_0')}"
    if "llm_0_0" in parent_argv:
        return "engine core" if any("spawn_main" in a for a in argv) else "stub helper"
    return name


class Tree:
    """The processes under `root` (itself included), their labels, and their CPU seconds (per thread too)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.labels: dict[int, str] = {}

    def sample(self) -> dict[int, dict[str, Any]]:
        procs = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
        out = {}
        for proc in procs:
            if proc.pid not in self.labels:
                self.labels[proc.pid] = _label(proc, self.root)
            total = _stat_cpu(f"/proc/{proc.pid}/stat")
            if total is None or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            threads = {}
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{proc.pid}/task"):
                    one = _stat_cpu(f"/proc/{proc.pid}/task/{tid}/stat")
                    if one is not None:
                        threads[int(tid)] = one
            out[proc.pid] = {"label": self.labels[proc.pid], "cpu_s": total[1], "threads": threads}
        return out


def cpu_between(before: dict, after: dict) -> dict[str, Any]:
    """CPU seconds per process label between two samples (a process new since `before` counts from zero), and
    the busiest threads."""
    by_label: dict[str, float] = {}
    threads = []
    for pid, now in after.items():
        then = before.get(pid, {"cpu_s": 0.0, "threads": {}})
        by_label[now["label"]] = by_label.get(now["label"], 0.0) + now["cpu_s"] - then["cpu_s"]
        for tid, (name, cpu) in now["threads"].items():
            spent = cpu - then["threads"].get(tid, (name, 0.0))[1]
            if spent > 0:
                threads.append({"process": now["label"], "tid": tid, "name": name, "cpu_s": round(spent, 3)})
    gone = [before[pid]["label"] for pid in set(before) - set(after)]
    threads.sort(key=lambda t: -t["cpu_s"])
    return {"by_process": by_label, "threads": threads[:12], "gone": gone}


def own_cpu() -> float:
    return _stat_cpu("/proc/self/stat")[1]


# ---- the two sides ---------------------------------------------------------------------------------------


def run_in_process(llm, jobs: list[Job], concurrency: int) -> dict[str, Any]:
    """A closed loop of `concurrency` requests over `LLM.add_request` / `step` (text in, text out)."""
    from inflight.sampling_params import SamplingParams

    pending = deque(jobs)
    running = tokens = 0
    cpu0, busy0, t0 = own_cpu(), busy_cpu_s(), time.monotonic()
    while pending or llm.has_unfinished_requests():
        while pending and running < concurrency:
            job = pending.popleft()
            params = SamplingParams(max_tokens=job.output_len, ignore_eos=True, temperature=0.0)
            llm.add_request(job.request_id, job.prompt, params)
            running += 1
        for out in llm.step():
            tokens += len(out.new_token_ids)
            running -= out.finished
    cpu, wall = own_cpu() - cpu0, time.monotonic() - t0
    return {"cpu_s": cpu, "wall_s": wall, "output_tokens": tokens, "others_share": _share(busy0, cpu, wall)}


async def run_served(clients: Clients, path: str, jobs: list[Job], concurrency: int) -> dict[str, Any]:
    queue = deque(jobs)
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            job = queue.popleft()
            params = {"max_tokens": job.output_len, "temperature": 0, "ignore_eos": True}
            _, n = await clients.one(path, job.prompt, params)
            tokens += n

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"wall_s": time.monotonic() - t0, "output_tokens": tokens}


@contextlib.contextmanager
def inflight_serve(model: str, eargs: dict[str, Any], log: Path):
    """`inflight serve` (`model`; "": the default one) on free ports until its OpenAI API's /health says ready."""
    from inflight.launcher.server import free_ports

    http, grpc, metrics, api = free_ports(4)
    flags = [_flag(k, v) for k, v in eargs.items()] + ([f"--model={model}"] if model else [])
    cmd = [sys.executable, "-m", "inflight.launcher.cli", "serve", f"--http-port={http}", f"--grpc-port={grpc}",
           f"--metrics-port={metrics}", f"--openai-port={api}", *flags]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    api_url = f"http://127.0.0.1:{api}"
    try:
        deadline = time.monotonic() + 900
        while not _ok(f"{api_url}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"inflight serve did not become ready; log: {log}")
            time.sleep(0.5)
        yield proc, f"localhost:{grpc}", api_url
    finally:
        proc.send_signal(2)  # SIGINT: a clean stop
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def _flag(name: str, value: object) -> str:
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag}={value}"


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


# ---- the benchmark -----------------------------------------------------------------------------------------


def _in_process_worker(conn, model: str, eargs: dict[str, Any]) -> None:
    """A child process holding the in-process engine, so that its CPU is the engine's alone: (jobs, c) in,
    the run out."""
    from inflight import LLM
    from inflight.sampling_params import SamplingParams

    llm = LLM(model or None, **eargs)
    llm.generate(["warm up the engine with a short prompt"], SamplingParams(max_tokens=8, ignore_eos=True))
    conn.send("ready")
    while (work := conn.recv()) is not None:
        conn.send(run_in_process(llm, *work))


class InProcess:
    def __init__(self, model: str, eargs: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_in_process_worker, args=(child, model, eargs), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise SystemExit("the in-process engine did not start")

    def run(self, jobs: list[Job], concurrency: int) -> dict[str, Any]:
        self.conn.send((jobs, concurrency))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


async def run_round(args, local: InProcess, clients: Clients, tree: Tree, runs: dict) -> None:
    """Each concurrency in turn, in-process then every served path, so that both sides see the same machine."""
    for c in args.concurrency:
        jobs = make_jobs(args, max(args.min_requests, args.requests_per_client * c))
        run = local.run(jobs, c)
        runs.setdefault(("in_process", c), []).append(run)
        _progress("in-process", c, run)
        for path in args.paths:
            before, busy0, own0 = tree.sample(), busy_cpu_s(), own_cpu()
            run = await run_served(clients, path, jobs, c)
            split = cpu_between(before, tree.sample())
            cpu = sum(split["by_process"].values())
            others = _share(busy0, cpu + own_cpu() - own0, run["wall_s"])  # neither the server nor its clients
            runs.setdefault((path, c), []).append(run | split | {"cpu_s": cpu, "others_share": others})
            _progress(path, c, runs[(path, c)][-1])


async def measure(args, local: InProcess, tree: Tree, grpc_url: str, api_url: str) -> dict:
    clients = Clients(grpc_url, api_url, max(args.concurrency))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        # Warm-up, not measured: every prompt of the largest run, a few tokens each, through every side (first
        # touches of the KV cache's pages, the thread choices per step size, the connections).
        warm = [Job(j.request_id, j.prompt, 8) for j in make_jobs(args, max(args.concurrency) * 2)]
        local.run(warm, max(args.concurrency))
        for path in args.paths:
            await run_served(clients, path, warm, max(args.concurrency))
        for _ in range(args.rounds):
            await run_round(args, local, clients, tree, runs)
    finally:
        await clients.close()
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    eargs = engine_args(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    local = InProcess(args.model, eargs)
    try:
        with inflight_serve(args.model, eargs, args.out.with_suffix(".server.log")) as (proc, grpc_url, api_url):
            tree = Tree(proc.pid)
            before = tree.sample()
            time.sleep(args.idle_s)
            idle = cpu_between(before, tree.sample())
            runs = asyncio.run(measure(args, local, tree, grpc_url, api_url))
    finally:
        local.close()
    result = report(args, eargs, runs, idle)
    args.out.write_text(json.dumps(result, indent=2))
    cost_per_token_bars(result, args.out.with_suffix(".png"))
    _print(result)
    return result


def report(args, eargs, runs, idle) -> dict[str, Any]:
    rows = []
    for path in args.paths:
        for c in args.concurrency:
            base, served = runs[("in_process", c)], runs[(path, c)]
            ratio = _ms(*served) / _ms(*base)
            by_process: dict[str, float] = {}
            for run in served:
                for name, cpu in run["by_process"].items():
                    by_process[name] = by_process.get(name, 0.0) + cpu
            tokens = sum(r["output_tokens"] for r in served)
            rows.append({
                "path": path,
                "concurrency": c,
                "in_process_cpu_ms_per_token": round(_ms(*base), 3),
                "served_cpu_ms_per_token": round(_ms(*served), 3),
                "ratio": round(ratio, 3),
                "ratio_per_round": [round(_ms(s) / _ms(b), 3) for s, b in zip(served, base)],
                "target": TARGETS.get(c),
                "met": None if c not in TARGETS else ratio <= TARGETS[c],
                "by_process_cpu_ms_per_token": {k: round(1000 * v / tokens, 3)
                                               for k, v in sorted(by_process.items(), key=lambda kv: -kv[1])},
                "served_tokens_per_s": _rate(served),
                "in_process_tokens_per_s": _rate(base),
                "others_cpu_share": {"in_process": [r["others_share"] for r in base],
                                     "served": [r["others_share"] for r in served]},
                "busiest_threads": served[-1]["threads"],
            })  # fmt: skip
    return {
        "host": describe_host(),
        "model": args.model or "SmolLM2-135M-Instruct (the default GGUF)",
        "engine": eargs,
        "trace": {"prompt_len": list(args.prompt_len), "output_len": args.output_len, "prompts": "words"},
        "rounds": args.rounds,
        "rows": rows,
        "runs": {
            f"{side}@{c}": [{k: v for k, v in r.items() if k != "threads"} for r in rs]
            for (side, c), rs in runs.items()
        },
        "idle_cpu_ms_per_s": {k: round(1000 * v / args.idle_s, 2) for k, v in idle["by_process"].items()},
    }


def _rate(runs: list[dict[str, Any]]) -> float:
    return round(sum(r["output_tokens"] for r in runs) / sum(r["wall_s"] for r in runs), 1)


def _share(busy0: float, own_s: float, wall_s: float) -> float:
    """The share of the machine's CPU that processes other than the measured ones took during a run."""
    return round(max(0.0, busy_cpu_s() - busy0 - own_s) / (wall_s * (os.cpu_count() or 1)), 3)


def _ms(*runs: dict[str, Any]) -> float:
    """CPU ms per output token over one run or several together."""
    return 1000 * sum(r["cpu_s"] for r in runs) / max(1, sum(r["output_tokens"] for r in runs))


def _progress(name: str, c: int, run: dict[str, Any]) -> None:
    rate, others = run["output_tokens"] / run["wall_s"], run["others_share"]
    print(f"{name:<11} c={c:<3} {_ms(run):.2f} CPU ms/token  {rate:.0f} tok/s  (others took {others:.0%} of the CPU)",
          file=sys.stderr, flush=True)  # fmt: skip


def _print(result: dict[str, Any]) -> None:
    print(f"\n{result['host']}\n")
    print(f"{'path':<8}{'c':>4}{'in-process':>12}{'served':>9}{'ratio':>8}  target      by process (CPU ms/token)")
    for r in result["rows"]:
        target = "—" if r["target"] is None else f"<={r['target']}" + (" ok" if r["met"] else " MISSED")
        split = ", ".join(f"{k} {v:.2f}" for k, v in r["by_process_cpu_ms_per_token"].items() if v >= 0.005)
        print(f"{r['path']:<8}{r['concurrency']:>4}{r['in_process_cpu_ms_per_token']:>12.2f}"
              f"{r['served_cpu_ms_per_token']:>9.2f}{r['ratio']:>8.2f}  {target:<14}{split}")  # fmt: skip
    print(f"\nidle server, CPU ms per second: {result['idle_cpu_ms_per_s']}")


if __name__ == "__main__":
    main()
