"""Mixture-of-Experts families (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE with its shared expert) against HF
transformers on tiny random checkpoints the tests make: fp32 logits at every position, greedy tokens under
chunked prefill, preemption, prefix-cache hits and speculative verification, and bf16 batch invariance."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import capture_logits, hf_greedy, hf_logits
from helpers.families import MOE_FAMILIES, VOCAB, assert_bf16_batch_invariant, write_family

from inflight import LLM, SamplingParams
from inflight.config import ConfigError, EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.models.config import ModelConfig
from inflight.models.moe import MoEConfig

transformers = pytest.importorskip("transformers")

FP32 = "float32"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def family(request, tmp_path_factory):
    config_class, fields = MOE_FAMILIES[request.param]
    return write_family(tmp_path_factory.mktemp(request.param), request.param, config_class, fields)


def test_each_familys_router_and_layers_are_read_from_its_config():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2)
    mixtral = ModelConfig.from_hf_dict(dict(base, architectures=["MixtralForCausalLM"], num_local_experts=4,
                                            num_experts_per_tok=2))  # fmt: skip
    moe = MoEConfig.from_model_config(mixtral)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (4, 2, 16, True)
    assert moe.sparse_layers == (True,) * 4 and moe.shared_expert_intermediate_size == 0
    qwen2 = ModelConfig.from_hf_dict(dict(base, architectures=["Qwen2MoeForCausalLM"], num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=4, decoder_sparse_step=2,
                                          mlp_only_layers=[3], shared_expert_intermediate_size=12))  # fmt: skip
    moe = MoEConfig.from_model_config(qwen2)
    assert (moe.intermediate_size, moe.renormalize, moe.shared_expert_intermediate_size) == (4, False, 12)
    assert moe.sparse_layers == (False, True, False, False)  # every 2nd layer, but layer 3 kept dense
    assert qwen2.attention_bias and qwen2.qk_norm is None
    olmoe = ModelConfig.from_hf_dict(dict(base, architectures=["OlmoeForCausalLM"], num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True))  # fmt: skip
    assert olmoe.qk_norm == "projection" and MoEConfig.from_model_config(olmoe).renormalize
    with pytest.raises(ConfigError, match="num_experts_per_tok=5"):
        MoEConfig.from_model_config(
            ModelConfig.from_hf_dict(
                dict(base, architectures=["OlmoeForCausalLM"], num_experts=4, num_experts_per_tok=5)
            )  # fmt: skip
        )


def test_an_unsupported_architecture_is_named_with_the_supported_ones():
    with pytest.raises(ConfigError, match=r"architectures=\['DeepseekV3ForCausalLM'\].*Qwen3MoeForCausalLM"):
        ModelConfig.from_hf_dict(dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=8))


def test_a_missing_expert_is_named(family, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir, _ = family
    target = tmp_path / "m"
    target.mkdir()
    for f in model_dir.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(target / "model.safetensors"))
    dropped = next(k for k in weights if ".experts.3." in k and ("up_proj" in k or ".w3." in k))
    del weights[dropped]
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"experts\.3\.up_proj"):
        LLM(str(target), dtype=FP32, num_kv_blocks=16)


def test_logits_every_position_match_hf_in_chunked_preempted_batches(family):
    model_dir, hf_model = family
    cfg = EngineConfig(dtype=FP32, max_num_seqs=5, max_num_batched_tokens=23, block_size=8, num_kv_blocks=16)
    engine = LLMEngine(str(model_dir), cfg)
    captured = capture_logits(engine)
    ps = prompts(7, seed=1)
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
    for i, p in enumerate(ps):  # greedy: HF's argmax over its own logits
        assert tokens[f"r{i}"] == refs[f"r{i}"][len(p) - 1 : -1].argmax(-1).tolist()


def test_greedy_matches_hf_with_prefix_hits_and_speculation(family):
    model_dir, hf_model = family
    shared = prompts(1, seed=2, lo=30, hi=31)[0]
    # Repetitive tails give the n-gram proposer drafts to verify.
    ps = [shared + p + p for p in prompts(4, seed=3, lo=3, hi=8)]
    refs = [hf_greedy(hf_model, p, 12) for p in ps]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(model_dir), dtype=FP32, num_kv_blocks=64, block_size=8, speculative_config=spec)
    llm.generate([shared + [5]], SamplingParams(max_tokens=1), use_tqdm=False)  # the shared prefix, cached
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert llm.engine.scheduler.prefix_cache_hits >= 4 * (len(shared) // 8) * 8
    assert llm.engine.spec_decode_counters["spec_decode_num_draft_tokens"] > 0


def test_bf16_a_request_gets_the_same_logits_alone_and_in_a_chunked_batch(family):
    assert_bf16_batch_invariant(family[0], prompts(6, seed=4))


GGUF_ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
             "OlmoeForCausalLM": "olmoe"}  # fmt: skip


def test_a_gguf_file_of_the_family_gives_the_checkpoints_logits(family, tmp_path):
    """The file as llama.cpp's converter lays it out (stacked experts, permuted Q/K for `llama` only): exactly
    the safetensors checkpoint's logits in F32, and HF's on the dequantized weights in Q8_0."""
    import copy

    from gguf import GGMLQuantizationType as Q
    from helpers.families import write_moe_gguf

    from inflight.models.loader import load_model

    model_dir, hf_model = family
    arch = hf_model.config.architectures[0]
    if arch == "Qwen2MoeForCausalLM":  # llama.cpp's qwen2moe has no dense layers: every layer sparse here
        config_class, fields = MOE_FAMILIES[arch]
        fields = {k: v for k, v in fields.items() if k != "mlp_only_layers"}
        model_dir, hf_model = write_family(tmp_path / "sparse", arch, config_class, fields)
    ids = list(range(3, 40, 2))

    def logits(path):
        from inflight.executor.attention.metadata import consecutive_batch
        from inflight.executor.model_runner import ModelRunner

        model, cfg = load_model(path, torch.float32, "cpu")
        assert cfg.architecture == arch
        runner = ModelRunner(model, 8, 16, 64, torch.float32, torch.device("cpu"), "torch")
        positions, meta, _ = consecutive_batch([len(ids)], [len(ids)], 16, torch.device("cpu"))
        with torch.inference_mode():
            return model.compute_logits(runner.forward(torch.tensor(ids), positions, meta))

    f32 = write_moe_gguf(tmp_path / "f32.gguf", copy.deepcopy(hf_model), GGUF_ARCH[arch])
    assert torch.equal(logits(f32), logits(model_dir))
    quantized_hf = copy.deepcopy(hf_model)
    q8 = write_moe_gguf(tmp_path / "q8.gguf", quantized_hf, GGUF_ARCH[arch], Q.Q8_0)
    torch.testing.assert_close(logits(q8), hf_logits(quantized_hf, ids), atol=2e-4, rtol=1e-4)


def test_lora_on_a_moe_model_is_refused_by_name(family):
    model_dir, hf_model = family
    with pytest.raises(ConfigError, match=f"LoRA adapters are not supported on {hf_model.config.architectures[0]}"):
        LLM(str(model_dir), dtype=FP32, num_kv_blocks=16, enable_lora=True)
