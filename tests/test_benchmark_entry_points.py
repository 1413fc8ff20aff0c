"""Every `python -m benchmarks.…`, `loadtest.core_kills` and `tools.…` entry point, run as a developer runs it,
on a tiny setting.

Tests never import benchmarks/, loadtest/ or tools/ (test_test_imports.py): each benchmark runs here as a
subprocess and is judged by its exit status and what it prints or writes. The trace generator's own
properties are checked through its CLI (`python -m benchmarks.common.trace`). Server-launching and
compiling runs are marked slow; tools.kernel_resources (capture + compile) runs in tests/kernels/test_kernel_compile.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
QUICK_TRACE = ["--num-requests", "24", "--prompt-len", "8", "48", "--output-len", "4", "64"]  # bench_batching --quick
FAKE_WALL_S = 2.0


def run(module: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """`python -m module args…` from the repository root; returns stdout, fails with the output's tail."""
    full_env = dict(os.environ) | {"PYTHONPATH": str(ROOT)} | (env or {})
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{module} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def trace(*args: str) -> dict:
    return json.loads(run("benchmarks.common.trace", "--vocab-size", "500", *args))


def vocab(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


# --- benchmarks.common -------------------------------------------------------------------------------


def test_models_llama32k_is_head_heavy_and_llama50m_layer_heavy_at_a_similar_size():
    models = json.loads(run("benchmarks.common.models", "demo", "llama50m", "llama32k"))
    wide, deep = models["llama32k"], models["llama50m"]
    assert wide["config"]["vocab_size"] == 32000
    assert 0.8 < wide["parameters"] / deep["parameters"] < 1.25
    assert wide["lm_head_parameters"] > wide["layer_parameters"]
    assert deep["layer_parameters"] > 10 * deep["lm_head_parameters"]


def test_trace_is_deterministic_per_seed_and_respects_its_bounds():
    a = trace("--num-requests", "2000", "--seed", "7", "--per-request")
    assert a == trace("--num-requests", "2000", "--seed", "7", "--per-request")
    assert trace("--num-requests", "2000", "--seed", "8")["digest"] != a["digest"]
    prompts = [r["prompt_len"] for r in a["requests"]]
    outs = [r["output_len"] for r in a["requests"]]
    assert min(prompts) >= 16 and max(prompts) <= 256 and min(outs) >= 8 and max(outs) <= 512
    assert a["token_id_range"][0] >= 3 and a["token_id_range"][1] < 500  # special ids stay out of prompts
    assert a["last_arrival_s"] == 0.0 and a["distinct_request_ids"] == 2000
    # bounded Pareto, alpha 0.8 on [8, 512]: P(X <= 16) ≈ 0.44; heavy tail, mean » median
    assert 0.38 < sum(o <= 16 for o in outs) / len(outs) < 0.50
    assert a["output_len_mean"] > 2 * a["output_len_p50"] and max(outs) > 400


def test_trace_distributions_arrivals_and_validation():
    fixed = trace("--num-requests", "10", "--output-len", "8", "40", "--output-dist", "fixed", "--per-request")
    assert {r["output_len"] for r in fixed["requests"]} == {40}
    uniform = trace("--num-requests", "500", "--output-len", "8", "40", "--output-dist", "uniform", "--per-request")
    assert {min(r["output_len"] for r in uniform["requests"]), max(r["output_len"] for r in uniform["requests"])} == {
        8,
        40,
    }
    poisson = trace("--num-requests", "3000", "--rate", "20", "--per-request")
    arrivals = [r["arrival_s"] for r in poisson["requests"]]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] / (len(arrivals) - 1) == pytest.approx(1 / 20.0, rel=0.05)
    for bad in (["--num-requests", "0"], ["--prompt-len", "10", "5"], ["--rate", "0"], ["--pareto-alpha", "-1"]):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.common.trace", *bad], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 2 and "must" in done.stderr, bad


def test_shared_prefix_trace_shares_exactly_the_system_prompts():
    args = ["--num-requests", "40", "--shared-prefixes", "4", "--prefix-len", "50", "--prompt-len", "3", "9"]
    t = trace(*args, "--output-len", "2", "5", "--per-request")
    assert t == trace(*args, "--output-len", "2", "5", "--per-request")
    for i, r in enumerate(t["requests"]):
        assert 53 <= r["prompt_len"] <= 59 and 2 <= r["output_len"] <= 5 and r["prefix"] == i % 4


