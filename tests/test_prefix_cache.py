"""Prefix caching against HF transformers: with cache hits, the logits at every computed position still
equal HF's on the whole sequence, and the hits are where the design says they are. In float32, explicitly:
the reference and its tolerances are fp32's (dtype="auto" may mean bf16 on this CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import capture_logits, hf_logits

from inflight import SamplingParams
from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine

BS = 8  # small blocks: boundaries everywhere in short prompts


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 700) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class Run:
    """Steps an engine, adding requests at given steps; records tokens, cached counts and logits."""

    def __init__(self, demo_model_dir: str, **engine_args) -> None:
        args = dict(dtype="float32", block_size=BS, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
        args |= engine_args
        self.engine = LLMEngine(demo_model_dir, EngineConfig(**args))
        self.captured = capture_logits(self.engine)
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.step_no = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.prompts[rid] = prompt
        self.engine.add_request(rid, prompt, greedy(max_tokens))

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            self.cached[out.request_id] = out.num_cached_tokens
        self.step_no += 1

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def chunks(self, rid: str) -> list[list[int]]:
        return [pos for r, pos, _ in self.captured if r == rid]

    def check_against_hf(self, hf_model) -> None:
        assert not self.engine.has_unfinished_requests()
        refs = {rid: hf_logits(hf_model, p + self.outputs[rid]) for rid, p in self.prompts.items()}
        for rid, positions, logits in self.captured:
            torch.testing.assert_close(logits, refs[rid][positions], atol=2e-4, rtol=1e-4)
        bm = self.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not bm.ref_counts.any(), "blocks leaked"


def first_position(run: Run, rid: str) -> int:
    return run.chunks(rid)[0][0]


def test_same_prompt_twice(demo_model_dir, hf_model):
    run = Run(demo_model_dir)
    prompt = tokens(37, seed=1)
    run.add("a", prompt)
    run.drain()
    run.add("b", prompt)
    run.drain()
    assert run.cached == {"a": 0, "b": 32}  # 4 full blocks of 37 tokens
    assert first_position(run, "b") == 32  # the cached positions were not computed again
    assert run.outputs["a"] == run.outputs["b"]
    run.check_against_hf(hf_model)


def test_shared_system_prompt_different_suffixes(demo_model_dir, hf_model):
    run = Run(demo_model_dir)
    system = tokens(44, seed=2)
    run.add("first", system + tokens(9, seed=3))
    run.drain()
    for i, n in enumerate([1, 5, 12, 30]):
        run.add(f"s{i}", system + tokens(n, seed=10 + i), max_tokens=6)
    run.drain()
    assert [run.cached[f"s{i}"] for i in range(4)] == [40, 40, 40, 40]  # 5 full blocks of the 44 shared
    snap = run.engine.snapshot()
    assert snap.prefix_cache_hits == 160
    assert snap.prefix_cache_queries == sum(len(p) for p in run.prompts.values())
    run.check_against_hf(hf_model)


@pytest.mark.parametrize(
    "prefix_len, expected", [(32, 32), (33, 32), (31, 24)], ids=["on-boundary", "one-past", "one-short"]
)
def test_prefix_ending_on_and_around_a_block_boundary(demo_model_dir, hf_model, prefix_len, expected):
    run = Run(demo_model_dir)
    prefix = tokens(prefix_len, seed=4)
    run.add("owner", prefix)
    run.drain()
    run.add("reuser", prefix + tokens(7, seed=5))
    run.add("same", prefix)  # the whole prompt cached: capped at num_tokens - 1, the last block recomputed
    run.drain()
    assert run.cached["reuser"] == expected
    assert run.cached["same"] == (prefix_len - 1) // BS * BS
    run.check_against_hf(hf_model)


def test_hit_while_the_reusers_prefill_is_chunked(demo_model_dir, hf_model):
    run = Run(demo_model_dir, max_num_batched_tokens=10)
    system = tokens(40, seed=6)
    run.add("owner", system + tokens(3, seed=7))
    run.drain()
    run.add("reuser", system + tokens(33, seed=8), max_tokens=5)
    run.drain()
    assert run.cached["reuser"] == 40
    prefill = [c for c in run.chunks("reuser") if len(c) > 1]
    assert len(prefill) >= 3 and prefill[0][0] == 40  # chunks of the uncached rest, starting after the hit
    run.check_against_hf(hf_model)


def test_hit_on_blocks_whose_owner_is_still_running(demo_model_dir, hf_model):
    run = Run(demo_model_dir)
    system = tokens(26, seed=9)
    run.add("owner", system + tokens(2, seed=10), max_tokens=20)
    run.step()
    run.step()  # owner prefilled and decoding: its 3 full blocks are registered
    run.add("reuser", system + tokens(11, seed=11), max_tokens=4)
    run.step()
    owner_blocks = run.engine._seqs["owner"].block_table[:3]
    assert run.engine._seqs["reuser"].block_table[:3] == owner_blocks
    assert (run.engine.block_manager.ref_counts[owner_blocks] == 2).all()
    run.drain()
    assert run.cached["reuser"] == 24
    assert len(run.outputs["owner"]) == 20
    run.check_against_hf(hf_model)


def test_preempted_sequence_resumes_from_its_own_cached_blocks(demo_model_dir, hf_model):
    # 6 blocks for two sequences that each grow to 4: the newer one is preempted when the older needs a
    # block; its blocks are freed tail first, the older takes the (uncached) tail, the prefix survives.
    run = Run(demo_model_dir, num_kv_blocks=6, max_num_seqs=2)
    run.add("old", tokens(20, seed=12), max_tokens=10)
    run.add("new", tokens(20, seed=13), max_tokens=10)
    run.drain()
    seq_preemptions = run.engine.scheduler.num_preemptions
    assert seq_preemptions >= 1
    starts = [c[0] for c in run.chunks("new")]
    resumed = [p for p, prev in zip(starts[1:], run.chunks("new")) if p <= prev[-1]]
    assert resumed and all(p > 0 for p in resumed), f"resumed at {resumed}: own blocks not found"
    assert starts.count(0) == 1
    assert run.cached["new"] == 0  # what was cached at first admission; resuming is not a new query
    run.check_against_hf(hf_model)


def test_eviction_under_pressure_then_a_miss(demo_model_dir, hf_model):
    run = Run(demo_model_dir, num_kv_blocks=8)
    prompt = tokens(30, seed=14)
    run.add("a", prompt)
    run.drain()
    assert run.engine.block_manager.num_cached_blocks == 4  # 33 computed tokens (30 + 3 fed-back outputs)
    run.add("big", tokens(60, seed=15))  # needs 8 blocks: every cached block is evicted
    run.drain()
    run.add("again", prompt)
    run.drain()
    assert run.cached == {"a": 0, "big": 0, "again": 0}
    assert first_position(run, "again") == 0
    run.check_against_hf(hf_model)


def test_caching_off_never_hits_and_gives_the_same_tokens(demo_model_dir):
    system = tokens(40, seed=16)
    results = {}
    for caching in (True, False):
        run = Run(demo_model_dir, enable_prefix_caching=caching)
        run.add("a", system + [7])
        run.drain()
        for i in range(3):
            run.add(f"b{i}", system + tokens(5, seed=20 + i), max_tokens=8)
        run.drain()
        results[caching] = run.outputs
        assert sum(run.cached.values()) == (120 if caching else 0)
        assert (run.engine.block_manager.num_cached_blocks > 0) == caching
    assert results[True] == results[False]


def test_cli_flag_turns_caching_off_and_defaults_on():
    import argparse

    from inflight.launcher.cli import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args(parser.parse_args(["--no-enable-prefix-caching"])) == {"enable_prefix_caching": False}
    assert engine_args(parser.parse_args([])) == {}
    assert EngineConfig().enable_prefix_caching is True
