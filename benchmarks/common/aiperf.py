"""NVIDIA AIPerf as the one client of the serving benchmarks: its command lines and its JSON export's headline
figures. AIPerf lives in a virtualenv of its own (AIPERF_VENV, default .cache/aiperf-venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("AIPERF_VENV", REPO / ".cache" / "aiperf-venv"))
TRITON_TEMPLATE = REPO / "loadtest" / "aiperf" / "generate_stream.json.j2"


def openai_endpoint(endpoint_type: str = "completions") -> list[str]:
    """An OpenAI-compatible server (vLLM's, or our OpenAI port): completions or chat."""
    return ["--endpoint-type", endpoint_type]


def triton_generate_stream() -> list[str]:
    """Triton's HTTP generate_stream through AIPerf's template endpoint (the vLLM backend's payload)."""
    return [
        "--endpoint", "/v2/models/llm/generate_stream", "--endpoint-type", "template",
        "--extra-inputs", f"payload_template:{TRITON_TEMPLATE}", "--extra-inputs", "response_field:text_output",
    ]  # fmt: skip


def profile_command(
    url: str,
    endpoint: list[str],
    tokenizer: str,
    out: Path,
    requests: int,
    concurrency: int,
    input_tokens: int,
    output_tokens: int,
    model: str = "llm",
    warmup: int = 4,
) -> list[str]:
    """Streaming requests of exactly `output_tokens` (ignore_eos + min_tokens), synthetic prompts of
    `input_tokens`, `concurrency` in flight, seeded; `warmup` requests first, not measured."""
    return [
        str(VENV / "bin" / "aiperf"), "profile",
        "--model", model, "--url", url, *endpoint, "--streaming",
        "--tokenizer", tokenizer,
        "--request-count", str(requests), "--concurrency", str(concurrency),
        "--prompt-input-tokens-mean", str(input_tokens), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(output_tokens), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{output_tokens}",
        "--warmup-request-count", str(warmup), "--random-seed", "0",
        "--output-artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip


def summarize(out: Path) -> dict[str, Any]:
    """Requests, errors and the headline metrics from AIPerf's top-level JSON export under `out`."""
    exports = sorted(out.rglob("profile_export_aiperf.json"), key=lambda p: len(p.parts))
    if not exports:
        raise SystemExit(f"aiperf wrote no profile_export_aiperf.json under {out}")
    data = json.loads(exports[0].read_text())

    def stat(name: str, key: str = "avg") -> float | None:
        metric = data.get(name)
        return metric.get(key) if isinstance(metric, dict) else None

    errors = data.get("error_summary") or []
    return {
        "export": str(exports[0]),
        "requests": stat("request_count"),
        "errors": sum(e.get("count", 0) for e in errors),
        "error_rate_pct": stat("request_error_rate"),
        "error_summary": errors,
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "output_tokens_per_s": stat("output_token_throughput"),
        "request_latency_p50_ms": stat("request_latency", "p50"),
    }


def require() -> None:
    if not (VENV / "bin" / "aiperf").exists():
        raise SystemExit(f"no aiperf in {VENV}: `make aiperf-openai` creates it")


def run(name: str, cmd: list[str], out: Path) -> dict[str, Any]:
    """Run one `profile_command` (its output in out/aiperf.log) and return `summarize(out)`, said in a line."""
    print(f"  {name}: $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "aiperf.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    summary = summarize(out)
    said = (
        f"{summary['output_tokens_per_s']:.1f} output tok/s, ITL p50 {summary['itl_p50_ms']:.1f} ms, "
        f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms, {summary['errors']} errors"
    )
    print(f"  {name}: {said}", file=sys.stderr, flush=True)
    return summary
