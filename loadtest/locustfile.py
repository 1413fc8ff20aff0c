"""Locust user over Triton's gRPC stream (vLLM-backend request format), with requests from the trace generator.

    PYTHONPATH=. locust -f loadtest/locustfile.py --host localhost:8001 --headless -u 16 -r 4 -t 60s --stop-timeout 60
    python -m loadtest.run_locust            # the same, bounded, with CSV + HTML reports and tok/s

Reported through `events.request`: "generate" (end to end; response length = output tokens; failures
carry the server's error text), "ttft" and "itl" (per token, one entry per streamed response).
"""

from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any other gRPC use, so the stream's reader cooperates with gevent

import itertools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from inflight_client import InferenceError, LLMClient  # noqa: E402
from locust import User, constant, events, task  # noqa: E402

from benchmarks.common.trace import TraceSpec, make_trace, word_prompts  # noqa: E402

REQUEST_TYPE = "grpc-stream"
_jobs: itertools.cycle | None = None
_totals = {"tokens": 0, "requests": 0, "failures": 0, "first": None, "last": None}


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--trace-requests", type=int, default=256, help="requests in the trace (then it repeats)")
    parser.add_argument("--trace-seed", type=int, default=0)
    parser.add_argument("--prompt-len-max", type=int, default=256)
    parser.add_argument("--output-len-max", type=int, default=512)
    parser.add_argument("--model-name", default="llm")
    parser.add_argument("--summary-json", default="", help="write tokens/s and counts here when the test stops")


@events.test_start.add_listener
def _build_trace(environment, **_kwargs) -> None:
    global _jobs
    opts = environment.parsed_options
    spec = TraceSpec(
        num_requests=opts.trace_requests,
        prompt_len=(min(16, opts.prompt_len_max), opts.prompt_len_max),
        output_len=(min(8, opts.output_len_max), opts.output_len_max),
        seed=opts.trace_seed,
    )
    trace = make_trace(spec, vocab_size=1000)  # token ids unused: prompts are words
    _jobs = itertools.cycle(list(zip(word_prompts(trace, opts.trace_seed), (r.output_len for r in trace))))


@events.test_stop.add_listener
def _write_summary(environment, **_kwargs) -> None:
    path = getattr(environment.parsed_options, "summary_json", "")
    if not path:
        return
    t = _totals
    span = (t["last"] - t["first"]) if t["first"] is not None and t["last"] is not None else 0.0
    summary = dict(t, span_s=span, output_tokens_per_s=t["tokens"] / span if span > 0 else 0.0)
    Path(path).write_text(json.dumps(summary, indent=2))


class TritonLLMUser(User):
    """One user = one request at a time, each on its own gRPC stream."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.llm = LLMClient(self.host or "localhost:8001", model=self.environment.parsed_options.model_name)

    @task
    def generate(self) -> None:
        prompt, n = next(_jobs)
        params = {"max_tokens": str(n), "min_tokens": str(n), "ignore_eos": "true", "temperature": "0"}
        start = time.perf_counter()
        _totals["first"] = _totals["first"] or time.monotonic()
        try:
            with self.llm.stream(prompt, params) as stream:
                for _ in stream:
                    pass
            done = stream.completion
        except InferenceError as e:
            _totals["failures"] += 1
            self._fire("generate", (time.perf_counter() - start) * 1000, 0, e)
            return
        _totals["last"] = time.monotonic()
        if done is None or done.finish_reason not in ("length", "stop"):
            reason = None if done is None else done.finish_reason
            self._fire("generate", (time.perf_counter() - start) * 1000, 0, RuntimeError(f"stream ended: {reason}"))
            _totals["failures"] += 1
            return
        _totals["tokens"] += done.num_output_tokens
        _totals["requests"] += 1
        self._fire("generate", done.e2e_s * 1000, done.num_output_tokens)
        if done.ttft_s is not None:
            self._fire("ttft", done.ttft_s * 1000, 0)
        for a, b in zip(done.deltas, done.deltas[1:]):
            self._fire("itl", (b.time_s - a.time_s) * 1000 / max(1, b.num_tokens), b.num_tokens)

    def _fire(self, name: str, ms: float, length: int, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE,
            name=name,
            response_time=ms,
            response_length=length,
            exception=exception,
            context={},
        )
