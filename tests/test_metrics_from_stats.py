"""Triton metrics from the engine's stats, with a stand-in for pb_utils: deltas add up (across core restarts
too), gauges are set, and each figure goes out under both name families from one declaration."""

from __future__ import annotations

from inflight.engine.stats import IterationStats, SchedulerStats, StepStats
from inflight.serving import metrics as m


class _Metric:
    def __init__(self, labels):
        self.labels, self.value, self.observed = labels, 0, []

    def increment(self, n):
        self.value += n

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class _Family:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

    def __init__(self, name, description, kind):
        assert name not in self.made, f"family {name} registered twice"
        self.name, self.kind, self.metrics = name, kind, []
        self.made[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        metric = _Metric(labels)
        self.metrics.append(metric)
        return metric


def _metrics():
    family = type("MetricFamily", (_Family,), {"made": {}})
    return m.TritonMetrics(type("pb_utils", (), {"MetricFamily": family}), {"model": "llm"}), family.made


def _value(made, name, **labels):
    (metric,) = [x for x in made[name].metrics if all(x.labels.get(k) == v for k, v in labels.items())]
    return metric.value


STEP = StepStats(1.0, 2, 1, 2, 9, 4, 2, 5, 64, 0, 0.25, 0.01, 0.005, 4)


def test_counts_are_added_and_gauges_set_under_both_names():
    metrics, made = _metrics()
    state = SchedulerStats(2, 1, 5, 59, 3, 4, STEP, 0.25)
    metrics.update(state, IterationStats(steps=3, prompt_tokens=7, generation_tokens=5, num_preemptions=1))
    # A new core process starts its counts at zero: its deltas simply add on.
    metrics.update(
        state.idle(), IterationStats(steps=1, generation_tokens=2, spec_decode_num_accepted_tokens_per_pos=(2,))
    )
    assert _value(made, "inflight_generation_tokens_total") == _value(made, "vllm:generation_tokens_total") == 7
    assert _value(made, "inflight_prompt_tokens_total") == _value(made, "vllm:prompt_tokens_total") == 7
    assert _value(made, "inflight_preemptions_total") == _value(made, "vllm:num_preemptions_total") == 1
    assert _value(made, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    assert _value(made, "inflight_requests", state="running") == _value(made, "vllm:num_requests_running") == 0
    assert _value(made, "inflight_kv_blocks", state="free") == 64 and _value(made, "vllm:gpu_cache_usage_perc") == 0
    assert _value(made, "inflight_batch_arrival_spread_max_seconds") == 0.25


def test_every_declared_name_is_registered_once_with_its_series():
    _, made = _metrics()
    declared = [n for group in (m.COUNTERS, m.GAUGES, m.CORE_GAUGES) for names in group.values() for n in names]
    declared += list(m.CORE_STARTS) + [n for names, _ in m.HISTOGRAMS.values() for n in names]
    assert {n.name for n in declared} == set(made)
    assert sorted(x.labels["state"] for x in made["inflight_kv_blocks"].metrics) == ["cached", "free", "used"]
    assert all(x.labels["model"] == "llm" for family in made.values() for x in family.metrics)


def test_histograms_observe_both_names():
    metrics, made = _metrics()
    metrics.observe_request(0.1, None, 0.5)
    assert made["vllm:time_to_first_token_seconds"].metrics[0].observed == [0.1]
    assert made["inflight_time_per_output_token_seconds"].metrics[0].observed == []
    assert made["inflight_e2e_request_latency_seconds"].metrics[0].observed == [0.5]


def test_lora_requests_info_names_running_and_waiting_adapters():
    metrics, made = _metrics()
    base = SchedulerStats(2, 1, 5, 59, 3, 4, STEP, 0.25)
    metrics.update(base, IterationStats())
    assert "vllm:lora_requests_info" not in made  # LoRA off: no series
    lora = SchedulerStats(2, 1, 5, 59, 3, 4, STEP, 0.25, ("a", "b"), ("c",), 4)
    metrics.update(lora, IterationStats())
    metrics.update(lora.idle(), IterationStats())
    series = {tuple(sorted(x.labels.items())): x.value for x in made["vllm:lora_requests_info"].metrics}
    running = dict(next(iter(series))).get("running_lora_adapters")
    assert running == "a,b" and len(series) == 2
    labels = [dict(k) for k in series]
    assert {(x["running_lora_adapters"], x["waiting_lora_adapters"], x["max_lora"]) for x in labels} == {
        ("a,b", "c", "4"),
        ("", "", "4"),
    }
    assert all(v > 1e9 for v in series.values())  # set to the time (vLLM: set_to_current_time)


def test_grammar_cache_bytes_is_a_gauge_and_a_dead_core_holds_none():
    metrics, made = _metrics()
    state = SchedulerStats(2, 1, 5, 59, 3, 4, STEP, 0.25, grammar_cache_bytes=3 << 20)
    metrics.update(state, IterationStats(steps=1))
    assert _value(made, "inflight_grammar_cache_bytes") == 3 << 20
    metrics.update(state.idle(), IterationStats())
    assert _value(made, "inflight_grammar_cache_bytes") == 0
