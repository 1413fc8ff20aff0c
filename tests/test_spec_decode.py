"""Speculative decoding: the n-gram proposer, speculative_config, and exact verification through the engine
(greedy and seeded outputs token for token as speculation off, with each method; the sampled distribution; no
leaked block; suffix decoding's global cache across requests). The suffix proposer alone: test_spec_decode_suffix."""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.config import ConfigError, EngineConfig, SpeculativeConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.spec_decode.ngram import NgramProposer
from inflight.engine.spec_decode.suffix import SuffixProposer
from inflight.llm import LLM
from inflight.sampling_params import SamplingParams
from inflight.text.output_processor import RequestState, process_outputs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}


def suffix(**fields) -> dict:
    """A suffix speculative_config with these suffix_decoding_* fields."""
    return {"method": "suffix", **{f"suffix_decoding_{k}": v for k, v in fields.items()}}


# ---- the proposer --------------------------------------------------------------------------------------


def test_proposer_takes_the_most_recent_match_of_the_longest_ngram():
    p = NgramProposer(3, 1, 3)
    # [1, 2] occurs at 0 and at 4 (most recent: followed by 7, 1, 2); [9, 1, 2] does not occur earlier.
    assert p.propose("a", [1, 2, 5, 6, 1, 2, 7, 9, 1], [2], 10) == [7, 9, 1]
    # The longest n wins over a more recent shorter match: [3, 4] at 0 (-> 8), [4] alone later (-> 6).
    assert p.propose("b", [3, 4, 8, 4, 6, 3], [4], 10) == [8, 4, 6]


def test_proposer_respects_min_max_and_k():
    assert NgramProposer(3, 2, 3).propose("a", [5, 1, 2, 9, 5, 7], [1], 10) == []  # only a 1-gram matches
    assert NgramProposer(3, 1, 3).propose("a", [5, 1, 2, 9, 5, 7], [1], 10) == [2, 9, 5]
    assert NgramProposer(2, 1, 3).propose("a", [5, 1, 2, 9, 5, 7], [1], 10) == [2, 9]
    assert NgramProposer(3, 1, 3).propose("a", [5, 1, 2, 9, 5, 7], [1], 1) == [2]  # max_tokens caps k
    assert NgramProposer(4, 1, 1).propose("a", [1, 2, 3], [1], 10) == [2, 3, 1]  # stops at the end
    assert NgramProposer(3, 1, 3).propose("a", [1, 2, 3], [4], 10) == []  # nothing to copy


def test_proposer_ignores_matches_across_token_boundaries_and_follows_appends():
    p = NgramProposer(3, 1, 1)
    assert p.propose("a", [256, 1, 0, 0, 0, 0, 1], [], 10) == [0, 0, 0]  # 256's bytes hold 1's pattern
    out = [7]
    assert p.propose("b", [7, 8, 9], out, 10) == [8, 9, 7]
    out += [8, 9, 3]
    assert p.propose("b", [7, 8, 9], out, 10) == []
    out.append(8)
    assert p.propose("b", [7, 8, 9], out, 10) == [9, 3, 8]


def test_proposer_64_sequences_cost_well_under_a_millisecond():
    import time

    rng = random.Random(0)
    p = NgramProposer(4, 2, 4)
    seqs = [[rng.randrange(1000) for _ in range(1000)] for _ in range(64)]
    for i, s in enumerate(seqs):
        p.propose(i, s, [], 4)
    best = float("inf")
    for _ in range(20):
        for s in seqs:
            s.append(rng.randrange(1000))
        t0 = time.perf_counter()
        for i, s in enumerate(seqs):
            p.propose(i, s, [], 4)
        best = min(best, time.perf_counter() - t0)
    assert best < 2e-3  # ~0.2 ms on a quiet machine; generous for a shared CI core


# ---- configuration ---------------------------------------------------------------------------------------


def test_speculative_config_parses_and_defaults():
    assert EngineConfig().speculative_config is None
    assert EngineConfig(speculative_config="").speculative_config is None
    cfg = EngineConfig(speculative_config=json.dumps(NGRAM)).speculative_config
    assert isinstance(cfg, SpeculativeConfig)
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 3, 1)
    only_max = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (only_max.method, only_max.prompt_lookup_min, only_max.prompt_lookup_max) == ("ngram", 4, 4)
    neither = SpeculativeConfig.parse({"num_speculative_tokens": 2})
    assert (neither.prompt_lookup_min, neither.prompt_lookup_max) == (5, 5)
    assert neither.suffix_decoding_max_tree_depth is None


