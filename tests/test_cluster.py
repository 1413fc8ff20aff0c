"""`make test-cluster`: two demo-model replicas behind NVIDIA Dynamo's frontend (OpenAI API + router).

- KV-aware routing vs round-robin on a shared-prefix trace (8 system prompts x 24 user turns, in rounds):
  the prefix-cache hit rate (from the replicas' `vllm:prefix_cache_*_total` counters) with KV routing is at
  least 2x round-robin's, and the output throughput higher. The replicas' caches are small on purpose (120
  blocks of 16 tokens: about five of the eight ~350-token system prompts), as a real cache is small against
  real traffic: a router that keeps each system prompt on one replica keeps it cached.
- One replica killed (SIGKILL to its tritonserver) mid-run: its worker leaves Dynamo within seconds, every
  request started after that succeeds on the other replica, and no request hangs.

Needs NVIDIA Dynamo (scripts/install_dynamo.sh); skipped unless INFLIGHT_TEST_CLUSTER=1 (`make test` skips it).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("INFLIGHT_TEST_CLUSTER") != "1":
    pytest.skip("the cluster test runs with `make test-cluster` (INFLIGHT_TEST_CLUSTER=1)", allow_module_level=True)
pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed: scripts/install_dynamo.sh")

from benchmarks.serving.cluster_trace import (  # noqa: E402
    complete,
    prefix_cache_counters,
    run_trace,
    shared_prefix_trace,
    summary,
)
from inflight.launcher.cluster import Cluster  # noqa: E402

PARAMS = {"num_kv_blocks": 120, "max_num_seqs": 8}
CONCURRENCY = 4
MAX_TOKENS = 8
LOGS = Path(os.environ.get("INFLIGHT_CLUSTER_LOGS", "/tmp/inflight-test-cluster"))


def _run(mode: str, trace: list[str]) -> dict:
    cluster = Cluster(
        2,
        "demo",
        mode,
        http_port=18080,
        base_port=18100,
        parameters=PARAMS,
        log_dir=LOGS / mode,
        prefill_load_scale=10.0,
    )
    with cluster:
        model = cluster.model_name()
        before = [prefix_cache_counters(r.metrics_url) for r in cluster.members]
        results = run_trace(cluster.url, model, trace, CONCURRENCY, MAX_TOKENS)
        after = [prefix_cache_counters(r.metrics_url) for r in cluster.members]
    stats = summary(results)
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    stats["hit_rate"] = hits / queries
    stats["per_replica_queries"] = [a[1] - b[1] for a, b in zip(after, before)]
    stats["errors"] = [r.error for r in results if not r.ok][:3]
    print(f"{mode}: {stats}")
    return stats


def test_kv_routing_beats_round_robin():
    trace = shared_prefix_trace(num_prompts=8, suffixes=24)
    rr = _run("round-robin", trace)
    kv = _run("kv", trace)
    assert rr["ok"] == rr["requests"] and kv["ok"] == kv["requests"], (rr["errors"], kv["errors"])
    assert all(q > 0 for q in kv["per_replica_queries"]), "KV routing used only one replica"
    assert kv["hit_rate"] >= 2 * rr["hit_rate"], f"hit rate: kv {kv['hit_rate']:.3f}, round-robin {rr['hit_rate']:.3f}"
    assert kv["output_tok_per_s"] > rr["output_tok_per_s"], (kv["output_tok_per_s"], rr["output_tok_per_s"])


def test_replica_killed_mid_run():
    trace = shared_prefix_trace(num_prompts=8, suffixes=200, seed=1)
    cluster = Cluster(2, "demo", "kv", http_port=18080, base_port=18100, log_dir=LOGS / "kill")
    with cluster:
        model = cluster.model_name()
        results = []
        lock = threading.Lock()
        deadline = [time.monotonic() + 120.0]  # moved closer once the worker has left
        next_prompt = iter(trace)

        def client() -> None:
            while time.monotonic() < deadline[0]:
                with lock:
                    prompt = next(next_prompt, None)
                if prompt is None:
                    return
                r = complete(cluster.url, model, prompt, 16, timeout_s=30.0)
                with lock:
                    results.append(r)

        threads = [threading.Thread(target=client) for _ in range(CONCURRENCY)]
        for t in threads:
            t.start()
        time.sleep(3.0)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        killed_at = time.monotonic()
        cluster.kill_replica(1)
        worker = cluster.members[1].worker
        while worker.poll() is None and time.monotonic() - killed_at < 60:
            time.sleep(0.05)
        left_at = time.monotonic()
        assert worker.poll() is not None, "the dead replica's worker did not leave within 60 s"
        deadline[0] = left_at + 10.0
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a client hung"
    detected = left_at + 1.0  # the frontend sees the worker's discovery record go
    after = [r for r in results if r.start >= detected]
    during = [r for r in results if killed_at <= r.start < detected]
    print(
        f"worker left {left_at - killed_at:.1f}s after the kill; {len(during)} requests in between "
        f"({sum(not r.ok for r in during)} failed); {len(after)} after, {sum(not r.ok for r in after)} failed"
    )
    print("errors:", sorted({r.error[:160] for r in during if not r.ok})[:4])
    assert not any("Timeout" in r.error or "timed out" in r.error for r in results), "a request hung"
    assert len(after) >= 20
    assert all(r.ok for r in after), [r.error for r in after if not r.ok][:3]
    assert left_at - killed_at < 20
