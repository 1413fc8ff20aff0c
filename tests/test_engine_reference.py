"""The engine against HF transformers on the same checkpoint: logits and greedy tokens.

Every engine here runs in float32, explicitly: the reference is HF in fp32 and the tolerances are fp32's
(dtype="auto" means bf16 on a CPU with AVX512-BF16 or AMX; tests/test_bf16_reference.py covers bf16).
"""

import pytest
import torch
from helpers import PROMPTS, capture_logits, hf_greedy, hf_logits

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine

MAX_TOKENS = 16
FP32 = "float32"


def run_to_completion(engine: LLMEngine, arrivals: dict[int, list[tuple[str, str]]], params) -> dict[str, list[int]]:
    """Step the engine, adding requests at the given step numbers (mid-run arrivals)."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for rid, prompt in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return tokens


def test_logits_every_position_match_hf_in_mixed_chunked_preempted_batches(demo_model_dir, hf_model):
    # Tiny budgets force everything at once: prefills chunked across 8-token block boundaries, decode
    # rows mixed with prefill chunks, late arrivals, and preemption from a KV cache too small for all.
    cfg = EngineConfig(dtype=FP32, max_num_seqs=6, max_num_batched_tokens=23, block_size=8, num_kv_blocks=14)
    engine = LLMEngine(demo_model_dir, cfg)
    captured = capture_logits(engine)
    prompts = PROMPTS[:8]
    arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts[:4])], 3: [("r4", prompts[4])], 7: []}
    arrivals[7] = [(f"r{i}", p) for i, p in enumerate(prompts[5:], start=5)]
    tokens = run_to_completion(engine, arrivals, SamplingParams(temperature=0, max_tokens=12))

    assert engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert any(n > 1 for *_, lg in captured for n in [lg.shape[0]]), "expected prefill chunks"
    assert engine.block_manager.num_used_blocks == 0
    prompt_ids = {f"r{i}": engine.tokenizer.encode(p).ids for i, p in enumerate(prompts)}
    refs = {rid: hf_logits(hf_model, prompt_ids[rid] + toks) for rid, toks in tokens.items()}
    checked = 0
    for rid, positions, logits in captured:
        torch.testing.assert_close(logits, refs[rid][positions], atol=2e-4, rtol=1e-4)
        checked += len(positions)
    assert checked > sum(len(t) for t in tokens.values())


@pytest.fixture(scope="module")
def hf_reference(demo_model_dir, hf_model):
    llm = LLM(demo_model_dir, dtype=FP32, num_kv_blocks=64)
    ids = [llm.tokenizer.encode(p).ids for p in PROMPTS]
    return [hf_greedy(hf_model, i, MAX_TOKENS) for i in ids]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        dict(scheduling_policy="static"),
        dict(kv_reservation="max_length", max_model_len=64),
        dict(scheduling_policy="static", kv_reservation="max_length", max_model_len=64),
        dict(max_num_batched_tokens=20, num_kv_blocks=12, block_size=8),  # forced preemption
        dict(max_num_seqs=3, max_num_batched_tokens=7),
    ],
    ids=["continuous-paged", "static-paged", "continuous-maxlen", "static-maxlen", "preempting", "narrow"],
)
def test_greedy_matches_hf_under_every_policy(demo_model_dir, hf_reference, engine_args):
    args = dict(dtype=FP32, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64) | engine_args
    llm = LLM(demo_model_dir, **args)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_reference
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_text_matches_hf_tokenizer_decode(demo_model_dir, hf_tokenizer):
    llm = LLM(demo_model_dir, dtype=FP32, num_kv_blocks=64)
    for out in llm.generate(PROMPTS[:6], GREEDY):
        assert out.text == hf_tokenizer.decode(out.token_ids, skip_special_tokens=True)
