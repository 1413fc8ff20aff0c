"""Engine metrics on Triton's metrics port, through the Python backend's `pb_utils.MetricFamily`.

The engine loop's responder hands over, at most every ~0.5 s, the core's state (`SchedulerStats`: gauges,
set) and its counts since the last hand-over (`IterationStats`: deltas, added); the latency histograms are
observed per request when its responses are sent (what the client sees). Each figure is declared once,
with the names it is exported under: `inflight_*` and the name of Triton's vLLM backend (`vllm:*`), so
dashboards and autoscalers built on either work. Every family is kept on `self`: a garbage-collected
MetricFamily invalidates its metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType

from inflight.engine.stats import IterationStats, SchedulerStats

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


@dataclass(frozen=True)
class Name:
    """One exported series: the family's name and description, and the labels that tell it from its
    siblings in the family (e.g. `state`)."""

    name: str
    description: str
    labels: tuple[tuple[str, str], ...] = ()


def _names(*pairs: tuple[str, str], **labels: str) -> tuple[Name, ...]:
    return tuple(Name(name, description, tuple(labels.items())) for name, description in pairs)


# Counters: an IterationStats field and the series it advances.
COUNTERS: dict[str, tuple[Name, ...]] = {
    "num_preemptions": _names(
        ("inflight_preemptions_total", "Sequences preempted (KV freed, recomputed)"),
        ("vllm:num_preemptions_total", "Number of preemptions"),
    ),
    "prompt_tokens": _names(
        ("inflight_prompt_tokens_total", "Prompt tokens admitted"),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed"),
    ),
    "generation_tokens": _names(
        ("inflight_generation_tokens_total", "Tokens generated"),
        ("vllm:generation_tokens_total", "Number of generation tokens processed"),
    ),
    # Prefix cache, in prompt tokens looked up / found at first admission (hit rate = hits / queries).
    "prefix_cache_queries": _names(
        ("inflight_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
        ("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens"),
    ),
    "prefix_cache_hits": _names(
        ("inflight_prefix_cache_hits_total", "Prompt tokens served from the prefix cache"),
        ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens"),
    ),
    # Speculative decoding (vLLM's names): proposals verified, their draft tokens, drafts accepted.
    "spec_decode_num_drafts": _names(("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts")),
    "spec_decode_num_draft_tokens": _names(("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens")),
    "spec_decode_num_accepted_tokens": _names(
        ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens")
    ),
}
# Accepted drafts by position in the proposal: label `position`, a series created as positions appear.
ACCEPTED_PER_POSITION = Name("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position")

_BLOCKS = "Paged KV cache blocks by state (cached: free blocks holding a reusable prefix, a subset of free)"
_REQUESTS = "Requests in the engine by state"
# Gauges: a figure of SchedulerStats (see `_gauge_values`) and the series it sets.
GAUGES: dict[str, tuple[Name, ...]] = {
    "running": _names(("inflight_requests", _REQUESTS), state="running")
    + _names(("vllm:num_requests_running", "Number of requests running")),
    "waiting": _names(("inflight_requests", _REQUESTS), state="waiting")
    + _names(("vllm:num_requests_waiting", "Number of requests waiting")),
    "kv_blocks_used": _names(("inflight_kv_blocks", _BLOCKS), state="used"),
    "kv_blocks_free": _names(("inflight_kv_blocks", _BLOCKS), state="free"),
    "kv_blocks_cached": _names(("inflight_kv_blocks", _BLOCKS), state="cached"),
    "kv_usage": _names(("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = 100% (on a CPU too)")),
    "occupancy": _names(("inflight_batch_occupancy_ratio", "Running sequences / max_num_seqs after the last step")),
    "arrival_spread": _names(
        (
            "inflight_batch_arrival_spread_seconds",
            "Latest minus earliest arrival among the sequences of the last step (> 0: in-flight batching)",
        )
    ),
    "max_arrival_spread": _names(
        ("inflight_batch_arrival_spread_max_seconds", "Largest arrival spread of any step so far")
    ),
    "grammar_cache_bytes": _names(
        ("inflight_grammar_cache_bytes", "Bytes of compiled grammars cached (bounded by max_grammar_cache_bytes)")
    ),
}
LORA_INFO = ("vllm:lora_requests_info", "Running stats on lora requests.")
MAX_LORA_INFO_SERIES = 256
# The engine core process: its pid and its KV capacity (gauges set at each start), and the starts.
CORE_GAUGES: dict[str, tuple[Name, ...]] = {
    "pid": _names(("inflight_engine_core_pid", "Process id of the running engine core process")),
    "kv_capacity": _names(
        ("inflight_kv_cache_capacity_tokens", "Tokens the paged KV cache holds (num_kv_blocks x block_size)")
    ),
    "weight_bytes": _names(("inflight_model_weight_bytes", "Bytes of model weights the engine core holds")),
}
CORE_STARTS = _names(
    ("inflight_engine_core_starts_total", "Engine core processes started (1 + restarts after a death)")
)
HISTOGRAMS: dict[str, tuple[tuple[Name, ...], list[float]]] = {
    "ttft": (
        _names(
            ("inflight_time_to_first_token_seconds", "Request arrival to first text sent"),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token"),
        ),
        TTFT_BUCKETS,
    ),
    "tpot": (
        _names(
            ("inflight_time_per_output_token_seconds", "Mean time between output tokens after the first, per request"),
            (
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token (one observation per request: its mean)",
            ),
        ),
        TPOT_BUCKETS,
    ),
    "e2e": (
        _names(
            ("inflight_e2e_request_latency_seconds", "Request arrival to final response"),
            ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency"),
        ),
        E2E_BUCKETS,
    ),
}


class _Series:
    """The metrics of one figure, one per name it is exported under."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def set(self, value: float) -> None:
        for m in self.metrics:
            m.set(value)

    def increment(self, value: float) -> None:
        for m in self.metrics:
            m.increment(value)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class TritonMetrics:
    def __init__(self, pb_utils: ModuleType, labels: dict[str, str]) -> None:
        self._family_cls = pb_utils.MetricFamily
        self._labels = labels
        self._families: dict[str, object] = {}  # by name: a family is created once, its series many times
        kind = self._family_cls
        self.counters = {key: self._series(names, kind.COUNTER) for key, names in COUNTERS.items()}
        self.gauges = {key: self._series(names, kind.GAUGE) for key, names in GAUGES.items()}
        self.core = {key: self._series(names, kind.GAUGE) for key, names in CORE_GAUGES.items()}
        self.core_starts = self._series(CORE_STARTS, kind.COUNTER)
        self.histograms = {key: self._series(n, kind.HISTOGRAM, b) for key, (n, b) in HISTOGRAMS.items()}
        self._accepted_per_position: list[_Series] = []
        self._lora_series: dict[tuple, _Series] = {}
        self._max_spread = 0.0

    def _series(self, names: tuple[Name, ...], kind, buckets: list[float] | None = None) -> _Series:
        metrics = []
        for n in names:
            family = self._families.get(n.name)
            if family is None:
                family = self._families[n.name] = self._family_cls(name=n.name, description=n.description, kind=kind)
            labels = self._labels | dict(n.labels)
            metrics.append(family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels))
        return _Series(metrics)

    def core_started(self, ready) -> None:
        """A core process (core_messages.Ready) started: its pid and capacity."""
        self.core["pid"].set(ready.pid)
        self.core["kv_capacity"].set(ready.num_kv_blocks * ready.block_size)
        self.core["weight_bytes"].set(ready.model_weight_bytes)
        self.core_starts.increment(1)

    def update(self, state: SchedulerStats, counts: IterationStats) -> None:
        """Add the counts since the last update, then set the gauges to the engine's state."""
        # Counters before gauges: a reader that sees the gauges of this update sees its counters too.
        for key, series in self.counters.items():
            value = getattr(counts, key)
            if value:
                series.increment(value)
        for pos, value in enumerate(counts.spec_decode_num_accepted_tokens_per_pos):
            if pos == len(self._accepted_per_position):
                name = Name(ACCEPTED_PER_POSITION.name, ACCEPTED_PER_POSITION.description, (("position", str(pos)),))
                self._accepted_per_position.append(self._series((name,), self._family_cls.COUNTER))
            if value:
                self._accepted_per_position[pos].increment(value)
        for key, value in self._gauge_values(state, counts).items():
            self.gauges[key].set(value)
        if state.max_lora:
            self._lora_info(state)

    def _lora_info(self, state: SchedulerStats) -> None:
        """vLLM's `vllm:lora_requests_info`: one series per (running, waiting) set of adapters, its value the time
        it was last set (a reader takes the newest)."""
        key = (state.max_lora, state.running_lora_adapters, state.waiting_lora_adapters)
        series = self._lora_series.get(key)
        if series is None:
            if len(self._lora_series) >= MAX_LORA_INFO_SERIES:  # bounded: the oldest combinations go
                self._lora_series.pop(next(iter(self._lora_series)))
            labels = (("max_lora", str(key[0])), ("running_lora_adapters", ",".join(key[1])),
                      ("waiting_lora_adapters", ",".join(key[2])))  # fmt: skip
            series = self._lora_series[key] = self._series((Name(*LORA_INFO, labels),), self._family_cls.GAUGE)
        series.set(time.time())

    def _gauge_values(self, state: SchedulerStats, counts: IterationStats) -> dict[str, float]:
        total_blocks = state.num_kv_blocks_used + state.num_kv_blocks_free
        values = {
            "running": state.num_running,
            "waiting": state.num_waiting,
            "kv_blocks_used": state.num_kv_blocks_used,
            "kv_blocks_free": state.num_kv_blocks_free,
            "kv_blocks_cached": state.num_kv_blocks_cached,
            "kv_usage": state.num_kv_blocks_used / total_blocks if total_blocks else 0.0,
            "occupancy": state.num_running / state.max_num_seqs,
            "grammar_cache_bytes": state.grammar_cache_bytes,
        }
        step = state.last_step
        if step is not None and counts.steps:  # a new step since the last update
            values["arrival_spread"] = step.arrival_spread_s
        largest = max(state.max_arrival_spread_s, step.arrival_spread_s if step is not None else 0.0)
        if largest > self._max_spread:
            self._max_spread = values["max_arrival_spread"] = largest
        return values

    def observe_request(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float) -> None:
        if ttft_s is not None:
            self.histograms["ttft"].observe(ttft_s)
        if tpot_s is not None:
            self.histograms["tpot"].observe(tpot_s)
        self.histograms["e2e"].observe(e2e_s)