def test_suffix_config_takes_vllms_defaults(demo_model_dir):
    cfg = SpeculativeConfig.parse(json.dumps({"method": "suffix"}))
    assert cfg.num_speculative_tokens == 16  # vLLM: the tree depth (24); here capped at the longest draft
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (1.0, 0.1)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (None, None)
    cfg = SpeculativeConfig.parse(
        suffix(max_tree_depth=8, max_spec_factor=2, max_cached_requests=0) | {"num_speculative_tokens": 3}
    )
    assert (cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth) == (3, 8)
    assert SpeculativeConfig.parse(suffix(max_tree_depth=8)).num_speculative_tokens == 8
    proposer = LLMEngine(demo_model_dir, EngineConfig(dtype="float32", num_kv_blocks=16, speculative_config=cfg))
    proposer = proposer.spec_decoder.proposer
    assert isinstance(proposer, SuffixProposer) and proposer.global_index is None
    assert (proposer.k, proposer.depth, proposer.max_spec_factor) == (3, 8, 2)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method='eagle'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid: must be in [1, 16]"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens=99 is invalid: must be in [1, 16]"),
        ({"num_speculative_tokens": "4"}, "num_speculative_tokens='4' is invalid: must be an integer"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0 is invalid"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 65}, "prompt_lookup_max=65 is invalid"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4 is invalid: must be <= prompt_lookup_max=2",
        ),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size=0 is invalid"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) ['draft_model']"),
        (suffix() | {"num_speculative_tokens": 17}, "num_speculative_tokens=17 is invalid: must be in [1, 16]"),
        (suffix(max_tree_depth=0), "speculative_config.suffix_decoding_max_tree_depth=0 is invalid"),
        (suffix(max_tree_depth=65), "suffix_decoding_max_tree_depth=65 is invalid: must be in [1, 64]"),
        (suffix(max_tree_depth=2.5), "suffix_decoding_max_tree_depth=2.5 is invalid: must be an integer"),
        (suffix(max_cached_requests=-1), "suffix_decoding_max_cached_requests=-1 is invalid: must be in [0, "),
        (suffix(max_spec_factor=-0.5), "suffix_decoding_max_spec_factor=-0.5 is invalid: must be >= 0"),
        (suffix(max_spec_factor="2"), "suffix_decoding_max_spec_factor='2' is invalid: must be a number"),
        (suffix(min_token_prob=1.5), "suffix_decoding_min_token_prob=1.5 is invalid: must be in [0, 1]"),
        (suffix() | {"prompt_lookup_max": 3}, "prompt_lookup_max=3 is invalid: must be unset with method 'suffix'"),
        ({"num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.2}, "unset with method 'ngram'"),
    ],
)
def test_speculative_config_errors_name_field_and_limit(value, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=value)
    assert message in str(e.value)


def test_speculative_config_from_the_cli_and_config_pbtxt(monkeypatch):
    import sys
    import types

    from inflight.launcher.cli import add_engine_args, engine_args

    # triton_model imports pb_utils (only inside tritonserver): a stand-in, and the module forgotten afterwards.
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "inflight.serving.triton_model", raising=False)
    from inflight.serving.triton_model import ServerSettings

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineConfig(**engine_args(ns)).speculative_config.num_speculative_tokens == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 0}'])
    settings = ServerSettings.from_parameters({"model": "demo", "speculative_config": json.dumps(NGRAM)})
    assert settings.engine_config.speculative_config.prompt_lookup_max == 3
    off = ServerSettings.from_parameters({"model": "demo", "speculative_config": ""})
    assert off.engine_config.speculative_config is None
    text = json.dumps(suffix(min_token_prob=0.3))
    ns = parser.parse_args(["--speculative-config", text])
    assert EngineConfig(**engine_args(ns)).speculative_config.suffix_decoding_min_token_prob == 0.3
    settings = ServerSettings.from_parameters({"model": "demo", "speculative_config": text})
    assert settings.engine_config.speculative_config.suffix_decoding_min_token_prob == 0.3
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "suffix", "suffix_decoding_min_token_prob": 2}'])


