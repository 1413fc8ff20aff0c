"""A few seconds of Locust against the session's tritonserver: the load test itself must work. It runs as
`python -m loadtest.run_locust` in its own process (importing locust would monkey-patch pytest with gevent)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_locust_streams_tokens_without_failures(server, tmp_path):
    out = tmp_path / "locust"
    args = [
        "--host", server.grpc_url,
        "--users", "4",
        "--spawn-rate", "4",
        "--run-time", "5s",
        "--stop-timeout", "60",
        "--output-len-max", "24",
        "--prompt-len-max", "48",
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ) | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.run_locust", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    with (out / "locust_stats.csv").open() as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    generate = stats["generate"]
    assert int(generate["Request Count"]) > 0
    assert int(generate["Failure Count"]) == 0
    assert float(generate["Average Content Size"]) >= 8  # response length = output tokens, at least the minimum
    assert int(stats["ttft"]["Request Count"]) == int(generate["Request Count"])
    assert int(stats["itl"]["Request Count"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] > 0 and summary["failures"] == 0 and summary["output_tokens_per_s"] > 0
    assert (out / "locust.html").stat().st_size > 0
