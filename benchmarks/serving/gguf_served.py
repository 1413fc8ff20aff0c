"""A GGUF file served as shipped: inflight on its packed blocks, inflight on the weights dequantized (bf16, fp32),
and llama.cpp's own server (`llama-server`) on the same file, with one client (NVIDIA AIPerf) at several
concurrencies.

    python -m benchmarks.serving.gguf_served                                  # SmolLM2 Q4_1, 1 4 16 32 in flight
    python -m benchmarks.serving.gguf_served --concurrency 1 32 --targets packed llamacpp

llama-server comes from `bash benchmarks/peers/llamacpp.sh` (LLAMA_SERVER, or $HOME/.cache/llamacpp-peer),
run with `-np 32 -c 32768 --cont-batching`, `-t --llamacpp-threads` (default 1) and OMP_WAIT_POLICY=PASSIVE (under
AIPerf's spinning client, `-t 2` with spinning OpenMP threads collapses to a few tok/s). inflight is measured through
Triton's HTTP generate_stream, llama-server through its OpenAI completions endpoint; every target gets the same
seeded synthetic prompts of `--input-tokens` and exactly `--output-tokens` output tokens. Beside tok/s, ITL and
TTFT, the engine core's resident memory (VmRSS, RssAnon of /proc) and llama-server's are recorded. JSON and a plot
land in benchmarks/results/gguf_served/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import aiperf
from benchmarks.common.models import resolve_model
from benchmarks.serving.peers_served import stop_group, wait_http
from inflight.launcher.server import TritonServer, free_port
from inflight.model_source import default_model_path

REPO = Path(__file__).resolve().parents[2]
LLAMACPP_DIR = Path(os.environ.get("LLAMACPP_DIR", Path.home() / ".cache" / "llamacpp-peer"))
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", LLAMACPP_DIR / "build" / "bin" / "llama-server"))
# target -> (dtype, weight_format) of inflight's engine
INFLIGHT = {"packed": ("bfloat16", "packed"), "bf16": ("bfloat16", "dequantized"), "fp32": ("float32", "dequantized")}
TARGETS = (*INFLIGHT, "llamacpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--tokenizer", default="smollm2", help="AIPerf's tokenizer: a benchmark model name or an HF dir")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests = this x concurrency (at least 8)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="inflight's KV cache (default: its budget)")
    p.add_argument("--llamacpp-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gguf_served")
    return p.parse_args(argv)


def proc_memory_mib(pid: int | None) -> dict[str, float | None]:
    """VmRSS and RssAnon of a process, MiB (None when it is gone)."""
    out: dict[str, float | None] = {"rss_mib": None, "rss_anon_mib": None}
    if pid is None:
        return out
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    out["rss_mib" if key == "VmRSS" else "rss_anon_mib"] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def sweep(args, name: str, url: str, endpoint: list[str], tokenizer: Path, out: Path) -> list[dict[str, Any]]:
    rows = []
    for c in args.concurrency:
        where = out / f"c{c}"
        cmd = aiperf.profile_command(
            url, endpoint, str(tokenizer), where, max(8, args.requests_per_slot * c), c, args.input_tokens,
            args.output_tokens,
        )  # fmt: skip
        rows.append(aiperf.run(f"{name} @ {c}", cmd, where) | {"concurrency": c})
    return rows


def run_inflight(args, target: str, gguf: Path, tokenizer: Path, out: Path) -> dict[str, Any]:
    dtype, weight_format = INFLIGHT[target]
    params = {"model": str(gguf), "dtype": dtype, "weight_format": weight_format,
              "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}  # fmt: skip
    if args.num_kv_blocks:
        params["num_kv_blocks"] = args.num_kv_blocks
    out.mkdir(parents=True, exist_ok=True)
    with TritonServer(parameters=params, http_port=0, grpc_port=0, metrics_port=0, log=out / "server.log") as srv:
        srv.wait_ready()
        metrics = scrape(srv.metrics_url)
        pid = metrics.get("inflight_engine_core_pid")
        memory = proc_memory_mib(int(pid) if pid else None)
        rows = sweep(args, target, srv.http_url, aiperf.triton_generate_stream(), tokenizer, out)
    return {"memory": memory, "weight_bytes": metrics.get("inflight_model_weight_bytes"), "rows": rows}


def run_llamacpp(args, gguf: Path, tokenizer: Path, out: Path) -> dict[str, Any]:
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"no llama-server at {LLAMA_SERVER}: run `bash benchmarks/peers/llamacpp.sh`")
    port = free_port()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "32",
           "-c", "32768", "--cont-batching", "-t", str(args.llamacpp_threads), "--alias", "llm"]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 300, log)
        memory = proc_memory_mib(proc.pid)
        rows = sweep(args, "llamacpp", f"http://127.0.0.1:{port}", aiperf.openai_endpoint(), tokenizer, out)
        return {"memory": memory, "weight_bytes": None, "rows": rows, "command": " ".join(cmd)}
    finally:
        stop_group(proc, signal.SIGTERM)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"packed": "tab:blue", "bf16": "tab:cyan", "fp32": "tab:purple", "llamacpp": "tab:gray"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for target, result in results.items():
        c = [r["concurrency"] for r in result["rows"]]
        left.plot(c, [r["output_tokens_per_s"] for r in result["rows"]], "o-", color=colors[target], label=target)
        right.plot(c, [r["itl_p50_ms"] for r in result["rows"]], "o-", color=colors[target], label=target)
    for ax, name, unit in ((left, "Output throughput (higher is better)", "output tokens / s"),
                           (right, "Inter-token latency p50 (lower is better)", "ms")):  # fmt: skip
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for result in results.values() for r in result["rows"]})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(unit)
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    aiperf.require()
    gguf = (args.gguf or default_model_path()).resolve()
    tokenizer = resolve_model(args.tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for target in args.targets:
        print(f"{target}: {gguf.name}", file=sys.stderr, flush=True)
        where = args.out / target
        if target == "llamacpp":
            results[target] = run_llamacpp(args, gguf, tokenizer, where)
        else:
            results[target] = run_inflight(args, target, gguf, tokenizer, where)
    summary = {"gguf": str(gguf), "settings": {k: str(v) for k, v in vars(args).items()}, "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "gguf_served.png", f"{gguf.name}, {args.input_tokens} in / {args.output_tokens} out")
    for target, result in results.items():
        cells = ", ".join(
            f"@{r['concurrency']} {r['output_tokens_per_s']:.0f} tok/s ITL {r['itl_p50_ms']:.1f} ms"
            for r in result["rows"]
        )
        print(f"{target}: {cells}; RSS {result['memory']['rss_mib']} MiB")
    return summary


if __name__ == "__main__":
    main()