# ---- verification through the engine -----------------------------------------------------------------------


class OracleProposer:
    """Drafts from a known continuation of each prompt, wrong at some positions (every `wrong_every`-th draft
    position is off by one): exercises full, partial and no acceptance, which the random demo model's own
    text rarely gives the n-gram proposer."""

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3) -> None:
        self.k, self.continuations, self.wrong_every = k, continuations, wrong_every

    def propose(self, key, prompt, output, max_tokens):
        cont = self.continuations.get(tuple(prompt), [])
        n = len(output)
        drafts = list(cont[n : n + min(self.k, max_tokens)])
        for j in range(len(drafts)):
            if (n + j) % self.wrong_every == self.wrong_every - 1:
                drafts[j] = (drafts[j] + 1) % 700
        return drafts

    def finish(self, key, output):
        pass


# bf16 greedy identity rests on the CPU's per-row ops (a verified token is the same bits as the decoded one).
# On a GPU a verification chunk runs the prefill tiles, which sum in another order than the decode kernels:
# in bf16 the tokens part ways (seen on an H200); fp32 holds there.
BF16_PER_ROW = pytest.param(
    "bfloat16",
    marks=pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 chunk and decode kernels differ in bits on a GPU"),
)


def unmeasured(step_cost) -> None:
    """No step time is measured: every proposed draft is verified. How many drafts pay is the policy's to
    decide from measured times (test_spec_decode_policy.py); what verification gives must not hang on them."""
    step_cost.observe = lambda rows, seconds: None


def run(demo_model_dir, prompts, params, spec=None, proposer=None, step_cost=unmeasured, **engine_args):
    """Every prompt to completion; (token ids per prompt, the engine). `step_cost(StepCost)` sets up the cost
    (None: measured as the engine goes)."""
    engine_args.setdefault("dtype", "float32")
    engine_args.setdefault("num_kv_blocks", 256)
    llm = LLM(demo_model_dir, speculative_config=spec, **engine_args)
    if proposer is not None:
        llm.engine.spec_decoder.proposer = proposer
    if step_cost is not None and llm.engine.spec_decoder is not None:
        step_cost(llm.engine.spec_decoder.step_cost)
    params = params if isinstance(params, list) else [params] * len(prompts)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no block leaked
    return [o.token_ids for o in outs], engine


