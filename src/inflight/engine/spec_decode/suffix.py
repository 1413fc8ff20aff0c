"""Suffix decoding (vLLM's `suffix` method, after Arctic Inference's SuffixDecodingCache): the last tokens of a
sequence, looked up in its own prompt + output and in the outputs of earlier requests, propose what most
often followed them there.

As Arctic's suffix trees (of depth max_tree_depth): a pattern is one of the sequence's last m tokens (m <
max_tree_depth), its count is how often it occurs, and the draft walks its most frequent continuation, each
token's probability the product of count(next) / count(here) so far, until that falls below min_token_prob,
for at most min(num_speculative_tokens, max_spec_factor * m, max_tree_depth - m) tokens. Every pattern length
is tried; the draft with the highest score (the sum of its probabilities) wins, the longer match on a tie,
and the request's own tokens over the global cache on a tie. The request's own tokens include the pattern's
own occurrence at their end, which has no continuation: a continuation seen once before gets probability 1/2.

The index is not a tree: per anchor length n, a hash chain over the n-grams (the most recent position of
each, and from each position the previous one with the same hash, as LZ77 compressors keep), so appending a
token costs O(1) and the occurrences of a pattern come most recent first. Patterns shorter than the smallest
anchor (2) are not looked up; a pattern's counts come from its MAX_OCCURRENCES most recent occurrences.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from operator import itemgetter

ANCHORS = (2, 8)  # n-gram lengths with a hash chain: a pattern of m tokens is found through the longest n <= m
MAX_OCCURRENCES = 32  # occurrences of a pattern counted (the most recent)
MAX_CHAIN_STEPS = 4 * MAX_OCCURRENCES  # chain entries visited per lookup (hash collisions included)
_OFFSET_BITS = 32  # a position is (sequence id << 32) | offset


class _Heads(dict):
    """An unbounded chain head table: a hash not seen yet has no position."""

    def __missing__(self, key: int) -> int:
        return -1


class SuffixIndex:
    """Token sequences and their n-gram hash chains. Only the newest sequence grows; the oldest leaves first.

    `buckets`: 0 keys the chain heads by the full 32-bit hash (a dict, for one request's tokens); a power of two
    bounds the head table to that many slots (the global cache: its memory stays proportional to its tokens).
    """

    def __init__(self, buckets: int = 0) -> None:
        self.mask = buckets - 1 if buckets else 0xFFFFFFFF
        self.heads = [array("q", [-1]) * buckets if buckets else _Heads() for _ in ANCHORS]
        self.seqs: deque[array] = deque()
        self.prevs: deque[list[array]] = deque()  # per sequence, per anchor: the previous position, per offset
        self.first_id = 0  # id of seqs[0]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs)

    def add_sequence(self, tokens: Iterable[int] = ()) -> None:
        self.seqs.append(array("i"))
        self.prevs.append([array("q") for _ in ANCHORS])
        self.extend(tokens)

    def pop_oldest(self) -> None:
        self.seqs.popleft()
        self.prevs.popleft()
        self.first_id += 1

    def extend(self, tokens: Iterable[int]) -> None:
        """Append to the newest sequence."""
        seq, prevs = self.seqs[-1], self.prevs[-1]
        sid = (self.first_id + len(self.seqs) - 1) << _OFFSET_BITS
        mask, heads = self.mask, self.heads
        for tok in tokens:
            seq.append(tok)
            end = len(seq)
            pos = sid | (end - 1)
            for a, n in enumerate(ANCHORS):
                if end < n:
                    prevs[a].append(-1)
                    continue
                h = zlib.crc32(seq[end - n : end]) & mask
                prevs[a].append(heads[a][h])
                heads[a][h] = pos

    def ends_with_a_repeat(self) -> bool:
        """Whether the newest sequence's last ANCHORS[0] tokens occurred earlier here (True may be a hash
        collision)."""
        prevs = self.prevs[-1][0]
        return len(prevs) > 0 and prevs[-1] >= 0

    def may_contain(self, ngram: array) -> bool:
        """False only where `ngram` (ANCHORS[0] tokens) occurs in no sequence here (its chain head is empty or
        evicted); True may be a hash collision."""
        pos = self.heads[0][zlib.crc32(ngram) & self.mask]
        return pos >= 0 and (pos >> _OFFSET_BITS) >= self.first_id

    def occurrences(self, tail: array, a: int, longest: int, own: bool) -> tuple[list[tuple[int, array, int]], int]:
        """The most recent occurrences (at most MAX_OCCURRENCES) of `tail`'s last n = ANCHORS[a] tokens: for each,
        how many of `tail`'s last tokens it matches (n to `longest`), and where it ends (its sequence, the offset
        after it); and how many have a token after them. `own`: the newest sequence ends with `tail` (a request's
        own tokens), the first occurrence found."""
        n = ANCHORS[a]
        last = len(tail) - 1
        pattern = tail[last + 1 - longest :]
        if own:
            seq = self.seqs[-1]
            found = [(longest, seq, len(seq))]
            pos = self.prevs[-1][a][len(seq) - 1]
        else:
            found = []
            pos = self.heads[a][zlib.crc32(tail[last + 1 - n :]) & self.mask]
        follows = 0
        for _ in range(MAX_CHAIN_STEPS):
            sid = (pos >> _OFFSET_BITS) - self.first_id
            if pos < 0 or sid < 0:  # the chain's end, or sequences evicted
                break
            end = (pos & 0xFFFFFFFF) + 1
            seq = self.seqs[sid]
            pos = self.prevs[sid][a][end - 1]
            # The longest common suffix of seq[:end] and tail: all of it by one slice comparison (a C loop), the
            # usual case in repetitive text; else token by token, where a mismatch usually comes soon.
            if end >= longest and seq[end - longest : end] == pattern:
                match = longest
            else:
                match, most, e = 0, min(longest, end), end - 1
                while match < most and seq[e - match] == tail[last - match]:
                    match += 1
                if match < n:
                    continue  # a hash collision
            found.append((match, seq, end))
            follows += end < len(seq)
            if len(found) == MAX_OCCURRENCES:
                break
        return found, follows


class Draft:
    __slots__ = ("match_len", "score", "token_ids")

    def __init__(self, token_ids: list[int] | None = None, score: float = 0.0, match_len: int = 0) -> None:
        self.token_ids = token_ids or []
        self.score = score
        self.match_len = match_len


def walk(continuations: list[list[int]], max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """The most frequent path through what followed a pattern's occurrences (an empty continuation: an occurrence
    with nothing after it, which counts all the same): its tokens and score. On a tie the first row's wins."""
    count = len(continuations)
    rows = [c for c in continuations if c]
    if not rows:
        return [], 0.0
    first = rows[0][:max_tokens]
    if len(first) == max_tokens and all(r[:max_tokens] == first for r in rows):  # one path: one probability
        prob = len(rows) / count
        return (first, prob * max_tokens) if prob >= min_token_prob else ([], 0.0)
    prob, score, tokens = 1.0, 0.0, []
    for i in range(max_tokens):
        tally: dict[int, int] = {}
        for r in rows:
            if len(r) > i:
                tally[r[i]] = tally.get(r[i], 0) + 1
        if not tally:
            break
        tok = max(tally, key=tally.__getitem__)  # the first maximum
        prob *= tally[tok] / count
        if prob < min_token_prob:
            break
        tokens.append(tok)
        score += prob
        rows = [r for r in rows if len(r) > i and r[i] == tok]
        count = len(rows)
    return tokens, score


