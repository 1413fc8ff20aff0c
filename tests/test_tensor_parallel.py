"""Tensor parallelism on this host. Two ranks (processes, one thread each, their collectives over shared memory,
and over gloo) against one rank on the demo model: the same logits within TP_ATOL and the same greedy tokens under
chunked prefill, preemption, prefix hits and speculative verification, in one run; a killed worker rank ends the
engine at once and leaves no process behind. Eight ranks (KV heads replicated, the vocabulary padded) and Gemma 3
as threads of this process; the refusals. SmolLM2 over three ranks on request (INFLIGHT_TEST_TP_SMOLLM2=1).
Through tritonserver: tests/e2e/test_tensor_parallel_e2e.py. The collectives alone: tests/test_shm_group.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
from gguf.quants import dequantize
from helpers import PROMPTS

from inflight.config import ConfigError, EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.errors import EngineDeadError
from inflight.executor.attention.metadata import consecutive_batch
from inflight.executor.model_runner import ModelRunner
from inflight.executor.shm_group import OFF_VARIABLE
from inflight.executor.tp_worker import connect
from inflight.launcher.cli import build_parser, serve_parameters
from inflight.launcher.server import free_port
from inflight.models.config import ModelConfig
from inflight.models.gguf_loader import hf_name, read_tensors
from inflight.models.llama import LlamaForCausalLM
from inflight.models.loader import check_tensor_parallel, load_model
from inflight.models.parallel import TensorParallel, check_sizes, local_part, shard_of
from inflight.models.quantized import GGUFWeight, QuantizedEmbedding, QuantizedLinear
from inflight.ops import cpu
from inflight.sampling_params import SamplingParams

# The ranks' all-reduces add partial sums in another order than one rank's GEMMs: fp32 logits differed by at most
# 5.2e-5 on the demo model (logits up to ~27: ~3e-6 relative) and 6.7e-5 on SmolLM2 over three ranks
# (docs/PERFORMANCE.md). Three to four times that.
TP_ATOL = 2e-4

STRESS = dict(
    dtype="float32",
    max_num_seqs=6,
    max_num_batched_tokens=23,  # prompts chunked across steps, decode rows mixed in
    block_size=8,
    num_kv_blocks=16,  # too few for every sequence at once: preemption
    enable_prefix_caching=True,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Token ids the demo model continues with one token repeated: n-gram drafts that get accepted
REPEAT = ([640, 264, 370] * 11, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
# Step -> (request id, prompt, params): late arrivals, and prompts that share a cached prefix with finished ones
ARRIVALS = {
    0: [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:4])] + [("rep", *REPEAT)],
    3: [("r4", PROMPTS[4], GREEDY)],
    9: [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS[5:8], start=5)],
    30: [("hit0", PROMPTS[0] + " and more", GREEDY), ("hit1", REPEAT[0] + [5, 6], REPEAT[1])],
}


def run(engine: LLMEngine, arrivals=ARRIVALS) -> tuple[dict[str, list[int]], dict[tuple[str, int], torch.Tensor]]:
    """Step through `arrivals`: each request's tokens, and the logits rank 0 sampled from, by (request, position)."""
    if engine.spec_decoder is not None:  # drafts by the same rule however fast a step runs
        engine.spec_decoder.step_cost.observe = lambda rows, seconds: None
    logits = capture_sampled_logits(engine)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= max(arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return tokens, logits


def capture_sampled_logits(engine: LLMEngine) -> dict[tuple[str, int], torch.Tensor]:
    """Wrap rank 0's runner: the logits of every sampled row by (request id, position of the row's token)."""
    runner = engine.runner
    captured: dict[tuple[str, int], torch.Tensor] = {}
    execute, run_model = runner.execute, runner.run_model
    current = []

    def recording_execute(sched):
        current[:] = [sched]
        return execute(sched)

    def recording_run_model(input_ids, positions, meta, rows):
        out = run_model(input_ids, positions, meta, rows)
        seqs = current[0].seqs
        owners = np.searchsorted(meta.query_start_loc_np, rows, side="right") - 1
        for row, owner, lg in zip(rows.tolist(), owners.tolist(), out.cpu()):
            captured[(seqs[owner].request_id, int(positions[row]))] = lg
        return out

    runner.execute, runner.run_model = recording_execute, recording_run_model
    return captured


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    engine = LLMEngine(demo_model_dir, EngineConfig(**STRESS))
    try:
        return run(engine), engine.snapshot()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tp2(demo_model_dir):
    engine = LLMEngine(demo_model_dir, EngineConfig(**STRESS, tensor_parallel_size=2))
    yield engine
    engine.close()


def test_two_ranks_give_one_ranks_logits_and_greedy_tokens(reference, tp2):
    (ref_tokens, ref_logits), ref_stats = reference
    assert tp2.model.tp.shm is not None or not cpu.available(), "CPU ranks on one host meet in shared memory"
    tokens, logits = run(tp2)
    stats = tp2.snapshot()
    assert tokens == ref_tokens
    assert ref_logits.keys() == logits.keys()  # the same schedule
    diff = max((logits[k] - ref_logits[k]).abs().max().item() for k in ref_logits)
    print(f"\nmax |logits TP=2 - TP=1| = {diff:.2e} over {len(ref_logits)} rows")
    assert diff <= TP_ATOL
    assert (stats.num_preemptions, stats.prefix_cache_hits) == (ref_stats.num_preemptions, ref_stats.prefix_cache_hits)
    # The run covers what it is meant to
    assert stats.num_preemptions > 0, "expected preemption"
    assert stats.prefix_cache_hits > 0, "expected prefix-cache hits"
    assert stats.spec_decode_num_accepted_tokens > 0, "expected accepted drafts"
    assert tp2.block_manager.num_used_blocks == 0


def test_two_ranks_over_gloo_give_one_ranks_greedy_tokens(reference, demo_model_dir, monkeypatch):
    (ref_tokens, ref_logits), _ = reference
    monkeypatch.setenv(OFF_VARIABLE, "0")
    engine = LLMEngine(demo_model_dir, EngineConfig(**STRESS, tensor_parallel_size=2))
    try:
        assert engine.model.tp.shm is None
        tokens, logits = run(engine)
    finally:
        engine.close()
    assert tokens == ref_tokens and logits.keys() == ref_logits.keys()
    assert max((logits[k] - ref_logits[k]).abs().max().item() for k in ref_logits) <= TP_ATOL


def test_a_worker_rank_that_dies_ends_the_engine_at_once_and_leaves_no_process(tp2):
    worker = tp2.workers.processes[0]
    failures: list[tuple[float, str]] = []
    tp2.on_rank_failure(lambda reason: failures.append((time.monotonic(), reason)))
    tp2.add_request("x", PROMPTS[0], GREEDY)
    tp2.step()
    os.kill(worker.pid, signal.SIGKILL)
    killed = time.monotonic()
    while not failures and time.monotonic() - killed < 5:
        time.sleep(0.01)
    assert failures, "the watch did not see the rank die"
    assert failures[0][0] - killed < 1.0
    assert "rank 1" in failures[0][1] and "SIGKILL" in failures[0][1]
    with pytest.raises(EngineDeadError, match="rank 1"):
        tp2.step()
    tp2.close()
    assert not worker.is_alive()
    assert not _ranks_of(os.getpid()), "a tensor-parallel worker outlived its engine"


def test_a_rank_that_dies_while_rank_0_waits_in_a_collective_fails_the_step_at_once(demo_model_dir):
    # Without the abort, rank 0 would wait out the collective's 60 s timeout for a rank that will never come
    engine = LLMEngine(demo_model_dir, EngineConfig(dtype="float32", num_kv_blocks=32, tensor_parallel_size=2))
    try:
        worker = engine.workers.processes[0]
        engine.add_request("x", PROMPTS[0], GREEDY)
        os.kill(worker.pid, signal.SIGSTOP)  # rank 0's step goes as far as the first collective, and waits there
        errors: list[BaseException] = []

        def step() -> None:
            try:
                engine.step()
            except EngineDeadError as e:
                errors.append(e)

        stepping = threading.Thread(target=step, daemon=True)
        stepping.start()
        stepping.join(1.0)
        assert stepping.is_alive(), "rank 0's step did not wait for the stopped rank"
        os.kill(worker.pid, signal.SIGKILL)
        stepping.join(20)
        assert not stepping.is_alive(), "rank 0 still waits for a dead rank"
        assert len(errors) == 1 and "rank 1" in str(errors[0]) and "SIGKILL" in str(errors[0])
    finally:
        engine.close()


def _ranks_of(parent: int) -> list[int]:
    """Live tensor-parallel worker processes whose parent is `parent`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if name.startswith("inflight-tp") and int(rest[1]) == parent and rest[0] != "Z":
            found.append(int(entry))
    return found


@pytest.mark.skipif(
    os.environ.get("INFLIGHT_TEST_TP_SMOLLM2") != "1",
    reason="~50 s on 2 cores (each of three ranks dequantizes the GGUF): set INFLIGHT_TEST_TP_SMOLLM2=1",
)
def test_smollm2_over_three_ranks_gives_one_ranks_logits_and_greedy_tokens():
    # 9 heads and 3 KV heads: three ranks of three heads and one KV head each
    prompts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    arrivals = {0: [(f"s{i}", p, params) for i, p in enumerate(prompts)]}
    args = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)  # prompts chunked
    reference = LLMEngine(None, EngineConfig(**args, weight_format="dequantized"))
    ref_tokens, ref_logits = run(reference, arrivals)
    reference.close()
    tp3 = LLMEngine(None, EngineConfig(**args, tensor_parallel_size=3))
    try:
        tokens, logits = run(tp3, arrivals)
    finally:
        tp3.close()
    assert tokens == ref_tokens and logits.keys() == ref_logits.keys()
    diff = max((logits[k] - ref_logits[k]).abs().max().item() for k in ref_logits)
    print(f"\nSmolLM2: max |logits TP=3 - TP=1| = {diff:.2e} over {len(ref_logits)} rows")
    assert diff <= TP_ATOL


# ---- the layout, without processes -------------------------------------------------------------------------


def test_shards_cover_each_tensor_once_and_kv_heads_follow_vllms_rule():
    assert [TensorParallel(r, 4).kv_heads(8) for r in range(4)] == [(2, 0), (2, 2), (2, 4), (2, 6)]
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    rows = [TensorParallel(r, 3).vocab_rows(10) for r in range(3)]
    assert [(s.start, s.size, per) for s, per in rows] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    full = torch.arange(20.0).reshape(10, 2)
    parts = [local_part(full, s, (per, 2)) for s, per in rows]
    assert torch.equal(torch.cat(parts)[:10], full) and not parts[2][2:].any()  # zero rows pad the last shard


def ranks_as_threads(
    model_dir, size: int, weight_format: str = "auto", check_rank=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's logits from `size` ranks run as threads of this process in one group (no processes to start;
    shared memory where the C++ ops build, else gloo), and from one rank. `check_rank(model)` sees each rank's."""
    seq_lens, query_lens = [5, 19, 1], [5, 7, 1]
    vocab = ModelConfig.load(model_dir).vocab_size
    input_ids = torch.randint(0, vocab, (sum(query_lens),), generator=torch.Generator().manual_seed(0))
    rows = np.cumsum(query_lens) - 1
    port = free_port()

    def logits_of(tp: TensorParallel) -> torch.Tensor | None:
        model, _ = load_model(model_dir, torch.float32, "cpu", weight_format, tp=tp)
        if tp.size > 1 and check_rank is not None:
            check_rank(model)
        if tp.size > 1:
            store = dist.TCPStore("127.0.0.1", port, size, tp.rank == 0, timeout=timedelta(seconds=60))
            connect(tp, store, torch.device("cpu"))
        runner = ModelRunner(model, 8, 16, 64, torch.float32, torch.device("cpu"), "torch")
        positions, meta, _ = consecutive_batch(seq_lens, query_lens, 16, torch.device("cpu"))
        with torch.inference_mode():
            return runner.run_model(input_ids, positions, meta, rows)

    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(logits_of, [TensorParallel(r, size) for r in range(size)]))
    assert results[0].shape == (len(rows), vocab) and all(r is None for r in results[1:])
    return results[0], logits_of(TensorParallel())


