"""A few seconds of Locust against the session's tritonserver: the load test itself must work."""

from __future__ import annotations

import importlib.util
import json

import pytest

# Only look for it: importing locust monkey-patches the whole pytest process with gevent.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed", allow_module_level=True)


from loadtest import run_locust


def test_locust_streams_tokens_without_failures(server, tmp_path):
    out = tmp_path / "locust"
    code = run_locust.main(
        [
            "--host", server.grpc_url,
            "--users", "4",
            "--spawn-rate", "4",
            "--run-time", "5s",
            "--stop-timeout", "60",
            "--output-len-max", "24",
            "--prompt-len-max", "48",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    stats = run_locust.read_stats(out)
    generate = stats["generate"]
    assert int(generate["Request Count"]) > 0
    assert int(generate["Failure Count"]) == 0
    assert float(generate["Average Content Size"]) >= 8  # response length = output tokens, at least the minimum
    assert int(stats["ttft"]["Request Count"]) == int(generate["Request Count"])
    assert int(stats["itl"]["Request Count"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] > 0 and summary["failures"] == 0 and summary["output_tokens_per_s"] > 0
    assert (out / "locust.html").stat().st_size > 0
