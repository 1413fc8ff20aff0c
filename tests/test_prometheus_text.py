"""Prometheus text read back (inflight.serving.prometheus_text): Triton's and vLLM's names, labels, counters."""

from __future__ import annotations

from inflight.serving.prometheus_text import matching, parse_samples, sample

TEXT = """\
# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="llm",version="1"} 12
# HELP inflight_kv_cache_capacity_tokens KV cache capacity in tokens
# TYPE inflight_kv_cache_capacity_tokens gauge
inflight_kv_cache_capacity_tokens{model="llm",version="1"} 1536
inflight_kv_cache_capacity_tokens{model="other",version="1"} 64
# HELP inflight_requests Requests by state
# TYPE inflight_requests gauge
inflight_requests{model="llm",version="1",state="running"} 3
inflight_requests{model="llm",version="1",state="waiting"} 0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="a"} 5
vllm:prefix_cache_hits_total{model_name="b"} 7
# TYPE inflight_ttft_seconds histogram
inflight_ttft_seconds_bucket{model="llm",le="0.1"} 2
inflight_ttft_seconds_bucket{model="llm",le="+Inf"} 4
inflight_ttft_seconds_sum{model="llm"} 0.75
inflight_ttft_seconds_count{model="llm"} 4
"""


def test_samples_keep_their_names_and_labels():
    samples = parse_samples(TEXT)
    # a counter declared without _total is read with it, as OpenMetrics names it
    assert samples[("nv_inference_request_success_total", frozenset({("model", "llm"), ("version", "1")}))] == 12
    assert sample(samples, "inflight_kv_cache_capacity_tokens", model="llm") == 1536
    assert sample(samples, "inflight_requests", state="running") == 3
    assert sample(samples, "inflight_requests", state="waiting") == 0
    assert sample(samples, "inflight_ttft_seconds_count", model="llm") == 4
    assert sample(samples, "inflight_ttft_seconds_bucket", le="+Inf") == 4


def test_sample_is_none_unless_exactly_one_matches():
    samples = parse_samples(TEXT)
    assert sample(samples, "inflight_kv_cache_capacity_tokens") is None  # two models
    assert sample(samples, "inflight_requests", state="preempted") is None
    assert sorted(matching(samples, "vllm:prefix_cache_hits_total")) == [5, 7]
    assert matching(samples, "vllm:prefix_cache_hits") == []  # a counter's samples are named with _total
