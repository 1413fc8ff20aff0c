"""Sampler: greedy, seeded batch-invariant sampling, the allowed sets of top-k/top-p/min-p, the sampled
distribution, penalties against a plain reference, min_tokens and logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inflight.engine.sequence import Sequence
from inflight.executor.sampler import Sampler
from inflight.sampling_params import SamplingParams

EOS = 2


def seq(
    params: SamplingParams, seed: int = 0, output: list[int] | None = None, prompt: list[int] | None = None
) -> Sequence:
    prompt = [5, 6, 7] if prompt is None else prompt
    return Sequence("r", list(prompt), params, seed, 0.0, output_token_ids=list(output or []))


def sample(logits: torch.Tensor, seqs: list[Sequence], vocab: int | None = None):
    return Sampler(vocab or logits.shape[1], [EOS])(logits, seqs)


def seeded_batch(row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """The same logits row sampled with seeds 0..n-1 in one batch."""
    out = sample(row.expand(n, -1).contiguous(), [seq(params, seed=s) for s in range(n)])
    return out.token_ids.tolist()


def reference_allowed(row: torch.Tensor, p: SamplingParams, slack: float) -> set[int]:
    """top_k, then top_p on the renormalized top-k set, then min_p, in float64; `slack` widens top_p.

    Logits are scaled by the temperature in float32, as the sampler does: values that differ only below
    float32's resolution (a denormal beside 0.0) tie there, and ties at the cut stay in."""
    scaled = (row.float() / p.temperature).double()
    order = torch.argsort(scaled, descending=True).tolist()
    vals = scaled[order]
    n = len(order)
    if 0 < p.top_k < n:
        n = int((vals >= vals[p.top_k - 1]).sum())  # ties at the k-th value stay in
    probs = torch.softmax(vals[:n], 0)
    if p.top_p < 1:
        before = torch.cumsum(probs, 0) - probs
        last = int((before < p.top_p + slack).sum()) - 1
        n = int((vals[:n] >= vals[last]).sum())
    keep = {order[i] for i in range(n)}
    if p.min_p > 0:
        keep = {t for t in keep if scaled[t] >= vals[0] + math.log(p.min_p) - slack}
    return keep


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    seqs = [seq(SamplingParams(temperature=0.0, top_k=5), seed=i) for i in range(16)]
    assert sample(logits, seqs).token_ids.tolist() == logits.argmax(-1).tolist()


def test_all_sampled_rows_return_int64_on_the_logits_device():
    out = sample(torch.randn(3, 50), [seq(SamplingParams(), seed=i) for i in range(3)])
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (3,)
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


TARGETS = [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.02),
    SamplingParams(temperature=0.8, top_k=500, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
]


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: repr(p)[15:70])
def test_token_depends_only_on_row_params_seed_and_step(target):
    gen = torch.Generator().manual_seed(1)
    vocab = 2000
    others_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.0, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[7]),
        SamplingParams(temperature=2.0, logprobs=3),
    ]
    rng = random.Random(2)
    others = [
        seq(others_params[i % len(others_params)], seed=rng.randrange(2**63), output=[1, 2, 3][: i % 4])
        for i in range(32)
    ]
    for step in range(6):
        row = torch.randn(1, vocab, generator=gen) * 3
        target_seq = seq(target, seed=12345, output=list(range(10, 10 + step)), prompt=[10, 11, 12, 13])
        alone = sample(row, [target_seq]).token_ids.item()
        for pos in (0, 17, 32):
            batch = others[:pos] + [target_seq] + others[pos:]
            logits = torch.randn(33, vocab, generator=gen) * 3
            logits[pos] = row[0]
            assert sample(logits, batch).token_ids[pos].item() == alone


def test_a_window_and_the_whole_vocabulary_give_a_token_the_same_noise():
    # top_k = V - 1 over a row whose last token can never win allows what the plain row allows: the windowed
    # path (the best ids sorted, their noise gathered) and the one-pass path over the whole vocabulary must
    # pick the same token for every seed (on a CPU they are two implementations of one noise).
    vocab = 300
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2
    row[0, -1] = -1e4
    for s in range(40):
        plain = sample(row, [seq(SamplingParams(temperature=1.0), seed=s)]).token_ids.item()
        windowed = sample(row, [seq(SamplingParams(temperature=1.0, top_k=vocab - 1), seed=s)]).token_ids.item()
        assert plain == windowed


