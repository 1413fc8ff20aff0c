"""Verification of a step's drafts: which drafts the model's tokens accept, and how the accepted tokens reach
their sequences (one token at a time, the path decoding without drafts takes, so stop strings, max_tokens and
min_tokens hold at every position).

Verification is exact (deterministic drafts): position i of a (d+1)-token chunk is sampled as speculation off
would sample it (same logits, same seed and output index), and draft i is accepted when that token equals it.
For a sampled row this is the rejection rule for a deterministic draft, coupled: the draft is accepted with
probability p(draft), and a rejected position's token is distributed as p with the draft removed and
renormalized; greedy rows accept the longest prefix that matches the argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from inflight.outputs import merge_outputs

if TYPE_CHECKING:
    from inflight.engine.sequence import Sequence
    from inflight.outputs import RequestOutput


def accepted_tokens(drafts: list[list[int]], tokens: list[int]) -> list[list[int]]:
    """`tokens`: the d+1 tokens sampled for each sequence with d drafts, sequences in order. Per sequence: its
    drafts up to the first one the model's token differs from, then the model's token there."""
    accepted, g = [], 0
    for d in drafts:
        verified = tokens[g : g + len(d) + 1]
        m = 0
        while m < len(d) and verified[m] == d[m]:
            m += 1
        accepted.append(verified[: m + 1])
        g += len(d) + 1
    return accepted


def append_in_rounds(
    seqs: list[Sequence],
    accepted: list[list[int]],
    first: list[RequestOutput],
    append: Callable[[list[Sequence], list[int]], list[RequestOutput]],
    commit: Callable[[Sequence], None],
) -> list[RequestOutput]:
    """`first`: the outputs of every sequence's first accepted token, one per sequence. Round r appends the
    (r+1)-th accepted token of each sequence that has one and is not finished by then, through `append`, after
    `commit(seq)` counts the KV of the draft it accepts. One output per sequence carries all its tokens."""
    outputs = list(first)
    index = {o.request_id: i for i, o in enumerate(outputs)}
    r = 1
    while True:
        live = [(seq, a[r]) for seq, a in zip(seqs, accepted) if len(a) > r and not seq.is_finished]
        if not live:
            return outputs
        for seq, _ in live:
            commit(seq)
        for out in append([s for s, _ in live], [t for _, t in live]):
            i = index[out.request_id]
            outputs[i] = merge_outputs(outputs[i], out)
        r += 1
