"""Speculative decoding's policy (spec_decode/decoder.py): how many drafts a sequence proposes and a step keeps,
from each draft position's measured acceptance and the engine's measured step times; the back-off. The
proposers and exact verification through the engine: test_spec_decode.py."""

from __future__ import annotations

import pytest

from inflight.config import SpeculativeConfig
from inflight.engine.spec_decode.decoder import (
    COOLDOWN_STEPS,
    MISS_LIMIT,
    MISS_REST,
    SMALL_BATCH,
    WINDOW,
    SpecDecoder,
    StepCost,
)
from inflight.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


class _FakeSeq:
    """What SpecDecoder.propose reads of a sequence: one still prefilling is skipped. Its tokens repeat, so the
    n-gram proposer drafts up to k."""

    def __init__(self, prefilling: bool = False) -> None:
        self.prompt_token_ids = [1, 2, 3, 1, 2, 3, 1, 2]
        self.output_token_ids = [3]
        self.num_tokens = 9
        self.num_computed_tokens = 0 if prefilling else 8
        self.spec_token_ids = None
        self.sampling_params = SamplingParams(max_tokens=100, temperature=0.0)


def _decoder(**fields) -> SpecDecoder:
    return SpecDecoder(SpeculativeConfig.parse(dict(NGRAM, **fields)), 256)


def test_back_off_bound_rises_with_the_batch():
    """Step cost unknown, drafts accepted at 30%: kept while a sequence runs alone (draft rows ride along with
    a memory-bound step), backed off once more than SMALL_BATCH run (they cost compute there)."""
    decoder = _decoder()
    for running, backs_off in ((1, False), (SMALL_BATCH + 4, True)):
        seq = _FakeSeq()
        decoder.propose([seq] + [_FakeSeq(prefilling=True) for _ in range(running - 1)])
        for _ in range(WINDOW):
            decoder.record(seq, 10, 3)  # 30% of the drafts accepted
        assert (decoder._state[seq].cooldown > 0) is backs_off, running


def test_step_cost_reads_the_cost_of_a_row_from_measured_steps():
    """A line through one point per row count: a steady batch's many steps of one size do not outweigh the few
    of other sizes, and one size alone gives no slope."""
    cost = StepCost()
    for rows in [8, 40, 8, 24, 8, 16, 32, 8, 12, 40] * cost.MIN_PER_ROWS + [8] * 50:
        cost.observe(rows, 0.006 + 0.0003 * rows)  # a weight-bound step plus compute per row
    a, b = cost.fit
    assert a == pytest.approx(0.006) and b == pytest.approx(0.0003)
    assert cost.row_cost(8) == pytest.approx(0.0024 / 0.0084)  # one more row, in tokens of a step of 8
    assert cost.row_cost(1) < cost.row_cost(8) < cost.row_cost(64)  # drafts pay most when alone
    flat = StepCost()
    for rows in [8] * 20 + [9, 9]:  # 9 rows seen twice: not yet a point
        flat.observe(rows, 0.01 if rows == 8 else 0.011)
    assert flat.fit is None and flat.row_cost(8) is None  # one row count: no slope to read
    assert flat.seconds(8) == pytest.approx(0.01) and flat.seconds(9) is None
    flat.observe(9, 0.011)
    assert flat.fit is not None and flat.seconds(10) == pytest.approx(0.012)  # two points: a line


def test_step_cost_keeps_each_row_counts_own_time():
    """A GEMM that takes another pass over its weights from 11 rows: the line through the steps cannot show
    the jump; the time measured at that row count does, once seen MIN_PER_ROWS times, as a median (one
    slow step does not move it). A row count not seen enough reads the line."""
    cost = StepCost()
    step = {8: 0.0080, 9: 0.0081, 10: 0.0082, 11: 0.0095, 12: 0.0096}
    for _ in range(4):
        for rows, seconds in step.items():
            cost.observe(rows, seconds)
    cost.observe(10, 0.05)  # a hiccup
    for rows, seconds in step.items():
        assert cost.seconds(rows) == pytest.approx(seconds)
    a, b = cost.fit
    assert cost.seconds(13) == pytest.approx(a + 13 * b)
    cost.observe(13, 0.0097)
    a, b = cost.fit
    assert cost.seconds(13) == pytest.approx(a + 13 * b)  # one step of 13 rows is not yet its own figure


def test_step_keeps_the_drafts_that_maximise_goodput():
    """Eight sequences each with drafts: under a step that costs little per row up to 10 rows and takes another
    pass from 11, the two likeliest drafts ride along and the rest are cut; under a flat cost every draft
    stays; with the step times unknown nothing is cut (else drafts would never be measured)."""
    decoder = _decoder()
    for _ in range(3):
        for rows, seconds in {8: 0.0080, 9: 0.0081, 10: 0.0082, 11: 0.0095, 12: 0.0096, 13: 0.0097}.items():
            decoder.observe_step(rows, seconds)
    seqs = [_FakeSeq() for _ in range(8)]
    chances = [[0.4, 0.1]] * 6 + [[0.6, 0.3], [0.5, 0.2]]
    for seq in seqs:
        seq.spec_token_ids = [7, 8]
    decoder.keep_for_goodput(8, list(zip(seqs, chances)))
    assert [len(s.spec_token_ids) for s in seqs] == [0] * 6 + [1, 1]  # 0.6 and 0.5: 8 + 1.1 tokens in 8.2 ms

    flat = _decoder()
    for _ in range(3):
        for rows in range(8, 25):
            flat.observe_step(rows, 0.008)
    for seq in seqs:
        seq.spec_token_ids = [7, 8]
    flat.keep_for_goodput(8, list(zip(seqs, chances)))
    assert [len(s.spec_token_ids) for s in seqs] == [2] * 8

    for steps in ([], [(8, 0.008)] * 3):  # nothing measured; only steps of 8 rows (no drafts yet)
        unknown = _decoder()
        for rows, seconds in steps:
            unknown.observe_step(rows, seconds)
        for seq in seqs:
            seq.spec_token_ids = [7, 8]
        unknown.keep_for_goodput(8, list(zip(seqs, chances)))
        assert [len(s.spec_token_ids) for s in seqs] == [2] * 8  # kept: a step with drafts gets measured


