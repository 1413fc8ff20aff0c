"""The persistent input batch: rows added, removed, moved and grown by diff must give exactly the step
inputs that rebuilding everything from the sequences gives (the list-based prepare it replaced)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from helpers.scheduler import make_scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.config import EngineConfig
from inflight.engine.kv_cache import BlockManager
from inflight.engine.sequence import FinishReason, Sequence
from inflight.executor.input_batch import InputBatch
from inflight.executor.sampler import Sampler, SamplingMetadata
from inflight.sampling_params import SamplingParams

BLOCK = 4
MAX_LEN = 64
_ids = itertools.count()


def reference_prepare(seqs: list[Sequence], counts: list[int], block_size: int) -> dict[str, np.ndarray]:
    """Every step tensor rebuilt from the sequences' Python lists (the runner's prepare before the batch)."""
    num_computed = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
    n = np.asarray(counts, dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    seq_lens = num_computed + n
    positions = np.concatenate([np.arange(c, c + k) for c, k in zip(num_computed, n)]).astype(np.int64)
    input_ids = [
        t for s, c, k in zip(seqs, num_computed, n) for t in (s.prompt_token_ids + s.output_token_ids)[c : c + k]
    ]
    tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int32)
    for row, s in zip(tables, seqs):
        row[: len(s.block_table)] = s.block_table
    token_rows = np.repeat(np.arange(len(seqs)), n)
    slots = tables[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return {
        "input_ids": np.array(input_ids, dtype=np.int64),
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": qsl.astype(np.int32),
        "seq_lens": seq_lens.astype(np.int32),
        "block_tables": tables,
        "query_start_loc_np": qsl,
        "seq_lens_np": seq_lens,
        "sample_rows": np.nonzero(seq_lens == np.array([s.num_tokens for s in seqs]))[0],
    }


def assert_matches_reference(batch: InputBatch, seqs: list[Sequence], counts: list[int]) -> np.ndarray:
    """Prepare the step through the batch and compare every tensor (values, dtypes, shapes) with the
    reference; then the sampled rows' SamplingMetadata with the one read from the sequences."""
    got = batch.prepare(seqs, counts)
    want = reference_prepare(seqs, counts, batch.block_size)
    meta = got.attn_metadata
    have = {
        "input_ids": got.input_ids,
        "positions": got.positions,
        "slot_mapping": meta.slot_mapping,
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "block_tables": meta.block_tables,
    }
    for name, tensor in have.items():
        assert tensor.dtype == torch.from_numpy(want[name]).dtype, name
        assert np.array_equal(tensor.numpy(), want[name]), name
    for name, array in (("query_start_loc_np", meta.query_start_loc_np), ("seq_lens_np", meta.seq_lens_np)):
        assert array.dtype == want[name].dtype and np.array_equal(array, want[name]), name
    assert np.array_equal(got.sample_rows, want["sample_rows"])

    rows = got.sample_rows
    md, ref = batch.sampling_metadata(rows), SamplingMetadata.from_seqs([seqs[i] for i in rows])
    for name in (*SamplingMetadata.ROW_FIELDS, "output_lens", "num_prompt_tokens"):
        assert np.array_equal(getattr(md, name), getattr(ref, name)), name
    idx = np.arange(len(rows))
    zeros = np.zeros(len(rows), dtype=np.int64)
    lens = md.num_prompt_tokens + md.output_lens
    assert np.array_equal(md.token_ids_of(idx, zeros, lens), ref.token_ids_of(idx, zeros, lens))
    return rows


def make_seq(prompt: list[int], params: SamplingParams | None = None, rid: str | None = None) -> Sequence:
    i = next(_ids)
    return Sequence(rid or f"s{i}", list(prompt), params or SamplingParams(), seed=i, arrival_time=float(i))


def admit(seq: Sequence, blocks: list[int], computed: int = 0) -> Sequence:
    seq.block_table = list(blocks)
    seq.num_computed_tokens = computed
    return seq


def new_batch(max_num_seqs: int = 8) -> InputBatch:
    return InputBatch(max_num_seqs, MAX_LEN, 256, BLOCK, torch.device("cpu"))


def decode_step(seqs: list[Sequence], counts: list[int], token: int = 9) -> None:
    """What the engine does after a forward: advance, and sample where the chunk reached the end."""
    for s, n in zip(seqs, counts):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.output_token_ids.append(token + s.num_tokens)
        if len(s.block_table) * BLOCK < s.num_tokens:
            s.block_table.append(100 + next(_ids))


def to_decode(seqs: list[Sequence]) -> list[int]:
    return [s.num_tokens - s.num_computed_tokens for s in seqs]