def test_seeds_and_steps_give_different_streams():
    row = torch.zeros(1, 1000)  # uniform: the token is decided by the noise alone
    p = SamplingParams(temperature=1.0)
    by_seed = [sample(row, [seq(p, seed=s)]).token_ids.item() for s in range(50)]
    assert len(set(by_seed)) > 40
    high_bits = [sample(row, [seq(p, seed=s << 40)]).token_ids.item() for s in range(1, 21)]
    assert len(set(high_bits)) > 15
    by_step = [sample(row, [seq(p, seed=7, output=[0] * k)]).token_ids.item() for k in range(50)]
    assert len(set(by_step)) > 40
    for a, b in [(5, 5 + 2**32), (5, 6), (2**62, 2**62 + 1)]:  # halves of the seed, neighbours
        streams = [[sample(row, [seq(p, seed=s, output=[0] * k)]).token_ids.item() for k in range(40)] for s in (a, b)]
        assert sum(x == y for x, y in zip(*streams)) < 4
        assert len(set(streams[0]) & set(streams[1])) < 10  # not the same tokens in another order either


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3)) * 2
    seqs = [seq(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(64)]
    assert sample(logits, seqs).token_ids.tolist() == logits.argmax(-1).tolist()


@settings(max_examples=60, deadline=None)
@example(logits=[0.0, 1.0, 1.4e-45], temperature=2.0, top_k=0, top_p=0.5, min_p=0.0)  # a tie only in float32
@given(
    logits=st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=40),
    temperature=st.floats(0.2, 3.0),
    top_k=st.sampled_from([0, -1, 1, 2, 3, 5, 20]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-3]),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
)
def test_sampled_tokens_stay_in_the_allowed_set(logits, temperature, top_k, top_p, min_p):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    row = torch.tensor(logits)
    allowed = reference_allowed(row, p, slack=1e-4)
    assert set(seeded_batch(row[None], p, 400)) <= allowed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.9),  # nucleus far wider than the first window
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=3000, top_p=0.95),
    ],
)
def test_allowed_set_on_a_flat_large_vocab(params):
    row = torch.randn(1, 8192, generator=torch.Generator().manual_seed(4)) * 0.3
    row[0, :10] += 1.0
    row[0, 100:120] = row[0, 100]  # a run of ties
    allowed = reference_allowed(row[0], params, slack=1e-4)
    tokens = seeded_batch(row, params, 600)
    assert set(tokens) <= allowed
    assert len(set(tokens)) > 100  # it really samples from the wide set, not just its head


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def assert_matches(tokens: list[int], probs: torch.Tensor) -> None:
    """Every token's frequency within 5 standard errors of its probability."""
    freq = frequencies(tokens, len(probs))
    se = (probs * (1 - probs) / len(tokens)).sqrt().clamp(min=1e-3)
    assert ((freq - probs).abs() <= 5 * se).all(), (freq, probs)


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (SamplingParams(temperature=0.7), 8),
        (SamplingParams(temperature=1.5), 8),
        (SamplingParams(temperature=1.0, top_k=3), 3),
        (SamplingParams(temperature=1.0, top_p=0.75), None),
    ],
)
def test_empirical_distribution_matches_softmax(params, keep):
    row = torch.tensor([2.0, 1.5, 1.0, 0.2, 0.0, -0.5, -1.0, -3.0])
    probs = torch.softmax(row.double() / params.temperature, 0)
    if keep is None:  # top_p 0.75 keeps the head whose preceding mass is below 0.75
        keep = int(((torch.cumsum(probs, 0) - probs) < params.top_p).sum())
    probs[keep:] = 0
    probs /= probs.sum()
    assert_matches(seeded_batch(row[None], params, 20000), probs)


def test_one_seeds_stream_over_steps_matches_softmax():
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])
    s = seq(SamplingParams(temperature=1.0), seed=99)
    sampler = Sampler(6, [EOS])
    for _ in range(4000):
        s.output_token_ids.append(sampler(row, [s]).token_ids.item())
    assert_matches(s.output_token_ids, torch.softmax(row[0].double(), 0))


def reference_penalties(row: torch.Tensor, s: Sequence) -> torch.Tensor:
    p = s.sampling_params
    out = row.clone()
    for t in set(s.prompt_token_ids) | set(s.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        out[t] -= p.frequency_penalty * s.output_token_ids.count(t) + p.presence_penalty
    return out


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(4, 30),
    rows=st.integers(1, 4),
)
def test_penalties_match_reference(data, vocab, rows):
    seqs, expected = [], []
    logits = torch.tensor(data.draw(st.lists(st.floats(-5, 5), min_size=vocab * rows, max_size=vocab * rows)))
    logits = logits.view(rows, vocab).float()
    for i in range(rows):
        params = SamplingParams(
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.8, 1.3, 2.0])),
            presence_penalty=data.draw(st.sampled_from([0.0, 0.5, -1.0])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.3, -0.7])),
        )
        ids = st.lists(st.integers(0, vocab - 1), max_size=12)
        s = seq(params, prompt=data.draw(ids), output=data.draw(ids))
        seqs.append(s)
        expected.append(reference_penalties(logits[i], s))
    before = logits.clone()
    got = Sampler(vocab, [EOS]).penalize(logits, seqs)
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)
    assert torch.equal(logits, before)  # the caller's logits are not touched