def test_draft_chances_follow_each_position():
    """A sequence whose first draft is always accepted and its second never (a free-text match: one right
    token) gets a high chance for the first and a low one for the second; one that copies gets high chances
    at every position. A fresh sequence starts from the engine's recent rate at the first position, and takes
    each later position to go on as the one before it (not as other sequences did)."""
    decoder = _decoder()
    one, copier = _FakeSeq(), _FakeSeq()
    decoder.propose([one, copier])
    for _ in range(WINDOW):
        decoder.record(one, 3, 1)
        decoder.record(copier, 4, 4)
    prior = decoder.prior()
    assert prior == pytest.approx(17 / 18)  # the first draft accepted in all 16 proposals: (16 + 1) / (16 + 2)
    first, second = decoder._state[one].chances(prior)[:2]
    assert first > 0.8 and second < 0.25
    assert min(decoder._state[copier].chances(prior)) > 0.7
    assert decoder.worth(decoder._state[one].chances(prior), 0.3) == 1
    assert decoder.worth(decoder._state[copier].chances(prior), 0.3) == 4
    fresh = _FakeSeq()
    decoder.propose([fresh])
    assert decoder._state[fresh].chances(prior) == pytest.approx([prior**j for j in range(1, 5)])


def test_draft_length_follows_acceptance_and_row_cost():
    """The j-th draft is proposed while its chance exceeds the row's cost: longer drafts for sequences that
    copy well and for small batches, none where even one does not pay (then the sequence rests)."""
    assert SpecDecoder.worth([0.68, 0.46, 0.31, 0.21], 0.25) == 3
    assert SpecDecoder.worth([0.32, 0.1, 0.03, 0.01], 0.25) == 1
    assert SpecDecoder.worth([0.2, 0.04, 0.01, 0.0], 0.25) == 0
    decoder = _decoder()
    good, fair = _FakeSeq(), _FakeSeq()
    running = [good, fair] + [_FakeSeq(prefilling=True) for _ in range(6)]
    decoder.propose(running)  # their state begins (the step cost not yet known)
    assert good.spec_token_ids and fair.spec_token_ids
    good.spec_token_ids = fair.spec_token_ids = None
    for rows in [8, 40, 8, 24, 8, 16, 32, 8, 12, 40] * 3:  # a row costs two thirds of a token at batch 8
        decoder.observe_step(rows, 0.002 + 0.0005 * rows)
    assert decoder.step_cost.row_cost(8) == pytest.approx(2 / 3)
    for i in range(8):
        decoder.record(good, 3, 3)  # every draft accepted
        decoder.record(fair, 1, i % 2)  # half: above the batch's acceptance floor, below what a row costs
    assert decoder._state[fair].cooldown == 0
    decoder.propose(running)
    assert decoder._state[fair].cooldown == COOLDOWN_STEPS and fair.spec_token_ids is None
    assert decoder._state[good].cooldown == 0 and good.spec_token_ids  # the proposer's drafts, up to the limit


def test_acceptance_floor_rests_a_batched_sequence_whatever_the_cost():
    """In a batch above SMALL_BATCH a sequence whose drafts are accepted under BATCHED_MIN_ACCEPTANCE rests, even
    where the measured step cost says a row is cheap: a draft shortens its request, not a batch that ends
    together."""
    decoder = _decoder()
    for rows in [8, 9, 10, 12] * 3:  # rows nearly free
        decoder.observe_step(rows, 0.008 + 0.00001 * rows)
    seq = _FakeSeq()
    decoder.propose([seq] + [_FakeSeq(prefilling=True) for _ in range(SMALL_BATCH + 3)])
    for i in range(WINDOW):
        decoder.record(seq, 1, int(i % 3 == 0))  # 3 of 8
    assert decoder._state[seq].cooldown == COOLDOWN_STEPS


def test_a_batched_sequence_with_nothing_to_copy_looks_less_often():
    """In a batch, MISS_LIMIT lookups in a row that find nothing: the sequence skips the proposer for MISS_REST
    steps, then looks again (and rests again while it still finds nothing); a draft found ends it. Alone, it
    looks every step (a lookup costs little beside a step of one)."""
    decoder = _decoder()
    calls = []
    proposer = decoder.proposer
    original = proposer.propose
    proposer.propose = lambda *args: calls.append(args[0]) or original(*args)
    for running, rests in ((1, False), (SMALL_BATCH + 4, True)):
        seq = _FakeSeq()
        seq.prompt_token_ids, seq.output_token_ids = list(range(10, 18)), [99]  # no n-gram repeats
        batch = [seq] + [_FakeSeq(prefilling=True) for _ in range(running - 1)]
        calls.clear()
        for _ in range(MISS_LIMIT + 2 * (MISS_REST + 1)):
            decoder.propose(batch)
            assert not seq.spec_token_ids
        assert len(calls) == (MISS_LIMIT + 2 if rests else MISS_LIMIT + 2 * (MISS_REST + 1)), running
    seq.prompt_token_ids, seq.output_token_ids = [1, 2, 3, 1, 2], [3]  # something to copy: found at the next look
    for _ in range(MISS_REST + 1):
        decoder.propose(batch)
    assert seq.spec_token_ids and decoder._state[seq].misses == 0 and decoder._state[seq].cooldown == 0