def repetitive(n: int, period: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(3, 700) for _ in range(period)]
    return (motif * (n // period + 1))[:n]


def plain(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


PROMPTS = [repetitive(40, 7, 1), plain(23, 2), repetitive(70, 12, 3), plain(5, 4), repetitive(33, 3, 5)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["float32", BF16_PER_ROW])
def test_greedy_output_is_identical(demo_model_dir, dtype, method):
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    ref, _ = run(demo_model_dir, PROMPTS, params, dtype=dtype)
    for batch in (1, len(PROMPTS)):
        got = []
        for i in range(0, len(PROMPTS), batch):
            prompts = PROMPTS[i : i + batch]
            out, engine = run(demo_model_dir, prompts, params, METHODS[method], dtype=dtype)
            got += out
        assert got == ref
    c = engine.spec_decode_counters
    assert c["spec_decode_num_drafts"] > 0 and c["spec_decode_num_draft_tokens"] >= c["spec_decode_num_drafts"]
    assert c["spec_decode_num_accepted_tokens"] > 0  # the random model repeats itself now and then


@pytest.mark.parametrize("dtype", ["float32", BF16_PER_ROW])
def test_oracle_drafts_greedy_identical_and_accepted(demo_model_dir, dtype):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    ref, _ = run(demo_model_dir, PROMPTS, params, dtype=dtype)
    k = 5
    oracle = OracleProposer(k, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    spec = dict(NGRAM, num_speculative_tokens=k)
    got, engine = run(demo_model_dir, PROMPTS, params, spec, oracle, dtype=dtype)
    assert got == ref
    c = engine.spec_decode_counters
    assert c["spec_decode_num_accepted_tokens"] > c["spec_decode_num_drafts"]  # > 1 accepted a proposal
    per_pos = c["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == c["spec_decode_num_accepted_tokens"] and per_pos[0] > 0 and per_pos[1] > 0
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position i is accepted only after 0..i-1
    # Fewer steps than tokens: several tokens a step.
    assert engine.num_steps < sum(len(r) for r in ref)


def test_oracle_drafts_with_preemption_prefix_hits_and_a_small_budget(demo_model_dir):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[2][:50]]  # prefix cache hits
    small = {"num_kv_blocks": 14, "max_num_batched_tokens": 24}
    ref, ref_engine = run(demo_model_dir, prompts, params, **small)
    assert ref_engine.scheduler.num_preemptions > 0
    oracle = OracleProposer(6, {tuple(p): r for p, r in zip(prompts, ref)}, wrong_every=5)
    got, engine = run(demo_model_dir, prompts, params, dict(NGRAM, num_speculative_tokens=6), oracle, **small)
    assert got == ref
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache_hits > 0
    assert engine.spec_decode_counters["spec_decode_num_accepted_tokens"] > 0


def test_stops_hold_at_every_accepted_position(demo_model_dir):
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref, _ = run(demo_model_dir, PROMPTS, base)
    oracle = OracleProposer(8, {tuple(p): r for p, r in zip(PROMPTS, ref)}, wrong_every=100)
    spec = dict(NGRAM, num_speculative_tokens=8)
    stop_tok = ref[0][12]  # a token in the middle of an accepted run
    cases = [
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok], min_tokens=20),
    ]
    lens = []
    for params in cases:
        want, _ = run(demo_model_dir, PROMPTS, params)
        got, engine = run(demo_model_dir, PROMPTS, params, spec, oracle)
        assert got == want
        assert engine.spec_decode_counters["spec_decode_num_accepted_tokens"] > 0
        lens.append(len(want[0]))
    assert lens[0] == 13 and lens[1] == 13 and lens[2] >= 20  # cut inside an accepted run; min_tokens holds


def test_max_model_len_bounds_the_drafts(demo_model_dir):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[2][:34]
    ref, _ = run(demo_model_dir, [prompt], params, max_model_len=64)
    oracle = OracleProposer(8, {tuple(prompt): ref[0]}, wrong_every=100)
    got, engine = run(demo_model_dir, [prompt], params, dict(NGRAM, num_speculative_tokens=8), oracle, max_model_len=64)
    assert got == ref and len(got[0]) == 30
    assert engine.spec_decode_counters["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_identical_with_speculation(demo_model_dir):
    params = [
        SamplingParams(max_tokens=40, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True, **pen)
        for s, (t, k, p, pen) in enumerate(
            [
                (0.8, 0, 1.0, {}),
                (1.0, 5, 1.0, {"repetition_penalty": 1.3}),
                (0.5, 0, 0.9, {"frequency_penalty": 0.5, "presence_penalty": 0.3}),
                (1.2, 20, 0.95, {"min_p": 0.05}),
                (0.3, 0, 1.0, {"min_tokens": 10}),
            ]
        )
    ]
    ref, _ = run(demo_model_dir, PROMPTS, params)
    oracle = OracleProposer(4, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    got, engine = run(demo_model_dir, PROMPTS, params, NGRAM, oracle)
    assert got == ref
    assert engine.spec_decode_counters["spec_decode_num_accepted_tokens"] > 0
    # Batch invariance: one request alone gives what it gave in the batch.
    alone, _ = run(demo_model_dir, PROMPTS[1:2], params[1:2], NGRAM, oracle)
    assert alone[0] == ref[1]


def test_sampled_distribution_at_a_verified_position(demo_model_dir, hf_model):
    """Drafting the most likely token at output position 1, across 1500 seeds: the draft is accepted with its
    probability, and the token emitted there follows the sampler's distribution (temperature 1, top-k 4)."""
    prompt = plain(12, 7)
    top_k, n = 4, 1500
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=s, ignore_eos=True) for s in range(n)]
    with torch.no_grad():
        logits0 = hf_model(torch.tensor([prompt])).logits[0, -1]
    first = int(logits0.argmax())

    def dist_after(x0: int) -> torch.Tensor:
        with torch.no_grad():
            row = hf_model(torch.tensor([prompt + [x0]])).logits[0, -1].double()
        probs = torch.zeros_like(row)
        top = row.topk(top_k)
        probs[top.indices] = torch.softmax(top.values, 0)
        return probs

    probs = dist_after(first)
    draft = int(probs.argmax())

    class OneDraft:
        def propose(self, key, prompt_ids, output, max_tokens):
            return [draft] if output == [first] else []

        def finish(self, key, output):
            pass

    spec = dict(NGRAM, num_speculative_tokens=1, disable_by_batch_size=1 << 20)
    got, engine = run(demo_model_dir, [prompt] * n, params, spec, OneDraft(), max_num_seqs=256, num_kv_blocks=512)
    ref, _ = run(demo_model_dir, [prompt] * n, params, max_num_seqs=256, num_kv_blocks=512)
    assert got == ref  # coupled: each seed's tokens are those of speculation off
    second = torch.tensor([o[1] for o in got if o[0] == first])
    m = len(second)
    assert m > 200
    c = engine.spec_decode_counters
    assert c["spec_decode_num_drafts"] == m
    freq = torch.bincount(second, minlength=len(probs)).double() / m
    se = (probs * (1 - probs) / m).sqrt().clamp(min=1e-3)
    assert ((freq - probs).abs() <= 5 * se).all()
    p_accept = c["spec_decode_num_accepted_tokens"] / m
    assert abs(p_accept - float(probs[draft])) <= 5 * float(se[draft])


def test_no_speculation_for_logprobs_or_large_batches(demo_model_dir):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    ref, _ = run(demo_model_dir, PROMPTS, params)
    oracle = OracleProposer(4, {tuple(p): r for p, r in zip(PROMPTS, ref)})
    got, engine = run(demo_model_dir, PROMPTS, params, NGRAM, oracle)
    assert got == ref and engine.spec_decode_counters["spec_decode_num_drafts"] == 0
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 20, 20, 20, 20)]
    ref, _ = run(demo_model_dir, PROMPTS, greedy)
    spec = dict(NGRAM, disable_by_batch_size=len(PROMPTS) - 1)
    got, engine = run(demo_model_dir, PROMPTS, greedy, spec, oracle)
    assert got == ref
    drafts = engine.spec_decode_counters["spec_decode_num_drafts"]
    # None while all five run (the first 6 tokens), then some for the four left (at most 4 a step).
    assert 0 < drafts <= 4 * (20 - 6)


