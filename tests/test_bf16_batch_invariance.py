"""Greedy identical across policies, in bf16 (dtype="auto" on a CPU with AVX512-BF16 or AMX).

The fp32 version is test_engine_reference.py's test_greedy_matches_hf_under_every_policy: there every
policy must give HF's tokens, which fp32's margins make robust. bf16 logits are quantized (8 mantissa
bits; on the demo model the top two logits tie exactly at over 1% of greedy steps), so one bf16 ulp
anywhere in the forward pass can flip a token. The guarantee therefore needs bit-identical logits for a
sequence whatever its batch: each run below must give the baseline's tokens *and* its logits, bit for
bit, at every position it computes.

Random-token prompts of 3-40 tokens, 32 greedy tokens each. Chunked prefill, preemption and prefix-cache
hits changed the greedy tokens of 2, 3 and 5 requests while prompts ran SDPA (whose rows depend on the
chunk); every token now takes the per-row attention op (csrc/cpu/paged_attention.cpp). The last test
covers the GEMM side (models/packed_linear.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from helpers import capture_logits

from inflight import LLM, SamplingParams

NUM_REQUESTS, MAX_TOKENS = 24, 32
BASE = dict(dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=256, block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def random_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 700) for _ in range(rng.randrange(3, 41))] for _ in range(NUM_REQUESTS)]


@dataclass
class Run:
    tokens: list[list[int]]  # greedy tokens per request
    logits: dict[tuple[int, int], list[torch.Tensor]]  # (request index, position) -> logits, each time computed
    llm: LLM

    def first_logits(self) -> dict[tuple[int, int], torch.Tensor]:
        return {key: rows[0] for key, rows in self.logits.items()}


def run(model_dir: str, llm: LLM | None = None, prompts: list[list[int]] | None = None, **engine_args) -> Run:
    llm = llm or LLM(model_dir, **(BASE | engine_args))
    assert llm.engine.dtype == torch.bfloat16
    captured = capture_logits(llm.engine)
    outs = llm.generate(prompts or random_prompts(), GREEDY, use_tqdm=False)
    index = {o.request_id: i for i, o in enumerate(outs)}
    logits: dict[tuple[int, int], list[torch.Tensor]] = {}
    for rid, positions, rows in captured:
        for position, row in zip(positions, rows):
            logits.setdefault((index[rid], position), []).append(row)
    return Run([o.token_ids for o in outs], logits, llm)


def assert_same(reference: Run, other: Run) -> None:
    """Same tokens, and bit-identical logits at every position `other` computed (each time it did)."""
    assert other.tokens == reference.tokens, [
        i for i, (a, b) in enumerate(zip(other.tokens, reference.tokens)) if a != b
    ]
    ref = reference.first_logits()
    assert set(other.logits) <= set(ref)
    differ = sorted(key for key, rows in other.logits.items() if any(not torch.equal(r, ref[key]) for r in rows))
    assert not differ, f"{len(differ)} of {len(other.logits)} (request, position) logits differ, first {differ[:5]}"


@pytest.fixture(scope="module")
def baseline(demo_model_dir) -> Run:
    result = run(demo_model_dir)
    assert all(len(rows) == 1 for rows in result.logits.values())  # continuous + paged: no chunk, no preemption
    return result


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(scheduling_policy="static"),
        dict(kv_reservation="max_length", max_model_len=96),
        dict(scheduling_policy="static", kv_reservation="max_length", max_model_len=96),
        dict(max_num_seqs=1),  # every request alone
        dict(max_num_seqs=5),  # other batches
        dict(max_num_batched_tokens=7),  # chunked prefill
        dict(max_num_batched_tokens=20, num_kv_blocks=42),  # preempted and recomputed
    ],
    ids=lambda args: "-".join(f"{k}={v}" for k, v in args.items()),
)
def test_bf16_greedy_and_logits_identical_across_policies(demo_model_dir, baseline, engine_args):
    result = run(demo_model_dir, **engine_args)
    if "num_kv_blocks" in engine_args:
        assert result.llm.engine.scheduler.num_preemptions > 0, "the case meant to force preemption"
    assert set(result.logits) == set(baseline.logits)  # prompt + output positions but the last: all computed
    assert_same(baseline, result)


def test_bf16_prefix_cache_hits_change_nothing(demo_model_dir):
    """4 system prompts of 200-300 tokens, 4 requests behind each: computed whole with caching off, then
    after each system prompt was cached by a request of its own (the hits skip the whole system prompt).
    Whole prompts, no chunking, no preemption: only the hits differ between the two runs."""
    rng = random.Random(1)
    systems = [[rng.randrange(5, 700) for _ in range(rng.randrange(200, 300))] for _ in range(4)]
    shared = [s + [rng.randrange(5, 700) for _ in range(rng.randrange(8, 41))] for s in systems for _ in range(4)]
    args = dict(max_num_batched_tokens=8192, num_kv_blocks=1024)
    cold = run(demo_model_dir, prompts=shared, enable_prefix_caching=False, **args)
    warm = LLM(demo_model_dir, **(BASE | args))
    warm.generate([s + [1] for s in systems], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = run(demo_model_dir, llm=warm, prompts=shared)
    for result in (cold, hit):
        assert result.llm.engine.scheduler.num_preemptions == 0
        assert all(len(rows) == 1 for rows in result.logits.values())
    first = {i: min(p for r, p in hit.logits if r == i) for i in range(len(shared))}
    assert all(first[i] == len(systems[i // 4]) // BASE["block_size"] * BASE["block_size"] for i in first)
    assert_same(cold, hit)


@pytest.fixture(scope="module")
def wide_mlp_model_dir(demo_model_dir, tmp_path_factory):
    """The demo checkpoint with a 1536-wide MLP: its down projection sums K = 1536 > 1024, where oneDNN's
    bf16 GEMM takes another summation order for a single row than for two or more."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from inflight.demo_model import build_weights

    out = tmp_path_factory.mktemp("wide_mlp")
    for f in Path(demo_model_dir).iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((Path(demo_model_dir) / "config.json").read_text()) | {"intermediate_size": 1536}
    save_file(build_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_bf16_a_request_alone_gets_its_logits_in_a_batch_too_with_a_wide_gemm(wide_mlp_model_dir):
    batched = run(wide_mlp_model_dir)
    alone = run(wide_mlp_model_dir, max_num_seqs=1)
    assert set(alone.logits) == set(batched.logits)
    assert_same(batched, alone)
