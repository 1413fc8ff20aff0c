"""Gemma 3 text models against HF transformers on a tiny random checkpoint the test makes (local layers with a
window shorter than the prompts, a linearly scaled global RoPE, soft-capped logits): fp32 logits at every
position, greedy tokens under chunked prefill, preemption, prefix-cache hits and speculative verification,
LoRA adapters as PEFT applies them, and how the config is read."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import capture_logits, hf_greedy, hf_logits
from helpers.families import BASE, VOCAB

from inflight import LLM, SamplingParams
from inflight.config import ConfigError, EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.executor.attention.torch_backend import TorchBackend
from inflight.models.config import ModelConfig
from inflight.models.gemma3 import GLOBAL, LOCAL, Gemma3Config, RopeSpec

transformers = pytest.importorskip("transformers")


FP32 = "float32"
WINDOW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FIELDS = dict(
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=80,
    sliding_window=WINDOW,
    layer_types=[LOCAL, LOCAL, GLOBAL, LOCAL],
    query_pre_attn_scalar=24,
    final_logit_softcapping=1.5,
    rope_parameters={
        LOCAL: {"rope_type": "default", "rope_theta": 100.0},
        GLOBAL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    },
)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The checkpoint's directory and HF's model of it (fp32, eval). Weights are drawn with std 0.2, but the tied
    embedding's 0.05: scaled by sqrt(hidden), a larger one makes every greedy step repeat its input token."""
    from inflight.random_llama import build_tokenizer

    out = tmp_path_factory.mktemp("gemma3")
    cfg = transformers.Gemma3TextConfig(**(BASE | FIELDS), architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.05 if "embed_tokens" in name else 0.2)
    model.save_pretrained(out)
    build_tokenizer(VOCAB, 0).save(str(out / "tokenizer.json"))
    return out, model


def gemma_1b_config(**changes) -> dict:
    """gemma-3-1b's config.json as published (pre-HF5 fields, no layer_types, no tie_word_embeddings), shrunk."""
    cfg = dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=12,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
               query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None)  # fmt: skip
    return cfg | changes


def test_a_published_style_config_reads_as_hf_reads_it():
    cfg = ModelConfig.from_hf_dict(gemma_1b_config(rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert cfg.layer_sliding_windows == tuple(None if i in (5, 11) else 512 for i in range(12))
    gemma = Gemma3Config.from_model_config(cfg)
    assert gemma.rope == {LOCAL: RopeSpec(1e4, 1.0), GLOBAL: RopeSpec(1e6, 8.0)}
    assert gemma.query_pre_attn_scalar == 256 and gemma.final_logit_softcapping is None
    hf = transformers.Gemma3TextConfig(**gemma_1b_config(rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert hf.layer_types == list(gemma.layer_types) and hf.tie_word_embeddings


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 8.0}), "rope_scaling rope_type='yarn'"),
        (dict(rope_parameters={LOCAL: {"rope_type": "dynamic", "factor": 2.0}}), r"rope_parameters\['sliding"),
        (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        (dict(layer_types=[LOCAL] * 3), "layer_types"),
    ],
)
def test_what_is_not_computed_is_refused_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        Gemma3Config.from_model_config(ModelConfig.from_hf_dict(gemma_1b_config(**changes)))


def test_logits_every_position_match_hf_in_chunked_preempted_batches(gemma):
    model_dir, hf_model = gemma
    cfg = EngineConfig(dtype=FP32, max_num_seqs=5, max_num_batched_tokens=23, block_size=8, num_kv_blocks=16)
    engine = LLMEngine(str(model_dir), cfg)
    captured = capture_logits(engine)
    ps = prompts(7, seed=1, lo=10)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert any(len(pos) > 1 and pos[0] > 0 for _, pos, _ in captured), "expected a prompt in chunks"
    refs = {f"r{i}": hf_logits(hf_model, p + tokens[f"r{i}"]) for i, p in enumerate(ps)}
    for rid, positions, logits in captured:
        torch.testing.assert_close(logits, refs[rid][positions], atol=2e-4, rtol=1e-4)
    assert max(len(p) for p in ps) > 3 * WINDOW
    for i, p in enumerate(ps):  # greedy: HF's argmax over its own logits
        assert tokens[f"r{i}"] == refs[f"r{i}"][len(p) - 1 : -1].argmax(-1).tolist()


def test_the_plain_torch_ops_match_hf_with_two_rope_tables_a_step(gemma):
    # Local and global layers pass different cos/sin tables with the same positions tensor each step.
    model_dir, hf_model = gemma
    engine = LLMEngine(str(model_dir), EngineConfig(dtype=FP32, num_kv_blocks=32, block_size=8))
    engine.runner.ops = TorchBackend(native=False)
    captured = capture_logits(engine)
    ps = prompts(3, seed=5, lo=20)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    refs = {f"r{i}": hf_logits(hf_model, p + tokens[f"r{i}"]) for i, p in enumerate(ps)}
    for rid, positions, logits in captured:
        torch.testing.assert_close(logits, refs[rid][positions], atol=2e-4, rtol=1e-4)


def test_greedy_matches_hf_with_prefix_hits_and_speculation(gemma):
    model_dir, hf_model = gemma
    shared = prompts(1, seed=2, lo=30, hi=31)[0]
    # Repetitive tails give the n-gram proposer drafts to verify.
    ps = [shared + p + p for p in prompts(4, seed=3, lo=3, hi=8)]
    refs = [hf_greedy(hf_model, p, 12) for p in ps]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(model_dir), dtype=FP32, num_kv_blocks=64, block_size=8, speculative_config=spec)
    llm.generate([shared + [5]], SamplingParams(max_tokens=1), use_tqdm=False)  # the shared prefix, cached
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert len({t for r in refs for t in r}) > 12, "greedy tokens should vary"
    assert llm.engine.scheduler.prefix_cache_hits >= 4 * (len(shared) // 8) * 8
    assert llm.engine.spec_decode_counters["spec_decode_num_draft_tokens"] > 0


def test_lora_adapters_change_the_logits_as_peft_does(gemma, tmp_path):
    pytest.importorskip("peft")
    from helpers.lora import make_adapter, peft_model

    from inflight.lora_request import LoRARequest

    model_dir, hf_model = gemma
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = make_adapter(hf_model, tmp_path / "all8", 8, targets, seed=7)
    reference = peft_model(hf_model, adapter)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules={"all8": adapter})
    engine = LLMEngine(str(model_dir), EngineConfig(dtype=FP32, num_kv_blocks=32, block_size=8, **lora))
    captured = capture_logits(engine)
    ps = prompts(2, seed=6, lo=12, hi=20)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, params, lora_request=LoRARequest("all8") if i == 0 else None)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    refs = {"r0": hf_logits(reference, ps[0] + tokens["r0"]), "r1": hf_logits(hf_model, ps[1] + tokens["r1"])}
    assert (refs["r0"] - hf_logits(hf_model, ps[0] + tokens["r0"])).abs().max() > 0.05, "the adapter must matter"
    for rid, positions, logits in captured:
        torch.testing.assert_close(logits, refs[rid][positions], atol=2e-4, rtol=1e-4)


def test_bf16_a_request_gets_the_same_logits_alone_and_in_a_chunked_batch_past_the_window(gemma):
    from helpers.families import assert_bf16_batch_invariant

    assert_bf16_batch_invariant(gemma[0], prompts(5, seed=3, lo=20, hi=40), max_tokens=16)