class SuffixProposer:
    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._local: dict[object, SuffixIndex] = {}
        self._limits: dict[int, tuple[Callable[[int, int], tuple[int, int]], list[int]]] = {}
        self.global_index: SuffixIndex | None = None
        if max_cached_requests:
            # About 512 tokens per cached request, up to a 2^20-slot head table per anchor (8 MiB).
            self.global_index = SuffixIndex(1 << min(20, max(10, (max_cached_requests * 512).bit_length())))

    def propose(self, key: object, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        """At most min(k, max_tokens) draft tokens for the sequence `key` (prompt + output so far)."""
        local = self._local.get(key)
        have = len(local.seqs[0]) if local is not None else 0
        if local is None or len(prompt) + len(output) < have:  # new, or its tokens shrank: rebuilt
            local = self._local[key] = SuffixIndex()
            local.add_sequence()
            have = 0
        if have < len(prompt):
            local.extend(prompt[have:])
        local.extend(output[max(have - len(prompt), 0) :])
        seq = local.seqs[0]
        g = self.global_index if self.global_index is not None and len(self.global_index) else None
        # Every pattern ends with the last ANCHORS[0] tokens: where they occurred nowhere before (most steps of
        # free text), nothing can match and both lookups are skipped.
        n = ANCHORS[0]
        if len(seq) <= n or (not local.ends_with_a_repeat() and (g is None or not g.may_contain(seq[-n:]))):
            return []
        tail = seq[max(len(seq) - self.depth, 0) :]
        k = min(self.k, max_tokens)
        draft = self.speculate(local, tail, k, own=True)
        if g is not None:
            other = self.speculate(g, tail, k)
            if other.score > draft.score:
                draft = other
        return draft.token_ids

    def limits(self, k: int) -> tuple[Callable[[int, int], tuple[int, int]], list[int]]:
        """For patterns of more than `shorter` and at most m tokens: the most tokens a draft may have, and the
        longest pattern length allowing that many (a function of (shorter, m), cached); and per m, the most
        tokens any pattern of 1..m tokens may draft."""
        got = self._limits.get(k)
        if got is None:
            f, depth = self.max_spec_factor, self.depth
            most = [0] + [max(0, min(k, int(m * f + 1e-6), depth - m)) for m in range(1, depth)]

            @functools.cache
            def most_within(shorter: int, m: int) -> tuple[int, int]:
                tokens = max(most[shorter + 1 : m + 1])
                return tokens, next(mm for mm in range(m, shorter, -1) if most[mm] == tokens)

            got = self._limits[k] = (most_within, list(itertools.accumulate(most, max)))
        return got

    def speculate(self, index: SuffixIndex, tail: array, k: int, own: bool = False) -> Draft:
        """The best draft `index` gives for the patterns that end `tail` (the sequence's last tokens). Anchors
        go deepest first; a shallower one finds the occurrences of the patterns shorter than the deeper one."""
        longest = len(tail) - 1  # Arctic's: a pattern is shorter than the context it is taken from
        most_within, most_up_to = self.limits(k)
        best = Draft()
        upper = longest + 1  # patterns this long and longer are done
        walked = None  # (occurrences, most tokens) of all the deeper anchor found, when it found them all
        for a in reversed(range(len(ANCHORS))):
            n = ANCHORS[a]
            if n > longest:
                continue
            found, follows = index.occurrences(tail, a, upper - 1, own)
            upper = n  # a shallower anchor finds these occurrences again: it looks at shorter patterns only
            if not follows:
                walked = None
                continue
            # A pattern's occurrences are those matching at least its length: with the longest matches first, a
            # prefix of `found`. Patterns between two match lengths share it: each prefix is walked once, for the
            # length that allows the most tokens, and only if its first token's probability can beat the best.
            found.sort(key=itemgetter(0), reverse=True)  # stable: among equal matches the more recent first
            first: dict[int, int] = {}  # first tokens after the prefix's occurrences, counted
            size = 0
            for m in sorted({f[0] for f in found}, reverse=True):
                while size < len(found) and found[size][0] >= m:
                    _, seq, end = found[size]
                    if end < len(seq):
                        first[seq[end]] = first.get(seq[end], 0) + 1
                    size += 1
                tokens, length = most_within(found[size][0] if size < len(found) else n - 1, m)
                top = max(first.values(), default=0) / size  # no later token is more likely than the first
                if top < self.min_token_prob or top * tokens <= best.score:
                    continue
                if walked is not None and walked[0] == size < MAX_OCCURRENCES and walked[1] >= tokens:
                    continue  # the deeper anchor's occurrences again
                continuations = [seq[end : end + tokens].tolist() for _, seq, end in found[:size]]
                draft, score = walk(continuations, tokens, self.min_token_prob)
                if score > best.score:
                    best.token_ids, best.score, best.match_len = draft, score, length
            walked = (len(found), tokens) if len(found) < MAX_OCCURRENCES else None
            if best.score >= most_up_to[n - 1]:  # no shorter pattern can draft more
                break
        return best

    def finish(self, key: object, output: list[int]) -> None:
        """The sequence finished (or was aborted): its tokens go, its output joins the global cache (the oldest
        cached output leaves past max_cached_requests)."""
        self._local.pop(key, None)
        g = self.global_index
        if g is None or not output:
            return
        g.add_sequence(output)
        while len(g) > self.max_cached_requests:
            g.pop_oldest()