@pytest.mark.parametrize("row_cost", [None, 1 / 3])
def test_back_off_when_drafts_are_rejected(demo_model_dir, row_cost):
    """Step cost unknown: 8 rejected proposals, then a cooldown of 32 steps, then 8 more...; a row costing a third
    of a token: a draft stops paying after the first rejection. Either way far fewer drafts than steps. (The cost
    is set here: measured on a model this small, a draft row may cost less than the 0.1 acceptance that eight
    rejections leave a sequence with, and then drafting goes on, as the rule says.)"""
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    ref, _ = run(demo_model_dir, PROMPTS[:1], params)
    always_wrong = OracleProposer(4, {tuple(PROMPTS[0]): ref[0]}, wrong_every=1)

    def cost(step_cost):
        if row_cost is not None:  # one sequence: a row costs b / (a + b) of its step
            for rows in (1, 5, 3, 2, 4) * 3:
                step_cost.observe(rows, 0.004 + 0.002 * rows)
            assert step_cost.row_cost(1) == pytest.approx(row_cost)
        step_cost.observe = lambda rows, seconds: None

    got, engine = run(demo_model_dir, PROMPTS[:1], params, NGRAM, always_wrong, step_cost=cost)
    assert got == ref
    assert engine.spec_decode_counters["spec_decode_num_drafts"] <= 30


