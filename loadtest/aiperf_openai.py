"""A bounded AIPerf run against the OpenAI-compatible API (`--endpoint-type chat --streaming`).

    make aiperf-openai                                    # launches tritonserver + the API (demo model)
    python -m loadtest.aiperf_openai --url http://localhost:9000 --tokenizer DIR --request-count 200

AIPerf runs from its own virtualenv (AIPERF_VENV, default .cache/aiperf-venv; `make aiperf-openai` creates
it). Artifacts land in loadtest/results/aiperf-openai/. Exit status is non-zero when any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common.aiperf import summarize

REPO = Path(__file__).resolve().parent.parent
# Small enough for 2 CPU cores; the queue still builds when the concurrency exceeds max_num_seqs.
SERVER_ARGS = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "num_kv_blocks": 16 * 48, "max_model_len": 768}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running OpenAI-compatible API (default: launch one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for AIPerf's prompts (default: the demo model)")
    p.add_argument("--aiperf-venv", type=Path, default=Path(os.environ.get("AIPERF_VENV", REPO / ".cache/aiperf-venv")))
    p.add_argument("--request-count", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/aiperf-openai"))
    return p.parse_args(argv)


def aiperf_command(args: argparse.Namespace, url: str, tokenizer: str) -> list[str]:
    return [
        str(args.aiperf_venv / "bin" / "aiperf"), "profile",
        "--model", "llm",
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", tokenizer,
        "--request-count", str(args.request_count),
        "--concurrency", str(args.concurrency),
        "--prompt-input-tokens-mean", str(args.input_tokens),
        "--prompt-output-tokens-mean", str(args.output_tokens),
        "--extra-inputs", "ignore_eos:true",  # every request runs its full output length
        "--use-server-token-count",  # the API's usage (the model's counts), not a re-tokenization of the text
        "--warmup-request-count", "4",
        "--random-seed", "0",
        "--output-artifact-dir", str(args.out),
        "--ui-type", "none",
    ]  # fmt: skip


def run(args: argparse.Namespace, url: str, tokenizer: str) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = aiperf_command(args, url, tokenizer)
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO)
    summary = summarize(args.out)
    print(json.dumps(summary, indent=2))
    failed = summary["errors"] or summary["error_rate_pct"] or not summary["requests"]
    return 1 if proc.returncode != 0 or failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.aiperf_venv / "bin" / "aiperf").exists():
        raise SystemExit(f"no aiperf in {args.aiperf_venv}: `make aiperf-openai` creates it")
    if args.url is not None:
        if args.tokenizer is None:
            raise SystemExit("--tokenizer is needed with --url (the served checkpoint's directory)")
        return run(args, args.url, args.tokenizer)

    from inflight.demo_model import cached_demo_model
    from inflight.launcher.server import TritonServer
    from inflight.serving.openai import OpenAIServer

    model = str(cached_demo_model())
    args.out.mkdir(parents=True, exist_ok=True)
    params = dict(SERVER_ARGS, model=model)
    with TritonServer(parameters=params, http_port=0, grpc_port=0, metrics_port=0, log=args.out / "server.log") as srv:
        srv.wait_ready()
        with OpenAIServer(srv.grpc_url, port=0, host="127.0.0.1") as api:
            return run(args, api.url, args.tokenizer or model)


if __name__ == "__main__":
    sys.exit(main())
