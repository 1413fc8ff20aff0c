"""The benchmark's own logic: trace generation, metric arithmetic, and one tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.metrics import StepRecord, occupancy, overhead_share, percentiles
from loadtest.trace import (
    SharedPrefixSpec,
    TraceRequest,
    TraceSpec,
    ideal_continuous_ratio,
    kv_blocks_needed,
    make_shared_prefix_trace,
    make_trace,
)


def _req(i: int, out: int, prompt: int = 4, t: float = 0.0) -> TraceRequest:
    return TraceRequest(f"r{i}", tuple(range(3, 3 + prompt)), out, t)


def test_trace_is_deterministic_per_seed():
    spec = TraceSpec(num_requests=64, seed=7)
    assert make_trace(spec, 500) == make_trace(spec, 500)
    other = make_trace(TraceSpec(num_requests=64, seed=8), 500)
    assert [r.output_len for r in other] != [r.output_len for r in make_trace(spec, 500)]


def test_trace_respects_bounds_and_vocabulary():
    spec = TraceSpec(num_requests=2000, prompt_len=(16, 256), output_len=(8, 512))
    trace = make_trace(spec, vocab_size=300, first_token_id=3)
    prompts = np.array([r.prompt_len for r in trace])
    outs = np.array([r.output_len for r in trace])
    assert prompts.min() >= 16 and prompts.max() <= 256
    assert outs.min() >= 8 and outs.max() <= 512
    ids = np.concatenate([r.prompt_token_ids for r in trace])
    assert ids.min() >= 3 and ids.max() < 300
    assert all(r.arrival_s == 0.0 for r in trace)
    assert len({r.request_id for r in trace}) == len(trace)


def test_bounded_pareto_is_heavy_tailed():
    outs = np.array([r.output_len for r in make_trace(TraceSpec(num_requests=4000), 100)])
    # alpha = 0.8 on [8, 512]: P(X <= 16) = (1 - 0.5^0.8) / (1 - (1/64)^0.8) ≈ 0.44; mean ≈ 43 » median.
    assert 0.38 < np.mean(outs <= 16) < 0.50
    assert np.mean(outs) > 2 * np.median(outs)
    assert outs.max() > 400


def test_other_output_distributions():
    fixed = make_trace(TraceSpec(num_requests=10, output_len=(8, 40), output_dist="fixed"), 100)
    assert {r.output_len for r in fixed} == {40}
    uniform = make_trace(TraceSpec(num_requests=500, output_len=(8, 40), output_dist="uniform"), 100)
    assert min(r.output_len for r in uniform) == 8 and max(r.output_len for r in uniform) == 40


def test_poisson_arrivals_have_the_requested_rate():
    trace = make_trace(TraceSpec(num_requests=3000, rate=20.0), 100)
    arrivals = np.array([r.arrival_s for r in trace])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert np.mean(np.diff(arrivals)) == pytest.approx(1 / 20.0, rel=0.05)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_requests": 0}, {"prompt_len": (10, 5)}, {"output_dist": "zipf"}, {"rate": 0.0}, {"pareto_alpha": -1}],
)
def test_trace_spec_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        TraceSpec(**kwargs)


def test_ideal_ratio_counts_padded_over_useful_token_steps():
    trace = [_req(0, 1), _req(1, 3), _req(2, 2), _req(3, 2)]
    # batches of 2: [1, 3] holds 2 slots for 3 steps, [2, 2] for 2: (6 + 4) / 8
    assert ideal_continuous_ratio(trace, 2) == pytest.approx(10 / 8)
    assert ideal_continuous_ratio(trace, 1) == pytest.approx(1.0)


def test_kv_blocks_needed_rounds_each_request_up():
    assert kv_blocks_needed([_req(0, 12, prompt=4), _req(1, 1, prompt=16)], block_size=16) == 1 + 2


def _step(running: int, waiting: int, step: float = 0.01, fwd: float = 0.009) -> StepRecord:
    return StepRecord(0.0, running, waiting, 0, running, step, fwd)


def test_occupancy_counts_only_steps_with_a_queue():
    steps = [_step(4, 3), _step(2, 1), _step(1, 0)]
    assert occupancy(steps, 4) == pytest.approx((1.0 + 0.5) / 2)
    assert occupancy(steps, 4, queued_only=False) == pytest.approx((1.0 + 0.5 + 0.25) / 3)
    assert occupancy([_step(1, 0)], 4) is None


def test_overhead_share_is_time_outside_the_forward():
    steps = [_step(8, 0, step=0.010, fwd=0.009), _step(2, 0, step=0.010, fwd=0.005)]
    assert overhead_share(steps) == pytest.approx(1 - 0.014 / 0.020)
    assert overhead_share(steps, min_running=8) == pytest.approx(0.1)
    assert overhead_share(steps, min_running=9) is None


def test_percentiles():
    assert percentiles(list(range(101))) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_quick_benchmark_run_measures_every_policy(demo_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from loadtest import bench_batching

    monkeypatch.setattr(bench_batching.torch, "set_num_threads", lambda n: None)  # keep the suite's threads
    result = bench_batching.main(["--quick", "--model", demo_model_dir, "--out", str(tmp_path), "--no-progress"])
    runs = result["runs"]
    expected_tokens = result["trace"]["output_tokens"]
    policies = ("continuous+paged", "continuous+max_length", "static+paged", "static+max_length")
    for name in (*policies, "hf static", "hf continuous"):
        assert runs[name]["output_tokens"] == expected_tokens, name  # exact lengths: same work for everyone
        assert runs[name]["num_requests"] == result["trace"]["num_requests"]
        assert runs[name]["ttft_s"]["p50"] <= runs[name]["latency_s"]["p50"]

    # The quick KV budget holds max_num_seqs sequences' actual tokens, but few max_model_len reservations.
    per_seq = -(-(48 + 64) // 16)
    cap = result["args"]["kv_blocks"] // per_seq
    for name in ("continuous+max_length", "static+max_length"):
        assert runs[name]["peak_running"] <= cap
    assert runs["continuous+paged"]["peak_running"] > cap
    assert runs["continuous+paged"]["peak_kv_blocks"] <= runs["continuous+paged"]["kv_blocks_total"]
    # Static batching leaves slots idle while requests wait; continuous refills them.
    assert runs["continuous+paged"]["occupancy_while_queued"] > runs["static+paged"]["occupancy_while_queued"]

    trace = make_trace(
        TraceSpec(num_requests=24, prompt_len=(8, 48), output_len=(4, 64)),
        json.loads((Path(demo_model_dir) / "config.json").read_text())["vocab_size"],
    )
    assert result["ideal_continuous_over_static"] == pytest.approx(ideal_continuous_ratio(trace, 8))
    overhead = runs["continuous+paged@16"]
    assert overhead["peak_running"] == 16 and 0 <= overhead["overhead_share_full_batch"] < 1
    assert set(result["targets"]) == {
        "continuous/static >= 0.9 x ideal",
        "occupancy while queued >= 95%",
        ">= 10x HF static",
        ">= 1.5x HF continuous",
        "engine overhead <= 5% at full batch",
    }

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["runs"].keys() == runs.keys()
    for png in ("throughput.png", "occupancy.png", "kv_blocks.png", "latency_cdf.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_shared_prefix_trace_shares_exactly_the_system_prompts():
    spec = SharedPrefixSpec(num_requests=40, num_prefixes=4, prefix_len=50, suffix_len=(3, 9), output_len=(2, 5))
    trace = make_shared_prefix_trace(spec, vocab_size=300)
    assert trace == make_shared_prefix_trace(spec, vocab_size=300)
    groups: dict[tuple, list] = {}
    for i, r in enumerate(trace):
        assert 53 <= r.prompt_len <= 59 and 2 <= r.output_len <= 5
        groups.setdefault(r.prompt_token_ids[:50], []).append(i % 4)
    assert len(groups) == 4 and all(len(set(g)) == 1 and len(g) == 10 for g in groups.values())
    with pytest.raises(ValueError, match="num_prefixes"):
        SharedPrefixSpec(num_requests=3, num_prefixes=4)


def test_quick_prefix_cache_benchmark_hits_only_on_the_shared_trace(demo_model_dir, tmp_path, monkeypatch):
    from loadtest import bench_prefix_cache

    monkeypatch.setattr(bench_prefix_cache.torch, "set_num_threads", lambda n: None)
    result = bench_prefix_cache.main(["--quick", "--model", demo_model_dir, "--out", str(tmp_path), "--no-progress"])
    runs = result["runs"]
    tokens = result["shared_trace"]["output_tokens"]
    assert runs["shared caching on"]["output_tokens"] == runs["shared caching off"]["output_tokens"] == tokens
    assert runs["shared caching off"]["prefix_cache_hit_rate"] is None  # off: no lookups at all
    assert 0.3 < result["figures"]["shared_hit_rate"] < 1
    assert result["figures"]["default_hit_rate"] == 0  # random prompts share nothing
    assert runs["shared caching on"]["peak_kv_blocks_cached"] > 0
    assert (tmp_path / "kv_blocks.png").read_bytes()[:4] == b"\x89PNG"