def test_penalties_follow_a_growing_output_across_steps():
    sampler = Sampler(40, [EOS])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    s = seq(params, prompt=[1, 2, 3])
    rng = random.Random(6)
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(6))
    for step in range(60):
        if step == 40:
            s.output_token_ids = [39 - t for t in s.output_token_ids[:10]]  # a shorter list: not trusted
        got = sampler.penalize(logits, [s])[0]
        assert torch.allclose(got, reference_penalties(logits[0], s), atol=1e-5)
        s.output_token_ids += [rng.randrange(40) for _ in range(rng.choice([1, 1, 1, 3]))]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 20)
    logits[0, EOS], logits[0, 9], logits[0, 4] = 30.0, 29.0, 28.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[9]),
    ]
    for p in params:
        for n_out in range(3):
            assert sample(logits, [seq(p, seed=n_out, output=[0] * n_out)]).token_ids.item() == 4
    assert sample(logits, [seq(params[0], output=[0] * 3)]).token_ids.item() == EOS
    ignore = SamplingParams(temperature=0.0, ignore_eos=True)
    assert sample(logits, [seq(ignore)]).token_ids.item() == EOS  # ignore_eos only stops stopping


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(2, 64)
    logits[:, 50:] = 100.0
    seqs = [seq(SamplingParams(temperature=0.0)), seq(SamplingParams(temperature=1.0, top_p=0.5))]
    assert (sample(logits, seqs, vocab=50).token_ids < 50).all()


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5)) * 3
    seqs = [
        seq(SamplingParams(temperature=0.0, logprobs=0)),
        seq(SamplingParams(temperature=1.0, logprobs=5, repetition_penalty=2.0), output=[1, 2, 3]),
        seq(SamplingParams(temperature=0.5, top_k=3)),
        seq(SamplingParams(temperature=1.0, logprobs=2, presence_penalty=1.5), output=[7]),
    ]
    out = sample(logits, seqs)
    raw = torch.log_softmax(logits, -1)
    expected = raw.gather(1, out.token_ids[:, None])[:, 0]
    assert torch.allclose(out.logprobs, expected, atol=1e-6)
    assert out.top_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    assert torch.allclose(out.top_logprobs, top.values)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


EXTREME_FLOATS = [5e-324, 1e-300, 1e-45, 1e-38, 1e-8]


@settings(max_examples=200, deadline=None)
@example(logits=[0.0, 1.0, -1.0], temperature=1.0, top_k=0, top_p=1e-300, min_p=0.0)  # 0 in float32
@given(
    logits=st.lists(st.floats(-1e4, 1e4, width=32), min_size=2, max_size=40),
    temperature=st.sampled_from([0.0, *EXTREME_FLOATS, 1.0, 1e4, 1e300]),
    top_k=st.sampled_from([0, -1, 1, 2, 10**9, 2**62]),
    top_p=st.sampled_from([*EXTREME_FLOATS, 0.5, 1.0 - 1e-16, 1.0]),
    min_p=st.sampled_from([0.0, *EXTREME_FLOATS, 0.5, 1.0]),
)
def test_extreme_sampling_values_always_give_a_token(logits, temperature, top_k, top_p, min_p):
    """Every value validation lets through samples a real token (one bad row used to fail the whole step)."""
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    row = torch.tensor(logits)
    others = [seq(SamplingParams(temperature=0.0), seed=1)]
    out = sample(torch.stack([row, row]), [seq(p, seed=s) for s in range(1)] + others).token_ids.tolist()
    assert 0 <= out[0] < len(logits)
    assert out[1] == int(row.argmax())  # the greedy neighbour is unaffected
    if temperature < 1e-5:  # greedy: logits / 1e-6 would overflow float32
        assert out[0] == int(row.argmax())
    elif top_p < 1e-30 or top_k == 1:  # nothing but the best token is allowed
        scaled = row / torch.tensor(temperature, dtype=torch.float32)  # ties there (1e300 is inf) stay in
        assert scaled[out[0]] == scaled.max()


@settings(max_examples=60, deadline=None)
@given(
    repetition_penalty=st.sampled_from([5e-324, 1e-300, 1e-8, 1.0, 10.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    temperature=st.sampled_from([0.0, 1e-300, 1.0]),
)
def test_extreme_penalties_always_give_a_token(repetition_penalty, presence_penalty, frequency_penalty, temperature):
    p = SamplingParams(
        temperature=temperature,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    row = torch.linspace(-3, 3, 50)
    out = sample(row[None], [seq(p, seed=3, output=[49, 48, 48, 47], prompt=[49, 1])]).token_ids.tolist()
    assert 0 <= out[0] < 50


def test_in_place_gives_the_same_tokens_and_raw_logprobs():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(8)) * 3
    seqs = [
        seq(SamplingParams(temperature=0.0, logprobs=3, min_tokens=5)),  # EOS masked, logprobs raw
        seq(SamplingParams(temperature=1.0, seed=2, logprobs=1, repetition_penalty=2.0), output=[1, 2, 3]),
        seq(SamplingParams(temperature=0.0, presence_penalty=1.5), output=[int(logits[2].argmax())]),
        seq(SamplingParams(temperature=0.5, top_k=3, seed=1)),
    ]
    sampler = Sampler(100, [EOS])
    want = sampler(logits.clone(), seqs)
    owned = logits.clone()
    got = sampler(owned, seqs, in_place=True)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.top_ids, want.top_ids)
    assert owned[0, EOS] == -math.inf and not torch.equal(owned, logits)  # the masks went into the logits
