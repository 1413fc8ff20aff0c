"""Sliding-window attention against HF transformers: Mistral (every layer local) and Qwen2 with
`use_sliding_window` from `max_window_layers` on (local and global layers mixed), with windows shorter than
the prompts; and the KV cache giving back the blocks every layer's window has passed."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import capture_logits, hf_logits
from helpers.families import VOCAB, assert_bf16_batch_invariant, write_family

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.models.config import ModelConfig
from inflight.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 20
FAMILIES = {
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=16)),
    "Qwen2ForCausalLM": (
        "Qwen2Config",
        dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1, num_hidden_layers=3),
    ),
}


def prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    config_class, fields = FAMILIES[request.param]
    return write_family(tmp_path_factory.mktemp(request.param), request.param, config_class, fields)


def test_each_layer_gets_the_window_hf_gives_it():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2)
    mistral = ModelConfig.from_hf_dict(dict(base, architectures=["MistralForCausalLM"], sliding_window=64))
    assert mistral.layer_sliding_windows == (64,) * 4
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=64, max_window_layers=2)
    assert ModelConfig.from_hf_dict(qwen).layer_sliding_windows == (None,) * 4  # use_sliding_window is off
    assert ModelConfig.from_hf_dict(qwen | {"use_sliding_window": True}).layer_sliding_windows == (
        None, None, 64, 64)  # fmt: skip
    typed = qwen | {"layer_types": ["sliding_attention", "full_attention"] * 2}
    assert ModelConfig.from_hf_dict(typed).layer_sliding_windows == (64, None, 64, None)


def test_logits_every_position_match_hf_past_the_window(family):
    model_dir, hf_model = family
    # A small cache: blocks given back behind the window are taken by other sequences and overwritten.
    cfg = EngineConfig(dtype="float32", max_num_seqs=6, max_num_batched_tokens=29, block_size=8, num_kv_blocks=24)
    engine = LLMEngine(str(model_dir), cfg)
    captured = capture_logits(engine)
    ps = prompts(8, seed=1, lo=24, hi=60)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert any(len(pos) > 1 and pos[0] > 0 for _, pos, _ in captured), "expected a prompt in chunks"
    assert engine.block_manager.num_used_blocks == 0
    refs = {f"r{i}": hf_logits(hf_model, p + tokens[f"r{i}"]) for i, p in enumerate(ps)}
    for rid, positions, logits in captured:
        torch.testing.assert_close(logits, refs[rid][positions], atol=2e-4, rtol=1e-4)
    for i, p in enumerate(ps):
        assert tokens[f"r{i}"] == refs[f"r{i}"][len(p) - 1 : -1].argmax(-1).tolist()


def test_blocks_behind_every_layers_window_go_back_to_the_pool(family):
    model_dir, _ = family
    arch = model_dir.name.rstrip("0123456789")
    engine = LLMEngine(str(model_dir), EngineConfig(dtype="float32", block_size=8, num_kv_blocks=64))
    engine.add_request("long", prompts(1, seed=2, lo=20, hi=21)[0], SamplingParams(max_tokens=60, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.block_manager.num_used_blocks)
    if arch == "MistralForCausalLM":  # all local: the window's blocks, one partly behind it, one being filled
        assert engine.block_manager.sliding_window == WINDOW
        assert most <= WINDOW // 8 + 2
    else:  # a global layer reads every block: none goes back early
        assert engine.block_manager.sliding_window is None
        assert most == -(-80 // 8)
    assert engine.block_manager.num_used_blocks == 0


def test_bf16_a_request_gets_the_same_logits_alone_and_in_a_chunked_batch_past_the_window(family):
    assert_bf16_batch_invariant(family[0], prompts(5, seed=3, lo=24, hi=50), max_tokens=16)