# --- benchmarks.kernels ------------------------------------------------------------------------------


def test_bench_kernels_smoke(tmp_path):
    out = tmp_path / "kernels.json"
    env = {} if os.environ.get("TRITON_INTERPRET") != "1" else {"TRITON_INTERPRET": "1"}
    run("benchmarks.kernels.bench_kernels", "--smoke", "--json", str(out), env=env)
    result = json.loads(out.read_text())
    assert {"device", "dtype", "rows"} <= set(result) and result["rows"]
    assert all({"kernel", "shape", "triton_ms", "torch_ms", "gbps"} <= set(r) for r in result["rows"])


def test_bench_gemm(tmp_path):
    text = run("benchmarks.kernels.bench_gemm", "--model", "demo", "--dtype", "float32", "--rows", "1", "4")
    assert "float32" in text and ("GF" in text or "no kernel" in text)


def test_bench_cpu_attention():
    text = run(
        "benchmarks.kernels.bench_cpu_attention", "--rows", "2", "--context", "40", "--layers", "1", "--repeats", "3"
    )
    assert "GB/s" in text and "bfloat16" in text


# --- benchmarks.engine -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_batching_quick_measures_every_policy_and_hf(demo_model_dir, tmp_path):
    pytest.importorskip("transformers")
    run(
        "benchmarks.engine.bench_batching",
        "--quick",
        "--model",
        demo_model_dir,
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    result = json.loads((tmp_path / "summary.json").read_text())
    runs, expected = result["runs"], result["trace"]["output_tokens"]
    for name in (
        "continuous+paged",
        "continuous+max_length",
        "static+paged",
        "static+max_length",
        "hf static",
        "hf continuous",
    ):
        assert runs[name]["output_tokens"] == expected, name  # exact lengths: the same work for everyone
        assert runs[name]["num_requests"] == result["trace"]["num_requests"]
        assert runs[name]["ttft_s"]["p50"] <= runs[name]["latency_s"]["p50"] <= runs[name]["latency_s"]["p99"]
    # The quick KV budget holds max_num_seqs sequences' actual tokens, but few max_model_len reservations.
    cap = result["args"]["kv_blocks"] // -(-(48 + 64) // 16)
    for name in ("continuous+max_length", "static+max_length"):
        assert runs[name]["peak_running"] <= cap
    assert runs["continuous+paged"]["peak_running"] > cap
    assert runs["continuous+paged"]["peak_kv_blocks"] <= runs["continuous+paged"]["kv_blocks_total"]
    # Static batching leaves slots idle while requests wait; continuous refills them.
    assert runs["continuous+paged"]["occupancy_while_queued"] > runs["static+paged"]["occupancy_while_queued"]
    assert 0 < runs["continuous+paged"]["occupancy_while_queued"] <= 1
    ideal = trace(*QUICK_TRACE, "--vocab-size", str(vocab(demo_model_dir)), "--batch-size", "8")
    assert result["ideal_continuous_over_static"] == pytest.approx(ideal["ideal_continuous_over_static"])
    overhead = runs["continuous+paged@16"]
    assert overhead["peak_running"] == 16 and 0 <= overhead["overhead_share_full_batch"] < 1
    assert set(result["targets"]) == {
        "continuous/static >= 0.9 x ideal",
        "occupancy while queued >= 95%",
        ">= 10x HF static",
        ">= 1.5x HF continuous",
        "engine overhead <= 5% at full batch",
    }
    for png in ("throughput.png", "occupancy.png", "kv_blocks.png", "latency_cdf.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == PNG and len(data) > 5000, png


def _fake_vllm_script(tmp_path: Path) -> Path:
    """Stands in for vllm_cpu.sh: bench_vllm_cpu's own dry run, as if vLLM generated every token in FAKE_WALL_S."""
    script = tmp_path / "fake_vllm.sh"
    script.write_text(
        f'#!/usr/bin/env bash\nexec "{sys.executable}" -m benchmarks.peers.bench_vllm_cpu '
        f'--dry-run-wall-s {FAKE_WALL_S} --model-dir "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.mark.slow
def test_bench_batching_peers_compares_against_vllm_on_the_same_trace(demo_model_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--peers", "vllm", "--model", demo_model_dir, "--quick", "--out", str(out), "--no-progress"]
    run(
        "benchmarks.engine.bench_batching",
        *args,
        "--dtypes",
        "float32",
        "--vllm-script",
        str(_fake_vllm_script(tmp_path)),
    )
    result = json.loads((out / "summary.json").read_text())
    tokens = trace(*QUICK_TRACE, "--vocab-size", str(vocab(demo_model_dir)))["output_tokens"]
    rows = result["peers"]
    assert [r["dtype"] for r in rows] == ["float32"]
    for row in rows:
        vllm, ours = row["vllm"], row["inflight"]
        assert vllm["comparable"], "vLLM's side rebuilt another trace from the arguments it was given"
        assert (
            vllm["settings"] | {"dtype": row["dtype"], "max_num_seqs": 8, "max_num_batched_tokens": 256}
            == vllm["settings"]
        )
        assert vllm["tokens_per_s"] == pytest.approx(tokens / FAKE_WALL_S)
        assert ours["output_tokens"] == tokens and ours["preemptions"] == 0
        assert row["inflight_over_vllm"] == pytest.approx(ours["tokens_per_s"] / vllm["tokens_per_s"])
        assert row["target"] == result["target_inflight_over_vllm"][row["model"]] == 1.25  # not SmolLM2's 1.5
        assert row["met"] == (row["inflight_over_vllm"] >= row["target"])
    assert list(result["targets"]) == [f"inflight >= 1.25x vLLM-CPU, {Path(demo_model_dir).name} float32"]
    assert (out / "peers.png").read_bytes()[:8] == PNG


def test_bench_batching_peers_says_vllm_is_unavailable_and_still_measures_inflight(demo_model_dir, tmp_path):
    # Offline: no package index, so vLLM's virtualenv cannot be made; a fresh one, not the developer's.
    env = {"VLLM_VENV": str(tmp_path / "vllm-venv"), "PIP_NO_INDEX": "1"}
    out = tmp_path / "out"
    args = ["--peers", "vllm", "--model", demo_model_dir, "--quick", "--out", str(out), "--no-progress"]
    run("benchmarks.engine.bench_batching", *args, "--dtypes", "float32", "bfloat16", env=env)
    result = json.loads((out / "summary.json").read_text())
    assert "cannot create vLLM's virtualenv" in result["vllm_unavailable"]
    for row in result["peers"]:
        assert row["vllm"] is None and row["inflight_over_vllm"] is None and row["met"] is None
        assert "unavailable" in row["vllm_skipped"] and row["inflight"]["output_tokens"] > 0
    name = Path(demo_model_dir).name
    assert (out / f"vllm_{name}_float32.log").is_file()
    assert not (out / f"vllm_{name}_bfloat16.log").exists()  # tried once, not once per dtype


def test_bench_prefix_cache_quick_hits_only_on_the_shared_trace(demo_model_dir, tmp_path):
    run(
        "benchmarks.engine.bench_prefix_cache",
        "--quick",
        "--model",
        demo_model_dir,
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    result = json.loads((tmp_path / "summary.json").read_text())
    runs = result["runs"]
    tokens = result["shared_trace"]["output_tokens"]
    assert runs["shared caching on"]["output_tokens"] == runs["shared caching off"]["output_tokens"] == tokens
    assert runs["shared caching off"]["prefix_cache_hit_rate"] is None  # off: no lookups at all
    assert 0.3 < result["figures"]["shared_hit_rate"] < 1
    assert result["figures"]["default_hit_rate"] == 0  # random prompts share nothing
    assert runs["shared caching on"]["peak_kv_blocks_cached"] > 0
    assert (tmp_path / "kv_blocks.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("params", ["mixed", "sampled"])
def test_bench_prepare_times_prepare_and_the_sampler(params):
    args = ["--num-seqs", "4", "--prompt-len", "20", "--steps", "3", "--params", params]
    text = run("benchmarks.engine.bench_prepare", *args)
    assert "decode: prepare" in text and "churn : prepare" in text and "sampler" in text


@pytest.mark.slow
def test_bench_structured(demo_model_dir, tmp_path):
    out = tmp_path / "structured.json"
    args = ["--model", demo_model_dir, "--requests", "2", "--rounds", "1", "--reps", "1", "--out", str(out)]
    run("benchmarks.engine.bench_structured", *args)
    assert {"compile", "ttft", "throughput", "bitmask_apply"} <= set(json.loads(out.read_text()))


def test_bench_decode_step(demo_model_dir):
    args = ["--model", demo_model_dir, "--batch", "1", "2", "--context", "20", "--prefill", "16", "--repeats", "1"]
    text = run("benchmarks.engine.bench_decode_step", *args)
    assert "float32: copy bandwidth" in text and "prefill 16 tokens" in text


def test_bench_tensor_parallel_times_one_and_two_ranks(demo_model_dir, tmp_path):
    out = tmp_path / "tp.json"
    args = ["--model", demo_model_dir, "--batch", "2", "--context", "16", "--steps", "2", "--out", str(out)]
    run("benchmarks.engine.bench_tensor_parallel", *args)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["tp"], r["collectives"]) for r in runs] == [(1, None), (2, "shm"), (2, "gloo")]
    for run_ in runs[1:]:  # 4 layers: two all-reduces each, the embedding's, the logits' gather
        assert run_["collectives_per_step"] == 2 * 4 + 2 and 0 < run_["collective_share_of_forward"] <= 1
    assert runs[0]["collective_ms"] == 0


def test_bench_graphs_alternates_eager_and_graph_rounds(demo_model_dir, tmp_path):
    # On a CPU both modes are eager (graphs need a GPU): this checks the rounds and the step split only.
    out = tmp_path / "graphs.json"
    args = ["--model", demo_model_dir, "--device", "cpu", "--dtype", "float32", "--num-requests", "12"]
    run("benchmarks.engine.bench_graphs", *args, "--max-num-seqs", "4", "--rounds", "2", "--out", str(out))
    result = json.loads(out.read_text())
    modes = [(r["round"], r["mode"]) for r in result["rows"]]
    assert modes == [(0, "eager"), (0, "graphs"), (1, "eager"), (1, "graphs")]
    assert all(r["decode_steps"] > 0 and r["mixed_steps"] > 0 for r in result["rows"])
    assert len(result["graphs_over_eager"]) == 2


def test_bench_spec_decode_outputs_are_identical_with_and_without(demo_model_dir, tmp_path):
    out = tmp_path / "spec.json"
    run("benchmarks.engine.bench_spec_decode", "--quick", "--model", demo_model_dir, "--out", str(out))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["trace"], r["in_flight"]) for r in rows} == {("grounded", 1), ("grounded", 8), ("free", 1), ("free", 8)}
    for method in ("ngram", "suffix"):
        assert all(r[method]["identical"] and r[method]["tokens"] == r["off"]["tokens"] for r in rows)
        for r in rows:  # one paired ratio a round, the speedup their median
            assert len(r[method]["speedups"]) == r["rounds"] == 2 and len(r["off"]["seconds"]) == 2
            assert min(r[method]["speedups"]) <= r[method]["speedup"] <= max(r[method]["speedups"])
    assert all(r["off"]["identical_across_rounds"] for r in rows)
    assert Path(result["plot"]).is_file()
    assert set(result["proposer_ms_per_step"]) == {"ngram@1000", "suffix@1000", "ngram@4000", "suffix@4000"}


@pytest.mark.slow
def test_bench_compile(demo_model_dir):
    args = ["--model", demo_model_dir, "--batch", "1", "--context", "16", "--repeats", "1"]
    text = run("benchmarks.engine.bench_compile", *args)
    assert "compile" in text


# --- benchmarks.peers --------------------------------------------------------------------------------


def test_bench_vllm_cpu_dry_run_writes_a_run_summary(demo_model_dir, tmp_path):
    out = tmp_path / "vllm.json"
    args = ["--model-dir", demo_model_dir, *QUICK_TRACE, "--dry-run-wall-s", "2", "--out", str(out)]
    run("benchmarks.peers.bench_vllm_cpu", *args)
    summary = json.loads(out.read_text())
    assert {"output_tokens", "tokens_per_s", "trace", "settings"} <= set(summary)
    assert summary["trace"]["digest"] == trace(*QUICK_TRACE, "--vocab-size", str(vocab(demo_model_dir)))["digest"]


# --- benchmarks.serving ------------------------------------------------------------------------------


@pytest.mark.slow
def test_serving_overhead(demo_model_dir, tmp_path):
    args = ["--model", demo_model_dir, "--num-requests", "8", "--output-len", "4", "16", "--prompt-len", "8", "32"]
    run("benchmarks.serving.serving_overhead", *args, "--concurrency", "4", "--out", str(tmp_path), timeout=400)
    assert list(tmp_path.glob("*.json")), list(tmp_path.iterdir())


def test_peers_served_names_what_it_lacks(tmp_path):
    # It drives vLLM-CPU's server and AIPerf from their own virtualenvs, which a test machine does not have.
    env = {"AIPERF_VENV": str(tmp_path / "no-aiperf"), "VLLM_VENV": str(tmp_path / "no-vllm")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving.peers_served", "--out", str(tmp_path)],
        cwd=ROOT, env=dict(os.environ) | {"PYTHONPATH": str(ROOT)} | env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode != 0 and "no aiperf in" in done.stderr and "make aiperf-openai" in done.stderr


@pytest.mark.slow
def test_cost_per_token(tmp_path):
    args = ["--model", "demo", "--concurrency", "1", "2", "--requests-per-client", "1", "--min-requests", "2",
            "--output-len", "8", "--prompt-len", "8", "16", "--idle-s", "0.2", "--rounds", "1"]  # fmt: skip
    text = run("benchmarks.serving.cost_per_token", *args, "--out", str(tmp_path / "cost.json"), timeout=400)
    result = json.loads((tmp_path / "cost.json").read_text())
    cells = {(p, c) for p in ("grpc", "openai") for c in (1, 2)}
    assert {(r["path"], r["concurrency"]) for r in result["rows"]} == cells
    for row in result["rows"]:
        assert row["served_cpu_ms_per_token"] > 0 and row["in_process_cpu_ms_per_token"] > 0
        assert {"tritonserver", "stub llm", "engine core"} <= set(row["by_process_cpu_ms_per_token"])
    assert "served" in text and (tmp_path / "cost.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_openai_overhead(tmp_path):
    args = ["--requests", "4", "--concurrency", "2", "--output-tokens", "8", "--sequential-pairs", "2", "--rounds", "1"]
    run("benchmarks.serving.openai_overhead", *args, "--out", str(tmp_path / "openai.json"), timeout=400)
    assert json.loads((tmp_path / "openai.json").read_text())


# --- loadtest ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_core_kills_fails_no_stream_and_serves_again_after_each_kill(tmp_path):
    args = ["--kills", "2", "--gap-s", "0", "--clients", "3", "--max-tokens", "32", "96", "--jitter-s", "0.5"]
    text = run("loadtest.core_kills", *args, "--out", str(tmp_path), timeout=240)
    result = json.loads((tmp_path / "core_kills.json").read_text())
    summary, final = result["summary"], result["final"]
    assert summary["kills"] == 2 and summary["hung"] == 0 and summary["not_served_again"] == 0
    # Not hung: every stream in flight ended within --hung-after-s (a generous bound on a busy machine; the
    # front fails them as soon as it sees the core die, and a stream left to its request timeout would miss it).
    assert summary["requests_in_flight"] >= 2
    assert summary["ended_with_death_error"] + summary["completed"] == summary["requests_in_flight"]
    assert 0 < summary["served_again_s"]["p50"] <= summary["served_again_s"]["max"]
    assert final["serves"] and final["kv_blocks_used"] == 0 and final["core_starts"] == 3
    assert list(final["core_processes"].values()) in (["S"], ["R"]) and not final["cores_after_stop"]
    assert result["failures"] == [] and "| **all 2** |" in text
    assert (tmp_path / "core_kills.png").read_bytes()[:8] == PNG


# --- tools -------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the capture runs the Triton interpreter")
def test_kernel_launches_prints_the_attention_rows_of_the_demo_scenario():
    text = run("tools.kernel_launches", "--model", "demo", env={"TRITON_INTERPRET": "1"})
    assert "| step | decode seqs |" in text and "mixed steps:" in text


def test_bench_batching_refuses_options_of_the_other_mode():
    for bad in (["--dtypes", "float32"], ["--peers", "vllm", "--rate", "4"]):  # --dtype for policies; vLLM: all at t=0
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.engine.bench_batching", *bad], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 2, (bad, done.stderr[-2000:])
