"""A bounded headless Locust run against the server: CSV + HTML reports, output tokens/s on the terminal.

    python -m loadtest.run_locust                           # launches a server (demo model), ~1 minute
    python -m loadtest.run_locust --host localhost:8001 --users 32 --run-time 2m

Exit status is non-zero when any request failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
# Small enough for 2 CPU cores; the queue still builds when users outnumber max_num_seqs.
SERVER_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "num_kv_blocks": 16 * 48, "max_model_len": 768}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=None, help="gRPC address of a running server (default: launch one)")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--spawn-rate", type=float, default=4.0)
    p.add_argument("--run-time", default="45s", help="Locust time string: 30s, 2m, ...")
    p.add_argument("--stop-timeout", type=int, default=60, help="seconds users get to finish their request")
    p.add_argument("--output-len-max", type=int, default=256)
    p.add_argument("--prompt-len-max", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/locust"))
    return p.parse_args(argv)


def locust_command(args: argparse.Namespace, host: str) -> list[str]:
    prefix = args.out / "locust"
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "--users",
        str(args.users),
        "--spawn-rate",
        str(args.spawn_rate),
        "--run-time",
        args.run_time,
        "--stop-timeout",
        str(args.stop_timeout),
        "--host",
        host,
        "--csv",
        str(prefix),
        "--html",
        str(args.out / "locust.html"),
        "--output-len-max",
        str(args.output_len_max),
        "--prompt-len-max",
        str(args.prompt_len_max),
        "--summary-json",
        str(args.out / "summary.json"),
    ]


def run_locust(args: argparse.Namespace, host: str) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run(locust_command(args, host), env=env, cwd=REPO, check=False).returncode


def read_stats(out: Path) -> dict[str, dict[str, Any]]:
    """Locust's `*_stats.csv`, keyed by entry name (generate, ttft, itl, Aggregated)."""
    path = out / "locust_stats.csv"
    if not path.is_file():
        return {}
    with path.open() as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def report(out: Path) -> dict[str, Any]:
    stats = read_stats(out)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    gen = stats.get("generate", {})
    # Locust writes its CSV before the users' last requests finish (--stop-timeout): our counters are final.
    result = {
        "requests": summary.get("requests", int(gen.get("Request Count", 0) or 0)),
        "failures": max(summary.get("failures", 0), int(gen.get("Failure Count", 0) or 0)),
        "output_tokens": summary.get("tokens", 0),
        "output_tokens_per_s": summary.get("output_tokens_per_s", 0.0),
        "ms": {
            name: {p: float(stats[name][p]) for p in ("50%", "90%", "99%") if stats[name].get(p) not in (None, "N/A")}
            for name in ("generate", "ttft", "itl")
            if name in stats
        },
    }
    print(
        f"\nlocust: {result['requests']} requests, {result['failures']} failures, "
        f"{result['output_tokens']} output tokens, {result['output_tokens_per_s']:.0f} output tok/s"
    )
    for name, ps in result["ms"].items():
        print(f"  {name:<9} ms  " + "  ".join(f"p{k[:-1]} {v:.0f}" for k, v in ps.items()))
    print(f"reports: {out / 'locust.html'}, {out}/locust_stats.csv")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.host:
        code = run_locust(args, args.host)
    else:
        from inflight.launcher.server import TritonServer

        args.out.mkdir(parents=True, exist_ok=True)
        log = args.out / "tritonserver.log"
        with TritonServer(parameters=SERVER_ARGS, http_port=0, grpc_port=0, metrics_port=0, log=log) as server:
            server.wait_ready(timeout_s=300)
            code = run_locust(args, server.grpc_url)
    result = report(args.out)
    return 1 if code != 0 or result["failures"] or not result["output_tokens"] else 0


if __name__ == "__main__":
    sys.exit(main())