@settings(max_examples=8, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 10), st.integers(0, 10**6), st.integers(1, 40)),
        min_size=1,
        max_size=6,
    ),
    k=st.integers(1, 6),
    wrong_every=st.integers(1, 6),
    blocks=st.sampled_from([16, 24, 256]),
)
def test_generated_mix_greedy_identical(demo_model_dir, data, k, wrong_every, blocks):
    """Oracle drafts (full, partial and no acceptance), then each method's own, on a mix of prompts, batch
    sizes, preemptions (16 or 24 blocks) and prefix hits."""
    prompts = [repetitive(n, period, seed) for n, period, seed, _ in data]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for *_, m in data]
    eng = {"num_kv_blocks": blocks, "max_num_batched_tokens": 32}
    ref, _ = run(demo_model_dir, prompts, params, **eng)
    oracle = OracleProposer(k, {tuple(p): r for p, r in zip(prompts, ref)}, wrong_every=wrong_every)
    got, _ = run(demo_model_dir, prompts, params, dict(NGRAM, num_speculative_tokens=k), oracle, **eng)
    assert got == ref
    for spec in METHODS.values():  # the step cost measured as the engine goes: the policy's cuts hold too
        own, _ = run(demo_model_dir, prompts, params, dict(spec, num_speculative_tokens=k), step_cost=None, **eng)
        assert own == ref