def test_eight_ranks_replicate_kv_heads_and_pad_the_vocabulary(demo_model_dir):
    # The demo model's 8 heads, 4 KV heads, 742 vocabulary rows over 8 ranks: each KV head on two ranks, 93
    # vocabulary rows a rank (the last two of rank 7 are padding).
    tp, one = ranks_as_threads(demo_model_dir, 8)
    torch.testing.assert_close(tp, one, atol=TP_ATOL, rtol=0)


def test_gemma3_splits_over_ranks_too(tmp_path):
    # Gemma 3's own parts over 4 ranks: GeGLU, (1 + w) norms, sliding windows, two RoPE tables, soft-capped logits
    transformers = pytest.importorskip("transformers")
    from helpers.families import BASE, VOCAB

    from inflight.random_llama import build_tokenizer

    fields = dict(head_dim=16, intermediate_size=80, sliding_window=8, query_pre_attn_scalar=24,
                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=1.5,
                  architectures=["Gemma3ForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Gemma3TextConfig(**(BASE | fields)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.05 if "embed_tokens" in name else 0.2)
    hf.save_pretrained(tmp_path)
    build_tokenizer(VOCAB, 0).save(str(tmp_path / "tokenizer.json"))
    tp, one = ranks_as_threads(tmp_path, 4)  # 4 heads, 2 KV heads (each on two ranks), 75 vocabulary rows a rank
    torch.testing.assert_close(tp, one, atol=TP_ATOL, rtol=0)


# ---- GGUF files: each rank reads its part of the blocks -----------------------------------------------------


def _tiny_gguf(tmp_path, qtype, **overrides):
    from test_gguf_loader import tiny_hf_model, write_gguf

    write_gguf(tmp_path / "tiny.gguf", tiny_hf_model(**overrides), qtype)
    return tmp_path


def _read_as_rank(model_dir, tp: TensorParallel, keep: set[str]) -> dict:
    cfg = ModelConfig.load(model_dir)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg, tp) if tp.size > 1 else LlamaForCausalLM(cfg)
    expected = dict(meta.state_dict())
    part_of = (lambda name, shape: shard_of(meta, name) if name in expected else None) if tp.size > 1 else None
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    return read_tensors(next(model_dir.glob("*.gguf")), *heads, torch.float32, "cpu", keep, part_of)


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_K"])
def test_a_rank_reads_only_its_part_of_a_gguf_as_blocks_or_dequantized(tmp_path, monkeypatch, qtype_name):
    """Each rank reads its rows of a column-parallel tensor and its columns of a row-parallel one straight from
    the file's blocks, kept packed or dequantized: the same values as the whole tensor's slice, and only its share
    of the dequantizing. Q4_K's 256-wide blocks do not split o_proj's 2 x 128 columns: that one is read whole."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    sizes = dict(intermediate_size=128) if qtype_name == "Q8_0" else dict(hidden_size=256, intermediate_size=512)
    model_dir = _tiny_gguf(tmp_path, qtype, **sizes)
    reader = gguf.GGUFReader(next(model_dir.glob("*.gguf")))
    quantized = {hf_name(t.name) for t in reader.tensors if t.tensor_type == qtype}
    unaligned = {n for n in quantized if n.endswith("o_proj.weight")} if qtype_name == "Q4_K" else set()
    dequantized_bytes: list[int] = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda d, q: dequantized_bytes.append(d.nbytes) or real(d, q))
    whole = _read_as_rank(model_dir, TensorParallel(), set())
    whole_bytes = sum(dequantized_bytes)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        dequantized_bytes.clear()
        parts = _read_as_rank(model_dir, tp, set())
        if not unaligned:
            assert sum(dequantized_bytes) < 0.55 * whole_bytes  # its half, and the norms every rank holds
        packed = _read_as_rank(model_dir, tp, quantized - unaligned)
        with torch.device("meta"):
            meta = LlamaForCausalLM(ModelConfig.load(model_dir), tp)
        for name, tensor in whole.items():
            shard = shard_of(meta, name)
            want = tensor if shard is None else shard.take(tensor)
            assert torch.equal(parts[name], want), name
            if isinstance(packed[name], GGUFWeight):
                blocks = packed[name]
                values = dequantize(blocks.data.numpy(), qtype).reshape(blocks.shape)
                assert blocks.shape == tuple(want.shape) and np.array_equal(values, want.numpy()), name
            else:
                assert name not in quantized - unaligned and torch.equal(packed[name], want), name


@pytest.mark.skipif(not cpu.gguf_supports(8, torch.float32, 32), reason="no CPU GGUF kernel on this machine")
def test_two_ranks_compute_on_their_shares_of_a_gguf_s_blocks(tmp_path):
    """weight_format 'packed' over two ranks: every projection, the embedding and the tied output layer computed
    on this rank's blocks (the vocabulary's 300 rows as 2 x 150), the logits one rank's. A width a rank's share
    does not split into whole blocks is named."""
    model_dir = _tiny_gguf(tmp_path, gguf.GGMLQuantizationType.Q8_0, intermediate_size=128, tie_word_embeddings=True)

    def on_blocks(model):
        layer = model.model.layers[0]
        kinds = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        assert all(isinstance(m, QuantizedLinear) for m in kinds + [model.lm_head])
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and model.lm_head.out_features == 150

    tp, one = ranks_as_threads(model_dir, 2, "packed", check_rank=on_blocks)
    torch.testing.assert_close(tp, one, atol=TP_ATOL, rtol=0)
    (tmp_path / "odd").mkdir()
    odd = _tiny_gguf(tmp_path / "odd", gguf.GGMLQuantizationType.Q8_0, intermediate_size=96)  # 2 x 48 columns
    with pytest.raises(ConfigError, match="down_proj"):
        load_model(odd, torch.float32, "cpu", "packed", tp=TensorParallel(0, 2))


def test_sizes_that_do_not_split_the_model_are_refused_by_name(demo_model_dir):
    cfg = ModelConfig.load(demo_model_dir)  # 8 attention heads, 4 KV heads
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2}
    check_sizes(cfg, 8)  # each KV head on two ranks
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 .*num_attention_heads=8"):
        check_sizes(cfg, 3)
    with pytest.raises(ConfigError, match="tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="enable_lora with tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: Qwen3MoeForCausalLM is not split"):
        check_tensor_parallel(ModelConfig.from_hf_dict(cfg.hf_config | moe), 2)
    ns = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])  # the flag: a config.pbtxt parameter
    assert serve_parameters(ns)[0]["tensor_parallel_size"] == 2
