"""CUDA graphs (executor/cuda_graphs.py): decode steps replayed whole and other steps in pieces around
attention, against eager launches, on a GPU only.

On a machine without one only the size rule and the decode-only predicate run; the rest runs on a lent GPU
(scripts/gpu_check.sh).
The HF-reference tests (tests/test_engine_reference.py) also run through the graphs there, since the
engine uses them by default on CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROMPTS, capture_logits

from inflight import LLM, SamplingParams
from inflight.executor.attention import AttentionMetadata
from inflight.executor.cuda_graphs import capture_sizes, is_decode_only, piecewise_sizes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    for limit in (1, 3, 20, 64, 100):
        sizes = capture_sizes(limit)
        assert sizes[-1] == limit and all(any(s >= b for s in sizes) for b in range(1, limit + 1))


def test_piecewise_sizes_cover_every_step_up_to_512_tokens():
    assert piecewise_sizes(2048) == [8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512]
    assert piecewise_sizes(100) == [8, 16, 24, 32, 48, 64, 96, 100]
    assert piecewise_sizes(5) == [5]
    for limit in (1, 5, 40, 100, 512, 8192):
        sizes = piecewise_sizes(limit)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(limit, 512)
        assert all(any(s >= t for s in sizes) for t in range(1, min(limit, 512) + 1))


def _meta(query_start_loc: list[int]) -> AttentionMetadata:
    qsl = np.array(query_start_loc)
    empty = torch.empty(0)
    return AttentionMetadata(empty, empty, empty, empty, qsl, np.full(len(qsl) - 1, 9))


def test_only_one_token_per_sequence_is_decode_only():
    assert is_decode_only(torch.zeros(3), _meta([0, 1, 2, 3]))
    assert not is_decode_only(torch.zeros(3), _meta([0, 0, 2, 3]))  # 3 tokens, 3 sequences, one with none
    assert not is_decode_only(torch.zeros(4), _meta([0, 1, 2, 4]))  # a 2-token chunk


def _generate(model_dir: str, enforce_eager: bool, prompts: list[str], max_tokens: list[int], **engine_args):
    engine_args = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "num_kv_blocks": 512} | engine_args
    llm = LLM(model_dir, dtype="float32", device="cuda", enforce_eager=enforce_eager, max_model_len=2048, **engine_args)
    captured = capture_logits(llm.engine)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [list(o.token_ids) for o in outs], captured


@gpu
def test_replayed_decode_steps_match_eager_ones(demo_model_dir):
    # Requests of different lengths finish at different steps, so the decode batch shrinks through
    # several padded sizes (rows a larger batch used become pads again); one prompt of ~1100 tokens
    # makes the small late batches split the KV (a second graph key for the same size).
    long_prompt = " ".join(PROMPTS) * 12
    prompts = [*PROMPTS[:6], long_prompt]
    max_tokens = [3, 9, 17, 5, 24, 12, 30]
    eager, eager_ids, eager_logits = _generate(demo_model_dir, True, prompts, max_tokens)
    graphs, graph_ids, graph_logits = _generate(demo_model_dir, False, prompts, max_tokens)

    assert eager.engine.runner.cuda_graphs is None
    runner = graphs.engine.runner.cuda_graphs
    assert {(size, 1) for size in capture_sizes(8)} <= set(runner.graphs)  # captured at startup
    assert len({size for size, _ in runner.replays}) >= 3, runner.replays
    assert any(splits > 1 for _, splits in runner.replays), "the long prompt meant to split the KV"
    assert graph_ids == eager_ids
    assert [len(ids) for ids in graph_ids] == max_tokens
    assert len(graph_logits) == len(eager_logits)
    for (_, pos_a, a), (_, pos_b, b) in zip(eager_logits, graph_logits):
        assert pos_a == pos_b
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert graphs.engine.block_manager.num_used_blocks == 0


@gpu
def test_piecewise_steps_match_eager_ones(demo_model_dir):
    # A budget of 40 tokens cuts the prompts into chunks that ride along with decode rows, and more prompts
    # than max_num_seqs are admitted as others finish: steps of many token counts replay the pieces (pad rows
    # included), while decode-only steps replay whole graphs.
    prompts = PROMPTS[:12]
    max_tokens = [3, 9, 17, 5, 24, 12, 30, 7, 2, 15, 6, 20]
    eager, eager_ids, eager_logits = _generate(demo_model_dir, True, prompts, max_tokens, max_num_batched_tokens=40)
    graphs, graph_ids, graph_logits = _generate(demo_model_dir, False, prompts, max_tokens, max_num_batched_tokens=40)

    assert eager.engine.runner.piecewise_graphs is None
    pieces = graphs.engine.runner.piecewise_graphs
    assert set(pieces.pieces) == set(piecewise_sizes(40))
    cfg = graphs.engine.model_config
    assert all(len(graphs_) == cfg.num_hidden_layers + 1 for graphs_, _, _ in pieces.pieces.values())
    assert len(pieces.replays) >= 3, pieces.replays
    assert graphs.engine.runner.cuda_graphs.replays, "decode-only steps still replay whole graphs"
    assert graph_ids == eager_ids
    assert [len(ids) for ids in graph_ids] == max_tokens
    assert len(graph_logits) == len(eager_logits)
    for (rid_a, pos_a, a), (rid_b, pos_b, b) in zip(eager_logits, graph_logits):
        assert (rid_a, pos_a) == (rid_b, pos_b)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert graphs.engine.block_manager.num_used_blocks == 0


@gpu
def test_verification_steps_replay_pieces_with_greedy_output_unchanged(demo_model_dir):
    prompt = [5, 9, 11, 7, 5, 9, 11, 7, 5, 9, 11, 7, 5, 9]  # something for prompt lookup to copy
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outputs = {}
    for spec in (None, ngram):
        llm = LLM(demo_model_dir, dtype="float32", device="cuda", num_kv_blocks=256, speculative_config=spec)
        if spec is not None:  # verification runs whatever the measured cost says: what is tested is where
            llm.engine.spec_decoder.step_cost.observe = lambda rows, seconds: None
        outputs[spec is None] = [o.token_ids for o in llm.generate([prompt, prompt[3:]], params, use_tqdm=False)]
        assert llm.engine.block_manager.num_used_blocks == 0
    assert outputs[False] == outputs[True]
    assert llm.engine.spec_decode_counters["spec_decode_num_drafts"] > 0
    assert llm.engine.runner.piecewise_graphs.replays
