"""Helpers shared by the e2e tests: Prometheus samples (inflight.serving.prometheus_text) and polling."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from inflight.serving import prometheus_text

# Small enough for 2 CPU cores, big enough that 32 concurrent streams queue up (max_num_seqs) and
# long requests can be cancelled mid-stream.
ENGINE_ARGS = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "block_size": 16,
    "num_kv_blocks": 96,
    "max_model_len": 512,
}


def scrape(metrics_url: str) -> prometheus_text.Samples:
    return prometheus_text.scrape(metrics_url, timeout_s=10)  # a busy 2-core box answers slowly


def metric(samples: dict, name: str, **labels: str) -> float:
    want = {("model", "llm"), ("version", "1"), *labels.items()}
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def wait_for(condition, timeout_s: float = 15.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# The server publishes metrics from one engine snapshot at most this often.
METRICS_INTERVAL_S = 0.5


def settled(server, timeout_s: float = 15.0) -> dict:
    """Metrics once the engine is idle: idle in two scrapes a publication interval apart with the same
    counters (a snapshot taken in a gap between requests also shows an idle engine). Counters and gauges
    come from the same snapshot."""
    previous: list[dict] = []

    def idle():
        samples = scrape(server.metrics_url)
        running = metric(samples, "inflight_requests", state="running")
        waiting = metric(samples, "inflight_requests", state="waiting")
        if running or waiting:
            previous.clear()
            return None
        counters = [metric(samples, f"inflight_{n}_total") for n in ("prompt_tokens", "generation_tokens")]
        if previous and previous[0] == counters:
            return samples
        previous[:] = [counters]
        time.sleep(METRICS_INTERVAL_S + 0.1)
        return None

    samples = wait_for(idle, timeout_s)
    assert samples, f"engine still busy after {timeout_s} s"
    return samples


def http_generate(server, body: dict) -> tuple[int, dict]:
    """POST to Triton's HTTP generate endpoint; (HTTP status, JSON reply)."""
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/llm/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