def test_suffix_drafts_from_earlier_requests_outputs(demo_model_dir):
    """A request run twice: the second time its drafts come from the first one's output in the global cache
    (with max_cached_requests=0, none: it speculates exactly as the first time)."""
    prompt = plain(23, 2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref, _ = run(demo_model_dir, [prompt], params)
    accepted = {}
    for cached in (0, 10):
        spec = suffix(max_cached_requests=cached) | {"num_speculative_tokens": 4}
        llm = LLM(demo_model_dir, dtype="float32", num_kv_blocks=64, speculative_config=spec)
        # Where drafts come from, not whether they pay: on a GPU a verifying step runs eagerly while a decode step
        # replays its graph, and the measured step cost rightly stops the drafts (seen on an H100).
        llm.engine.spec_decoder.step_cost.observe = lambda rows, seconds: None
        counters = []
        for _ in range(2):
            assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == ref[0]
            counters.append(llm.engine.spec_decode_counters["spec_decode_num_accepted_tokens"])
        accepted[cached] = (counters[0], counters[1] - counters[0])
        blocks = llm.engine.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks
    assert accepted[0][0] == accepted[0][1] == accepted[10][0]
    assert accepted[10][1] >= accepted[10][0] + 20  # most of its 40 tokens came as accepted drafts


def test_suffix_keeps_an_aborted_requests_output(demo_model_dir):
    engine = LLMEngine(demo_model_dir, EngineConfig(dtype="float32", num_kv_blocks=64, speculative_config=SUFFIX))
    engine.add_request("a", plain(10, 3), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    tokens = []
    for _ in range(6):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    engine.abort_request("a")
    assert [out.finish_reason for out in engine.step()] == ["abort"]
    cached = engine.spec_decoder.proposer.global_index
    assert len(cached) == 1 and cached.seqs[0].tolist() == tokens and len(tokens) >= 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_snapshot_carries_the_counters(demo_model_dir):
    engine = LLMEngine(demo_model_dir, EngineConfig(dtype="float32", num_kv_blocks=64, speculative_config=NGRAM))
    snap = engine.snapshot()
    assert snap.spec_decode_num_drafts == 0 and snap.spec_decode_num_accepted_tokens_per_pos == (0, 0, 0, 0)
    import dataclasses

    import msgspec

    from inflight.engine import core_messages
    from inflight.engine.stats import IterationStats

    snap = dataclasses.replace(snap, spec_decode_num_drafts=3, spec_decode_num_accepted_tokens_per_pos=(2, 1, 0, 0))
    raw = msgspec.msgpack.Encoder().encode(core_messages.StepOutputs([], None, IterationStats.between(None, snap)))
    back = msgspec.msgpack.Decoder(core_messages.FromCore).decode(raw)
    assert back.iteration_stats.spec_decode_num_drafts == 3
    assert back.iteration_stats.spec_decode_num_accepted_tokens_per_pos == (2, 1, 0, 0)


def test_triton_metrics_export_the_counters(demo_model_dir):
    import dataclasses

    from inflight.serving.metrics import TritonMetrics

    class Metric:
        def __init__(self, labels):
            self.labels, self.value = labels, 0

        def increment(self, n):
            self.value += n

        def set(self, v):
            self.value = v

        def observe(self, v):
            pass

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
        families: dict = {}

        def __init__(self, name, description, kind):
            self.name, self.metrics = name, []
            MetricFamily.families[name] = self

        def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
            m = Metric(labels)
            self.metrics.append(m)
            return m

    pb = type("pb_utils", (), {"MetricFamily": MetricFamily})
    metrics = TritonMetrics(pb, {"model": "llm"})
    engine = LLMEngine(demo_model_dir, EngineConfig(dtype="float32", num_kv_blocks=64, speculative_config=NGRAM))
    snap = dataclasses.replace(
        engine.snapshot(),
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=4,
        spec_decode_num_accepted_tokens_per_pos=(3, 1, 0, 0),
    )
    from inflight.engine.stats import IterationStats, SchedulerStats

    metrics.update(SchedulerStats.of(snap), IterationStats.between(None, snap))
    metrics.update(SchedulerStats.of(snap), IterationStats.between(snap, snap))  # nothing new: nothing counted
    fam = MetricFamily.families
    assert fam["vllm:spec_decode_num_drafts_total"].metrics[0].value == 5
    assert fam["vllm:spec_decode_num_draft_tokens_total"].metrics[0].value == 12
    assert fam["vllm:spec_decode_num_accepted_tokens_total"].metrics[0].value == 4
    per_pos = fam["vllm:spec_decode_num_accepted_tokens_per_pos_total"].metrics
    assert [(m.labels["position"], m.value) for m in per_pos] == [("0", 3), ("1", 1), ("2", 0), ("3", 0)]


def _front_run(model_dir, prompts, params, spec, proposer):
    """As the served path: the engine's outputs of token ids (the core's) and the output processor over them
    (the front's), which aborts a request a stop string ended. Per prompt: (tokens, text, finish), and
    how many tokens the processor cut from outputs that carried tokens after a stop string."""
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", num_kv_blocks=256, speculative_config=spec))
    engine.spec_decoder.proposer = proposer
    states = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        states[str(i)] = RequestState(engine.tokenizer, prompt, params)
    results = {rid: ([], [], None) for rid in states}
    num_cut = 0
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if not states[o.request_id].stopped]
        processed = process_outputs([states[o.request_id] for o in outs], outs)
        for raw, out in zip(outs, processed.request_outputs):
            tokens, texts, _ = results[out.request_id]
            tokens += out.new_token_ids
            texts.append(out.new_text)
            results[out.request_id] = (tokens, texts, out.finish_reason if out.finished else None)
            num_cut += len(raw.new_token_ids) - len(out.new_token_ids)
        for rid in processed.reqs_to_abort:
            engine.abort_request(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [(t, "".join(x), f) for t, x, f in results.values()], num_cut


def test_stop_strings_cut_inside_an_accepted_run_in_the_engine_and_in_the_front(demo_model_dir):
    # Drafts accepted past the token that completes a stop string: the output processor cuts the output (text and
    # token ids) at that token, in the offline LLM and in the front.
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(demo_model_dir, dtype="float32", num_kv_blocks=256)
    ref = llm.generate(PROMPTS, base, use_tqdm=False)
    text = ref[0].text
    ends = [len(llm.tokenizer.decode(ref[0].token_ids[: i + 1])) for i in range(30)]
    stop = text[ends[10] - 2 : ends[12]]  # ends in token 12, in the middle of an accepted run
    assert stop.strip() and text.find(stop) == ends[10] - 2, text
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    want = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert want[0] == (ref[0].token_ids[:13], text[: ends[10] - 2], "stop")
    oracle = OracleProposer(8, {tuple(p): r.token_ids for p, r in zip(PROMPTS, ref)}, wrong_every=100)
    spec = dict(NGRAM, num_speculative_tokens=8)
    in_engine = LLM(demo_model_dir, dtype="float32", num_kv_blocks=256, speculative_config=spec)
    in_engine.engine.spec_decoder.proposer = oracle
    got = in_engine.generate(PROMPTS, params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == want
    assert in_engine.engine.spec_decode_counters["spec_decode_num_accepted_tokens"] > 0
    front, num_cut = _front_run(demo_model_dir, PROMPTS, params, spec, oracle)
    assert front == want
    assert num_cut > 0  # the core's output carried tokens after the stop string