def test_rows_follow_the_scheduled_order_through_adds_removals_and_reorders():
    a = admit(make_seq([1, 2, 3, 4, 5]), [7, 8])
    b = admit(make_seq([6, 7]), [3])
    c = admit(make_seq([8, 9, 10]), [11])
    batch = new_batch()
    seqs = [a, b, c]
    assert_matches_reference(batch, seqs, to_decode(seqs))
    decode_step(seqs, to_decode(seqs))
    slots = dict(zip([s.request_id for s in seqs], batch.token_slot[:3].tolist()))

    seqs = [a, c]  # b finished: c's row moves up one, row 2 must not keep c's (or b's) blocks
    assert_matches_reference(batch, seqs, to_decode(seqs))
    assert not batch.block_table.np[2:].any(), "rows past the batch hold stale block ids"
    assert batch.token_slot[1] == slots[c.request_id], "a moved row keeps its token slot"
    decode_step(seqs, to_decode(seqs))

    d = admit(make_seq([4, 4, 4, 4, 4, 4, 4]), [20, 21])  # joins; takes b's freed token slot
    seqs = [c, d, a]  # reordered, as a priority or a readmitted request reorders the running queue
    assert_matches_reference(batch, seqs, to_decode(seqs))
    assert batch.token_slot[1] == slots[b.request_id]
    decode_step(seqs, to_decode(seqs))
    assert_matches_reference(batch, seqs, to_decode(seqs))


def test_a_grown_block_table_appends_only_its_new_ids():
    a = admit(make_seq(list(range(1, 8))), [5, 6])
    batch = new_batch()
    assert_matches_reference(batch, [a], [7])
    decode_step([a], [7])
    a.block_table.append(9)  # the scheduler allocated one more block for the next token
    batch.block_table.np[0, 0] = 55  # a row rewritten from the table would overwrite this
    batch.prepare([a], [1])
    assert batch.block_table.np[0, :4].tolist() == [55, 6, 9, 0]
    assert batch.num_blocks_per_row[0] == 3


def test_a_request_whose_rows_move_after_a_removal_keeps_growing_correctly():
    seqs = [admit(make_seq([i + 1] * (3 + i)), [10 * i + j for j in range(2)]) for i in range(5)]
    batch = new_batch()
    for step in range(12):
        if step in (2, 5, 6):
            seqs.pop(1 if step != 6 else 0)  # every later row moves down
        if step == 8:
            seqs.append(admit(make_seq([3, 1, 4, 1, 5]), [90, 91]))
        counts = to_decode(seqs)
        assert_matches_reference(batch, seqs, counts)
        decode_step(seqs, counts)


@pytest.mark.parametrize(
    "seen", ["left-the-batch", "skipped-same-batch", "skipped-batch-changed"], ids=lambda s: f"runner-{s}"
)
def test_a_preempted_then_resumed_request_gets_its_new_blocks(seen):
    a = admit(make_seq(list(range(1, 10))), [1, 2, 3])
    b = admit(make_seq([5, 5, 5]), [4])
    batch = new_batch()
    seqs = [a, b]
    assert_matches_reference(batch, seqs, to_decode(seqs))
    decode_step(seqs, to_decode(seqs))
    # Preempted: blocks freed, computed tokens dropped, tokens kept. Resumed with a table of the same
    # length but other blocks, so comparing lengths alone would keep the stale ids. The runner may see
    # a step without it, or none at all (a step that scheduled nothing), while the rest of the batch
    # stays the same or changes.
    a.block_table, a.num_computed_tokens = [], 0
    a.num_preemptions += 1
    if seen == "left-the-batch":
        assert_matches_reference(batch, [b], to_decode([b]))
        decode_step([b], to_decode([b]))
    a.block_table = [30, 31, 32]
    seqs = [a] if seen == "skipped-batch-changed" else [a, b]
    assert_matches_reference(batch, seqs, to_decode(seqs))


def test_a_block_table_that_shrank_is_rewritten_not_trusted():
    # The scheduler only shrinks a table by freeing it (finish, preemption); the batch does not rely on it.
    a = admit(make_seq([1, 2, 3]), [1, 2, 3])
    b = admit(make_seq([4, 5, 6, 7, 8, 9, 10, 11, 12]), [4, 5, 6])
    batch = new_batch()
    assert_matches_reference(batch, [a, b], [3, 9])
    a.block_table = [7]
    assert_matches_reference(batch, [a, b], [3, 9])


def test_a_request_id_reused_by_a_new_request_gets_a_fresh_row():
    old = admit(make_seq([1, 2, 3, 4, 5, 6], rid="x"), [1, 2])
    batch = new_batch()
    assert_matches_reference(batch, [old], [6])
    new = admit(make_seq([7, 8, 9, 10, 11, 12], rid="x"), [3, 4])  # same id, same row, same lengths
    assert_matches_reference(batch, [new], [6])


