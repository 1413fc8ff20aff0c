"""Triton's metrics port shows the engine's metrics, with plausible values after traffic."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from e2e_util import ENGINE_ARGS, metric, settled
from helpers import PROMPTS

GAUGES = [
    ("inflight_requests", {"state": "running"}),
    ("inflight_requests", {"state": "waiting"}),
    ("inflight_kv_blocks", {"state": "used"}),
    ("inflight_kv_blocks", {"state": "free"}),
    ("inflight_batch_occupancy_ratio", {}),
]
COUNTERS = ["inflight_preemptions_total", "inflight_prompt_tokens_total", "inflight_generation_tokens_total"]
HISTOGRAMS = [
    "inflight_time_to_first_token_seconds",
    "inflight_time_per_output_token_seconds",
    "inflight_e2e_request_latency_seconds",
]


def test_metrics_after_traffic(client, server):
    before = settled(server)
    n, max_tokens = 6, 10
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: client.generate(p, params), PROMPTS[:n]))
    after = settled(server)

    for name, labels in GAUGES:
        metric(after, name, **labels)  # present, with model/version labels
    assert metric(after, "inflight_kv_blocks", state="used") == 0
    assert metric(after, "inflight_kv_blocks", state="free") == ENGINE_ARGS["num_kv_blocks"]
    assert 0 <= metric(after, "inflight_batch_occupancy_ratio") <= 1

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("inflight_generation_tokens_total") == n * max_tokens
    assert delta("inflight_prompt_tokens_total") >= n  # at least one token per prompt
    assert delta("inflight_preemptions_total") >= 0
    for name in HISTOGRAMS:
        assert delta(name + "_count") == n, name
        assert delta(name + "_sum") > 0, name
        assert metric(after, name + "_bucket", le="+Inf") == metric(after, name + "_count")

    # The server's latency histograms agree with what the clients measured (sums, within slack).
    e2e_sum = delta("inflight_e2e_request_latency_seconds_sum")
    assert e2e_sum <= sum(r.e2e_s for r in results) + 0.5
    ttft_sum = delta("inflight_time_to_first_token_seconds_sum")
    assert ttft_sum <= e2e_sum

    # The vLLM backend's names carry the same figures.
    assert delta("vllm:generation_tokens_total") == n * max_tokens
    assert delta("vllm:prompt_tokens_total") == delta("inflight_prompt_tokens_total")
    assert delta("vllm:num_preemptions_total") == delta("inflight_preemptions_total")
    assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:gpu_cache_usage_perc") == 0
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"vllm:{name}_count") == delta(f"inflight_{name}_count") == n


def test_every_declared_series_is_on_the_metrics_page(server):
    from inflight.serving import metrics as m

    page = {name for name, _ in settled(server)}
    declared = {n.name for group in (m.COUNTERS, m.GAUGES, m.CORE_GAUGES) for names in group.values() for n in names}
    declared |= {n.name for n in m.CORE_STARTS}
    declared |= {n.name + "_count" for names, _ in m.HISTOGRAMS.values() for n in names}
    assert declared <= page, sorted(declared - page)
    assert metric(settled(server), "inflight_engine_core_starts_total") >= 1


def test_model_weight_bytes_is_what_the_engine_holds(server, offline_llm):
    """The same model and settings in-process hold exactly the bytes the server's core reports."""
    reported = metric(settled(server), "inflight_model_weight_bytes")
    assert reported == offline_llm.engine.model_weight_bytes > 0
