"""Multi-LoRA against PEFT on HF (the same adapters applied by `peft`): logits and greedy tokens per adapter,
alone and in batches mixing adapters and base rows, with chunked prefill, preemption and prefix caching.

Engines run in float32 with fp32's tolerances, as tests/test_engine_reference.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, capture_logits, hf_logits
from helpers.lora import make_adapter, peft_model

from inflight import LLM, SamplingParams
from inflight.config import ConfigError, EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.kv_events import BlockStored
from inflight.errors import InvalidRequestError
from inflight.lora_request import LoRARequest, stable_lora_id

pytest.importorskip("peft")

FP32 = "float32"
# (rank, target modules, seed): ranks 8 and 64, attention only, MLP only, every projection
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], 1),
    "mlp8": (8, ["gate_proj", "up_proj", "down_proj"], 2),
    "all64": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 3),
    "ko16": (16, ["k_proj", "o_proj", "down_proj"], 4),
}


@pytest.fixture(scope="module")
def adapters(demo_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(demo_model_dir, root / name, r, t, seed) for name, (r, t, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def peft_models(demo_model_dir, adapters):
    return {name: peft_model(demo_model_dir, path) for name, path in adapters.items()}


def lora_engine(model_dir, adapters, **overrides) -> LLMEngine:
    args = dict(dtype=FP32, num_kv_blocks=64, enable_lora=True, max_loras=4, max_lora_rank=64, lora_modules=adapters)
    return LLMEngine(model_dir, EngineConfig(**(args | overrides)))


def run(engine: LLMEngine, requests: list[tuple[str, str, str | None]], params: SamplingParams) -> dict[str, list]:
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, params, lora_request=LoRARequest(adapter) if adapter else None)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_adapters_change_the_output_as_peft_does(demo_model_dir, hf_model, peft_models):
    # The fixture's adapters must matter, or every comparison below would pass with LoRA ignored.
    ids = [5, 17, 42, 9, 101, 7]
    base = hf_logits(hf_model, ids)
    for name, model in peft_models.items():
        assert (hf_logits(model, ids) - base).abs().max() > 0.05, name


def test_logits_equal_peft_in_a_batch_mixing_four_adapters_and_base(demo_model_dir, adapters, peft_models, hf_model):
    # Tiny budgets: prefills chunked across block boundaries, decode rows beside prefill chunks, preemption.
    engine = lora_engine(demo_model_dir, adapters, max_num_seqs=6, max_num_batched_tokens=23, block_size=8,
                         num_kv_blocks=11)  # fmt: skip
    captured = capture_logits(engine)
    names = [*ADAPTERS, None]
    requests = [(f"r{i}", PROMPTS[i], names[i % len(names)]) for i in range(10)]
    tokens = run(engine, requests, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))

    assert engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert any(lg.shape[0] > 1 for *_, lg in captured), "expected prefill chunks"
    assert engine.block_manager.num_used_blocks == 0
    adapter_of = {rid: name for rid, _, name in requests}
    prompt_ids = {rid: engine.tokenizer.encode(p).ids for rid, p, _ in requests}
    refs = {}
    for rid, toks in tokens.items():
        model = peft_models[adapter_of[rid]] if adapter_of[rid] else hf_model
        refs[rid] = hf_logits(model, prompt_ids[rid] + toks)
        # greedy: each token is the reference's argmax after the tokens before it
        assert refs[rid][len(prompt_ids[rid]) - 1 : -1].argmax(-1).tolist() == toks, rid
    for rid, positions, logits in captured:
        torch.testing.assert_close(logits, refs[rid][positions], atol=3e-4, rtol=1e-4)


def test_a_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(demo_model_dir, adapters):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = run(lora_engine(demo_model_dir, adapters), [("x", PROMPTS[2], "all64")], params)["x"]
    engine = lora_engine(demo_model_dir, adapters)
    mixed = [(f"o{i}", PROMPTS[i + 3], [*ADAPTERS, None][i % 5]) for i in range(7)]
    together = run(engine, [*mixed[:4], ("x", PROMPTS[2], "all64"), *mixed[4:]], params)
    assert together["x"] == alone


def test_the_prefix_cache_never_shares_kv_between_adapters(demo_model_dir, adapters):
    engine = lora_engine(demo_model_dir, adapters)
    prompt = list(range(10, 10 + 40))  # two full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)
    cached = {}
    for rid, adapter in (("a1", "qv8"), ("b1", "mlp8"), ("base1", None), ("a2", "qv8"), ("base2", None)):
        engine.add_request(rid, prompt, params, lora_request=LoRARequest(adapter) if adapter else None)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    cached[rid] = out.num_cached_tokens
    assert cached == {"a1": 0, "b1": 0, "base1": 0, "a2": 32, "base2": 32}


def test_kv_events_carry_the_adapters_id(demo_model_dir, adapters):
    engine = lora_engine(demo_model_dir, adapters)
    engine.block_manager._events = []  # record without a socket
    run(engine, [("a", list(range(10, 60)), "ko16"), ("b", list(range(10, 60)), None)], SamplingParams(max_tokens=4))
    stored = [e for e in engine.block_manager.take_events() if isinstance(e, BlockStored)]
    assert {e.lora_id for e in stored} == {stable_lora_id("ko16"), None}


def test_at_most_max_loras_adapters_run_in_one_step(demo_model_dir, adapters):
    engine = lora_engine(demo_model_dir, adapters, max_loras=2)
    seen: list[set[str]] = []
    slots_for = engine.lora.slots_for

    def recording(names):
        seen.append({n for n in names if n is not None})
        return slots_for(names)

    engine.lora.slots_for = recording
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [(f"r{i}", PROMPTS[i], [*ADAPTERS][i % 4]) for i in range(8)]
    tokens = run(engine, requests, params)
    assert max(len(s) for s in seen) == 2 and len(set().union(*seen)) == 4
    alone = lora_engine(demo_model_dir, adapters)
    for rid, prompt, adapter in requests:
        assert run(alone, [(rid, prompt, adapter)], params)[rid] == tokens[rid]
    assert engine.lora.num_slot_loads > 2  # slots were reused as adapters came and went


def test_offline_llm_takes_a_lora_request_per_prompt(demo_model_dir, adapters):
    llm = LLM(demo_model_dir, dtype=FP32, num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[:3]
    loras = [LoRARequest("qv8", lora_path=adapters["qv8"]), None, LoRARequest("all64", lora_path=adapters["all64"])]
    outs = llm.generate(prompts, params, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        assert llm.generate(prompt, params, lora_request=lora)[0].token_ids == out.token_ids
    assert outs[0].token_ids != llm.generate(prompts[0], params)[0].token_ids


def test_unknown_adapter_and_lora_off_are_named(demo_model_dir, adapters):
    engine = lora_engine(demo_model_dir, {"qv8": adapters["qv8"]})
    with pytest.raises(InvalidRequestError, match="lora_name='nope' is not a known LoRA adapter.*'qv8'") as e:
        engine.add_request("r", "hello", lora_request=LoRARequest("nope"))
    assert e.value.field == "lora_name"
    off = LLMEngine(demo_model_dir, EngineConfig(dtype=FP32, num_kv_blocks=16))
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        off.add_request("r", "hello", lora_request=LoRARequest("qv8"))


def test_an_adapter_the_model_cannot_take_is_refused_at_start_up(demo_model_dir, adapters, tmp_path):
    with pytest.raises(ConfigError, match="'big'.*rank 64 exceeds max_lora_rank=16"):
        lora_engine(demo_model_dir, {"big": adapters["all64"]}, max_lora_rank=16)
    embed = make_adapter(demo_model_dir, tmp_path / "embed", 8, ["q_proj", "embed_tokens"], seed=5)
    with pytest.raises(ConfigError, match="'embed'.*embed_tokens"):
        lora_engine(demo_model_dir, {"embed": embed})
    with pytest.raises(ConfigError, match="'missing'.*adapter_config.json is missing"):
        lora_engine(demo_model_dir, {"missing": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="max_lora_rank=12 is invalid"):
        EngineConfig(enable_lora=True, max_lora_rank=12)


def test_an_adapter_in_use_is_not_unloaded(demo_model_dir, adapters):
    engine = lora_engine(demo_model_dir, {"qv8": adapters["qv8"]})
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), lora_request=LoRARequest("qv8"))
    engine.step()
    snap = engine.snapshot()
    assert (snap.running_lora_adapters, snap.waiting_lora_adapters, snap.max_lora) == (("qv8",), (), 4)
    with pytest.raises(InvalidRequestError, match="in use by 1 unfinished request"):
        engine.remove_lora("qv8")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("qv8")
    assert engine.list_loras() == []
    engine.add_lora(LoRARequest("qv8", lora_path=adapters["qv8"]))  # loaded again without a restart
    assert engine.list_loras() == ["qv8"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, the Triton LoRA kernels)")
def test_adapter_rows_on_a_gpu_with_cuda_graphs_equal_eager_steps(demo_model_dir, adapters):
    # Graphs are captured without adapters: steps with adapter rows must not replay them
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [(f"r{i}", PROMPTS[i], [*ADAPTERS, None][i % 5]) for i in range(10)]
    results = []
    for eager in (True, False):
        engine = lora_engine(demo_model_dir, adapters, device="cuda", enforce_eager=eager)
        results.append(run(engine, requests, params))
    assert results[0] == results[1]


def test_speculative_decoding_with_adapters_keeps_their_greedy_output(demo_model_dir, adapters):
    # Repetitive prompts: the n-gram proposer drafts, and verification must run the drafts through each adapter
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    requests = [(f"r{i}", (PROMPTS[i] + " ") * 4, [*ADAPTERS, None][i % 5]) for i in range(5)]
    plain = run(lora_engine(demo_model_dir, adapters), requests, params)
    engine = lora_engine(demo_model_dir, adapters, speculative_config=spec)
    assert run(engine, requests, params) == plain
    assert engine.spec_decode_counters["spec_decode_num_drafts"] > 0


def test_structured_outputs_with_an_adapter(demo_model_dir, adapters):
    engine = lora_engine(demo_model_dir, adapters)
    so = {"choice": ["red garden", "blue river", "quiet forest"]}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs=so)
    tokens = run(engine, [(f"r{i}", PROMPTS[i], [*ADAPTERS][i % 4]) for i in range(4)], params)
    texts = {engine.tokenizer.decode(t) for t in tokens.values()}
    assert texts <= set(so["choice"]), texts