def test_a_shrunk_output_list_is_rewritten_not_trusted():
    a = admit(make_seq([1, 2, 3]), [1, 2])
    a.output_token_ids = [4, 5, 6]
    a.num_computed_tokens = 5
    batch = new_batch()
    assert_matches_reference(batch, [a], [1])
    a.output_token_ids = [7]
    a.num_computed_tokens = 3
    assert_matches_reference(batch, [a], [1])


def test_the_batch_refuses_more_than_max_num_seqs_or_max_model_len():
    batch = new_batch(max_num_seqs=2)
    seqs = [admit(make_seq([1, 2]), [i]) for i in range(3)]
    assert_matches_reference(batch, seqs[:2], [2, 2])
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        batch.prepare(seqs, [2, 2, 2])
    long = admit(make_seq([1] * (MAX_LEN + 1)), list(range(MAX_LEN // BLOCK + 1)))
    with pytest.raises(ValueError, match=f"max_model_len={MAX_LEN}"):
        batch.prepare([long], [MAX_LEN + 1])


def test_sampler_gives_the_same_tokens_from_the_batch_as_from_the_sequences():
    rng = random.Random(3)
    vocab = 50
    seqs = []
    for i in range(6):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([0, 3, 20]),
            top_p=rng.choice([1.0, 0.8]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.4]),
            presence_penalty=rng.choice([0.0, 0.6]),
            frequency_penalty=rng.choice([0.0, 0.3]),
            min_tokens=rng.choice([0, 4]),
            logprobs=rng.choice([None, 2]),
        )
        seq = admit(make_seq([rng.randrange(vocab) for _ in range(5 + i)], params), [i * 8 + j for j in range(8)])
        seq.output_token_ids = [rng.randrange(vocab) for _ in range(i)]
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    batch = new_batch()
    sampler = Sampler(vocab, [2])
    for _ in range(5):
        rows = assert_matches_reference(batch, seqs, [1] * len(seqs))
        assert rows.tolist() == list(range(len(seqs)))
        logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        got = sampler(logits, seqs, metadata=batch.sampling_metadata(rows))
        want = sampler(logits, seqs)
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.top_ids, want.top_ids)
        for s, t in zip(seqs, got.token_ids.tolist()):
            s.num_computed_tokens += 1
            s.output_token_ids.append(t)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 2), st.sampled_from([None, 1, 2])),
        min_size=2,
        max_size=12,
    ),
    max_num_seqs=st.integers(2, 6),
    budget=st.integers(1, 48),
    num_blocks=st.integers(8, 14),  # 64 to 112 tokens for up to 6 running requests of up to 60: preemption
    policy=st.sampled_from(["continuous", "static"]),
    reservation=st.sampled_from(["paged", "max_length"]),
    caching=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_randomized_schedules_give_the_reference_inputs(
    requests, max_num_seqs, budget, num_blocks, policy, reservation, caching, seed
):
    """The real scheduler and block manager (chunked prefill, preemption, prefix hits, aborts, late
    arrivals, priorities); the runner sometimes skips a step, so the batch may miss a whole preemption."""
    rng = random.Random(seed)
    block_size = 8  # the engine's smallest
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        scheduling_policy=policy,
        kv_reservation=reservation,
        enable_prefix_caching=caching,
        device="cpu",
    )
    sched = make_scheduler(cfg, BlockManager(num_blocks, block_size, caching), MAX_LEN)
    batch = InputBatch(max_num_seqs, MAX_LEN, budget, block_size, torch.device("cpu"))
    if reservation == "max_length" and num_blocks * block_size < MAX_LEN:
        return  # the engine refuses this configuration
    arrivals: dict[int, list[Sequence]] = {}
    for prompt_len, max_tokens, priority, family in requests:
        prompt = [family or rng.randrange(3, 500) for _ in range(prompt_len)]  # families share prefixes
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=rng.choice([0.0, 0.8]),
            top_k=rng.choice([0, 5]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            logprobs=rng.choice([None, 1]),
        )
        seq = Sequence(f"r{next(_ids)}", prompt, params, rng.randrange(2**63), float(next(_ids)), priority)
        if prompt_len + max_tokens > num_blocks * block_size:
            continue  # the engine refuses a request the whole cache cannot hold
        arrivals.setdefault(rng.randrange(6), []).append(seq)
    step = 0
    live: list[Sequence] = []
    while sched.has_unfinished() or any(k >= step for k in arrivals):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
            live.append(seq)
        out = sched.schedule()
        if out.seqs and rng.random() < 0.85:
            assert_matches_reference(batch, out.seqs, out.num_scheduled_tokens)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += n
            sched.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(rng.randrange(3, 500))
                if len(seq.output_token_ids) >= seq.sampling_params.max_tokens:
                    sched.finish(seq, FinishReason.LENGTH)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if not victim.is_finished:
                sched.finish(victim, FinishReason.ABORT)
        step += 1
        assert step < 2000, "the schedule did not drain"
