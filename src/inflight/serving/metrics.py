"""Engine metrics on Triton's metrics port, through the Python backend's `pb_utils.MetricFamily`.

Gauges and counters are refreshed by the engine loop's responder thread from the latest `EngineSnapshot`
the engine publishes (never its internals), at most every ~0.5 s; the latency histograms are observed per
request when its responses are sent (what the client sees). Each figure is exported as `inflight_*` and
under the name of Triton's vLLM backend (`vllm:*`). Every family is kept on `self`: a garbage-collected
MetricFamily invalidates its metrics.
"""

from __future__ import annotations

from types import ModuleType

from inflight.engine.stats import EngineSnapshot

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


class TritonMetrics:
    def __init__(self, pb_utils: ModuleType, labels: dict[str, str]) -> None:
        family = pb_utils.MetricFamily
        self._families = []

        def make(name: str, description: str, kind, states: list[str] | None = None, buckets=None):
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            if states is None:
                return fam.Metric(labels=labels, buckets=buckets) if buckets else fam.Metric(labels=labels)
            return {s: fam.Metric(labels=labels | {"state": s}) for s in states}

        gauge, counter, histogram = family.GAUGE, family.COUNTER, family.HISTOGRAM
        self.requests = make("inflight_requests", "Requests in the engine by state", gauge, ["running", "waiting"])
        self.kv_blocks = make(
            "inflight_kv_blocks",
            "Paged KV cache blocks by state (cached: free blocks holding a reusable prefix, a subset of free)",
            gauge,
            ["used", "free", "cached"],
        )
        self.occupancy = make(
            "inflight_batch_occupancy_ratio", "Running sequences / max_num_seqs after the last step", gauge
        )
        self.arrival_spread = make(
            "inflight_batch_arrival_spread_seconds",
            "Latest minus earliest arrival among the sequences of the last step (> 0: in-flight batching)",
            gauge,
        )
        self.max_arrival_spread = make(
            "inflight_batch_arrival_spread_max_seconds", "Largest arrival spread of any step so far", gauge
        )
        self.preemptions = make("inflight_preemptions_total", "Sequences preempted (KV freed, recomputed)", counter)
        self.prompt_tokens = make("inflight_prompt_tokens_total", "Prompt tokens admitted", counter)
        self.generation_tokens = make("inflight_generation_tokens_total", "Tokens generated", counter)
        # Prefix cache, in prompt tokens looked up / found at first admission (hit rate = hits / queries).
        self.prefix_cache_queries = make(
            "inflight_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", counter
        )
        self.prefix_cache_hits = make(
            "inflight_prefix_cache_hits_total", "Prompt tokens served from the prefix cache", counter
        )
        # Static: what the OpenAI front reads to cap its default max_tokens (the engine rejects a request
        # whose prompt + max_tokens the cache could never hold, which max_model_len alone does not bound).
        self.kv_capacity = make(
            "inflight_kv_cache_capacity_tokens", "Tokens the paged KV cache holds (num_kv_blocks x block_size)", gauge
        )
        self.core_pid = make("inflight_engine_core_pid", "Process id of the running engine core process", gauge)
        self.core_starts = make(
            "inflight_engine_core_starts_total", "Engine core processes started (1 + restarts after a death)", counter
        )
        self.vllm_prefix_cache_queries = make(
            "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens", counter
        )
        self.vllm_prefix_cache_hits = make(
            "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens", counter
        )
        self.ttft = make(
            "inflight_time_to_first_token_seconds", "Request arrival to first text sent", histogram, None, TTFT_BUCKETS
        )
        self.tpot = make(
            "inflight_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            histogram,
            None,
            TPOT_BUCKETS,
        )
        self.e2e = make(
            "inflight_e2e_request_latency_seconds", "Request arrival to final response", histogram, None, E2E_BUCKETS
        )
        # The same figures under the names of Triton's vLLM backend, for dashboards and autoscalers built on it.
        self.vllm_prompt_tokens = make("vllm:prompt_tokens_total", "Number of prefill tokens processed", counter)
        self.vllm_generation_tokens = make(
            "vllm:generation_tokens_total", "Number of generation tokens processed", counter
        )
        self.vllm_preemptions = make("vllm:num_preemptions_total", "Number of preemptions", counter)
        self.vllm_running = make("vllm:num_requests_running", "Number of requests running", gauge)
        self.vllm_waiting = make("vllm:num_requests_waiting", "Number of requests waiting", gauge)
        self.vllm_kv_usage = make("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = 100% (on a CPU too)", gauge)
        self.vllm_ttft = make(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token", histogram, None, TTFT_BUCKETS
        )
        self.vllm_tpot = make(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token (one observation per request: its mean)",
            histogram,
            None,
            TPOT_BUCKETS,
        )
        self.vllm_e2e = make(
            "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency", histogram, None, E2E_BUCKETS
        )
        # Speculative decoding (vLLM's names): proposals verified, their draft tokens, drafts accepted, and
        # accepted drafts by position (label `position`, created as positions appear).
        self.vllm_spec_drafts = make("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts", counter)
        self.vllm_spec_draft_tokens = make("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens", counter)
        self.vllm_spec_accepted = make(
            "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens", counter
        )
        self._spec_per_pos_family = family(
            name="vllm:spec_decode_num_accepted_tokens_per_pos_total",
            description="Accepted tokens per draft position",
            kind=counter,
        )
        self._families.append(self._spec_per_pos_family)
        self._labels = labels
        self._spec_per_pos: list = []
        self._spec_per_pos_counted: list[int] = []
        # Each snapshot counter (EngineSnapshot's field) and the metrics it advances.
        self._counters = (
            ("num_preemptions", [self.preemptions, self.vllm_preemptions]),
            ("prompt_tokens", [self.prompt_tokens, self.vllm_prompt_tokens]),
            ("generation_tokens", [self.generation_tokens, self.vllm_generation_tokens]),
            ("prefix_cache_queries", [self.prefix_cache_queries, self.vllm_prefix_cache_queries]),
            ("prefix_cache_hits", [self.prefix_cache_hits, self.vllm_prefix_cache_hits]),
            ("spec_decode_num_drafts", [self.vllm_spec_drafts]),
            ("spec_decode_num_draft_tokens", [self.vllm_spec_draft_tokens]),
            ("spec_decode_num_accepted_tokens", [self.vllm_spec_accepted]),
        )
        self._counted = dict.fromkeys((key for key, _ in self._counters), 0)
        self._max_spread = 0.0
        self._steps_seen = -1

    def core_started(self, ready) -> None:
        """A core process (wire.Ready) started: its pid and capacity."""
        self.core_pid.set(ready.pid)
        self.core_starts.increment(1)
        self.kv_capacity.set(ready.num_kv_blocks * ready.block_size)

    def update(self, snap: EngineSnapshot) -> None:
        """Refresh from one snapshot of the engine."""
        # Counters before gauges: a reader that sees the gauges of this iteration sees its counters too.
        for key, metrics in self._counters:
            value = getattr(snap, key)
            if value > self._counted[key]:
                for metric in metrics:
                    metric.increment(value - self._counted[key])
                self._counted[key] = value
        for pos, value in enumerate(snap.spec_decode_num_accepted_tokens_per_pos):
            if pos == len(self._spec_per_pos):
                metric = self._spec_per_pos_family.Metric(labels=self._labels | {"position": str(pos)})
                self._spec_per_pos.append(metric)
                self._spec_per_pos_counted.append(0)
            if value > self._spec_per_pos_counted[pos]:
                self._spec_per_pos[pos].increment(value - self._spec_per_pos_counted[pos])
                self._spec_per_pos_counted[pos] = value
        self.requests["running"].set(snap.num_running)
        self.requests["waiting"].set(snap.num_waiting)
        self.vllm_running.set(snap.num_running)
        self.vllm_waiting.set(snap.num_waiting)
        total_blocks = snap.num_kv_blocks_used + snap.num_kv_blocks_free
        self.vllm_kv_usage.set(snap.num_kv_blocks_used / total_blocks if total_blocks else 0.0)
        self.kv_blocks["used"].set(snap.num_kv_blocks_used)
        self.kv_blocks["free"].set(snap.num_kv_blocks_free)
        self.kv_blocks["cached"].set(snap.num_kv_blocks_cached)
        self.occupancy.set(snap.num_running / snap.max_num_seqs)
        stats = snap.last_step
        if stats is not None and snap.steps != self._steps_seen:
            self._steps_seen = snap.steps
            self.arrival_spread.set(stats.arrival_spread_s)
        largest = max(snap.max_arrival_spread_s, stats.arrival_spread_s if stats is not None else 0.0)
        if largest > self._max_spread:
            self._max_spread = largest
            self.max_arrival_spread.set(self._max_spread)

    def observe_request(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.vllm_ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
            self.vllm_tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)
        self.vllm_e2e.observe(e2e_s)
