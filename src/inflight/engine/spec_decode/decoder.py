"""Which sequences speculate this step, their drafts from the method's proposer (ngram.py, suffix.py), and what
came of them (acceptance counters, back-off). Which drafts a step accepts: verify.py."""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING, Protocol

from inflight.engine.spec_decode.ngram import NgramProposer
from inflight.engine.spec_decode.suffix import SuffixProposer
from inflight.engine.spec_decode.verify import accepted_tokens

if TYPE_CHECKING:
    from inflight.config import SpeculativeConfig
    from inflight.engine.sequence import Sequence

# A sequence's j-th draft is proposed while its chance of acceptance (a product of per-position rates from the
# sequence's last WINDOW proposals, the engine's rates as a prior) exceeds what one more row costs the step
# (StepCost, from the engine's step times); with no draft worth it the sequence rests COOLDOWN_STEPS decode steps.
# The step then keeps the drafts that maximise its goodput (TurboSpec's criterion), above a floor on acceptance
# (higher in a batch: there a draft shortens one request, not the batch). A batched sequence whose lookups found
# nothing MISS_LIMIT steps running looks only every MISS_REST + 1-th step: each lookup costs the step.
WINDOW = 8
MIN_ACCEPTANCE = 0.2
SMALL_BATCH = 4
BATCHED_MIN_ACCEPTANCE = 0.4
COOLDOWN_STEPS = 32
MISS_LIMIT = 8
MISS_REST = 4
PRIOR_WEIGHT = 2.0  # proposals' worth of the prior a sequence's own rate at a position starts from
GLOBAL_WINDOW = 1024  # the engine's rates: counts halve once a position has this many tries
PRIOR_EVERY = 16


class PositionRates:
    """Per draft position j: proposals that reached it (drafted past j, the ones before it accepted) and those
    whose j-th draft was accepted too; from them the conditional acceptance at each position."""

    __slots__ = ("hits", "tries")

    def __init__(self, k: int) -> None:
        self.tries = [0.0] * k
        self.hits = [0.0] * k

    def add(self, drafted: int, accepted: int, weight: float = 1.0) -> None:
        for j in range(min(drafted, accepted + 1, len(self.tries))):
            self.tries[j] += weight
            if accepted > j:
                self.hits[j] += weight

    def rates(self) -> list[float]:
        """(hits + 1) / (tries + 2) per position (Laplace's)."""
        return [(h + 1.0) / (t + 2.0) for h, t in zip(self.hits, self.tries)]

    def chained(self, first: float, weight: float) -> list[float]:
        """(hits + weight * prior) / (tries + weight) per position, the prior of the first position `first` and
        of each later one the rate before it: a sequence that has shown nothing at a position is taken to
        continue as it began, not as other sequences do."""
        out, q = [], first
        for h, t in zip(self.hits, self.tries):
            q = (h + weight * q) / (t + weight)
            out.append(q)
        return out


class _SeqState:
    __slots__ = ("_chances", "cooldown", "misses", "rates", "recent")

    def __init__(self, k: int) -> None:
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (drafted, accepted) per proposal
        self.rates = PositionRates(k)  # over `recent`
        self.cooldown = 0
        self.misses = 0  # proposer calls in a row that found no draft
        self._chances: tuple[float, list[float]] | None = None  # (prior, chances) last computed

    def record(self, drafted: int, accepted: int) -> None:
        if len(self.recent) == WINDOW:
            self.rates.add(*self.recent[0], weight=-1.0)
        self.recent.append((drafted, accepted))
        self.rates.add(drafted, accepted)
        self._chances = None

    def rest(self) -> None:
        self.cooldown = COOLDOWN_STEPS
        self.recent.clear()
        self.rates = PositionRates(len(self.rates.tries))
        self._chances = None

    def chances(self, prior: float) -> list[float]:
        """The chance that each draft position is accepted: the product of the conditional rates up to it."""
        if self._chances is not None and self._chances[0] == prior:
            return self._chances[1]
        out, p = [], 1.0
        for c in self.rates.chained(prior, PRIOR_WEIGHT):
            p *= c
            out.append(p)
        self._chances = (prior, out)
        return out


class StepCost:
    """The time of a step without prompt tokens by its rows: per row count the median of its last PER_ROWS
    steps (a point once it has MIN_PER_ROWS), and a least-squares line a + b * rows through those points, one per
    row count (a batch that holds steady gives many steps of one count, which alone say nothing of a row's cost).
    `seconds(rows)`: the row count's own median, else the line; `row_cost(batch)`: what one more row costs a
    step of `batch` sequences, as a share of the time per token it gives (b * batch / (a + b * batch)). None
    until two row counts are known."""

    PER_ROWS = 8
    MIN_PER_ROWS = 3
    MAX_ROW_COUNTS = 512  # distinct row counts remembered (the least recently seen goes first)
    RESUM_EVERY = 1024

    def __init__(self) -> None:
        self._by_rows: dict[int, deque[float]] = {}
        self._points: dict[int, float] = {}  # row count -> its median, once it has MIN_PER_ROWS steps
        self._sums = [0.0] * 5  # over _points: rows, seconds, rows², rows * seconds, and how many
        self._observed = 0
        self.fit: tuple[float, float] | None = None  # (a, b)

    def observe(self, rows: int, seconds: float) -> None:
        times = self._by_rows.pop(rows, None)
        if times is None:
            times = deque(maxlen=self.PER_ROWS)
            if len(self._by_rows) >= self.MAX_ROW_COUNTS:
                oldest = next(iter(self._by_rows))
                del self._by_rows[oldest]
                self._set_point(oldest, None)
        times.append(seconds)
        self._by_rows[rows] = times  # last in the dict: the most recently seen
        if len(times) >= self.MIN_PER_ROWS:
            self._set_point(rows, statistics.median(times))
        self._observed += 1
        if self._observed % self.RESUM_EVERY == 0:  # running sums drift by rounding: start them afresh
            self._sums = [0.0] * 5
            for r, t in self._points.items():
                self._add(r, t, 1.0)
        self._refit()

    def _set_point(self, rows: int, median: float | None) -> None:
        old = self._points.pop(rows, None)
        if old is not None:
            self._add(rows, old, -1.0)
        if median is not None:
            self._points[rows] = median
            self._add(rows, median, 1.0)

    def _add(self, rows: int, seconds: float, sign: float) -> None:
        s = self._sums
        s[0] += sign * rows
        s[1] += sign * seconds
        s[2] += sign * rows * rows
        s[3] += sign * rows * seconds
        s[4] += sign

    def _refit(self) -> None:
        sr, st, srr, srt, n = self._sums
        self.fit = None
        if n < 2:
            return
        var = srr - sr * sr / n
        if var <= 0:
            return
        b = max(0.0, (srt - sr * st / n) / var)
        self.fit = (max(0.0, (st - b * sr) / n), b)

    def row_cost(self, batch: int) -> float | None:
        if self.fit is None:
            return None
        a, b = self.fit
        step = a + b * batch
        return b * batch / step if step > 0 else None

    def seconds(self, rows: int) -> float | None:
        point = self._points.get(rows)
        if point is not None:
            return point
        if self.fit is None:
            return None
        a, b = self.fit
        return a + b * rows


class Proposer(Protocol):
    def propose(self, key: object, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        """At most max_tokens draft tokens for the sequence `key` (prompt + output so far)."""
        ...

    def finish(self, key: object, output: list[int]) -> None:
        """The sequence `key` finished (or was aborted) with `output`."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "suffix":
        return SuffixProposer(
            config.num_speculative_tokens,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


class SpecDecodeCounters:
    """vLLM's spec_decode counters, cumulative: verified proposals, their draft tokens, the drafts accepted,
    and accepted drafts by position in the proposal (one entry per position up to num_speculative_tokens)."""

    __slots__ = ("num_accepted_tokens", "num_accepted_tokens_per_pos", "num_draft_tokens", "num_drafts")

    def __init__(self, num_speculative_tokens: int = 0) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    def as_dict(self) -> dict[str, int | tuple[int, ...]]:
        """Under EngineSnapshot's field names (vLLM's), per position as a tuple."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(self.num_accepted_tokens_per_pos),
        }


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config)
        self._state: dict[Sequence, _SeqState] = {}
        self.engine_rates = PositionRates(1)  # the first draft of every sequence's proposals, recent ones most
        self._prior: float | None = None  # engine_rates' first rate, refreshed every PRIOR_EVERY proposals
        self._prior_at = 0.0
        self.counters = SpecDecodeCounters(self.k)
        self.step_cost = StepCost()
        self._min_acceptance = MIN_ACCEPTANCE  # the acceptance floor for this step's batch

    @staticmethod
    def can_speculate(seq: Sequence) -> bool:
        # Structured outputs advance a grammar matcher per token and logprobs report per token: those
        # sequences decode one token a step.
        p = seq.sampling_params
        return p.structured_outputs is None and p.logprobs is None

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of the running sequences that speculate this step (the others get none)."""
        if len(running) > self.config.disable_by_batch_size:
            return  # the scheduler drops drafts left on sequences it does not schedule; none are set here
        small = len(running) <= SMALL_BATCH
        self._min_acceptance = MIN_ACCEPTANCE if small else BATCHED_MIN_ACCEPTANCE
        row_cost = self.step_cost.row_cost(len(running))
        prior = self.prior()
        proposed: list[tuple[Sequence, list[float]]] = []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not self.can_speculate(seq):
                continue  # prefilling or recomputing: the rule schedules its own tokens
            state = self._state.get(seq)
            if state is None:
                state = self._state[seq] = _SeqState(self.k)
            if state.cooldown:
                state.cooldown -= 1
                continue
            # A draft may not take the sequence past max_tokens or max_model_len (the token after the drafts
            # is sampled too).
            room = min(
                seq.sampling_params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if room < 1:
                continue
            chances = state.chances(prior)
            if row_cost is not None:
                room = min(room, self.worth(chances, row_cost))
                if room < 1:  # not even one draft pays: rest, then try again
                    state.rest()
                    continue
            seq.spec_token_ids = self.proposer.propose(seq, seq.prompt_token_ids, seq.output_token_ids, room)
            if seq.spec_token_ids:
                proposed.append((seq, chances))
                state.misses = 0
            else:
                state.misses += 1
                if state.misses >= MISS_LIMIT and not small:
                    state.cooldown = MISS_REST
        if proposed:
            self.keep_for_goodput(len(running), proposed)

    def keep_for_goodput(self, rows: int, proposed: list[tuple[Sequence, list[float]]]) -> None:
        """Cut the drafts of `proposed` (sequence, chance of each draft position) to the number that maximises
        the step's expected tokens per second: a step of `rows` rows gives `rows` tokens, plus each kept draft's
        chance, most likely first, in StepCost.seconds of its rows. A time unknown: all are kept."""
        chances = sorted(
            ((p, i) for i, (seq, ps) in enumerate(proposed) for p in ps[: len(seq.spec_token_ids)]), reverse=True
        )
        base = self.step_cost.seconds(rows)
        if base is None:
            return
        best, best_n, tokens = rows / base, 0, float(rows)
        for n, (p, _) in enumerate(chances, 1):
            seconds = self.step_cost.seconds(rows + n)
            if seconds is None:  # fewer than two step sizes measured: all kept, so that one gets measured
                return
            tokens += p
            if tokens / seconds > best:
                best, best_n = tokens / seconds, n
        keep = [0] * len(proposed)
        for _, i in chances[:best_n]:
            keep[i] += 1
        for (seq, _), n in zip(proposed, keep):
            seq.spec_token_ids = seq.spec_token_ids[:n]

    def prior(self) -> float:
        """The engine's recent rate at the first draft position (a sequence's estimate starts there); it moves
        slowly, so it is read afresh every PRIOR_EVERY proposals, and the sequences' chances are kept until it is."""
        tries = self.engine_rates.tries[0]
        if self._prior is None or abs(tries - self._prior_at) >= PRIOR_EVERY:
            self._prior, self._prior_at = self.engine_rates.rates()[0], tries
        return self._prior

    @staticmethod
    def worth(chances: list[float], row_cost: float) -> int:
        """Drafts worth proposing: the j-th is while its chance of being accepted (chances, falling with j)
        exceeds what its row costs (StepCost.row_cost)."""
        n = 0
        while n < len(chances) and chances[n] > row_cost:
            n += 1
        return n

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step without prompt tokens: `rows` query tokens (a verifying sequence's drafts too) in `seconds`."""
        self.step_cost.observe(rows, seconds)

    def verify(self, seqs: list[Sequence], drafts: list[list[int]], tokens: list[int]) -> list[list[int]]:
        """The tokens each sequence accepts (verify.accepted_tokens), recorded in the counters and back-off."""
        accepted = accepted_tokens(drafts, tokens)
        for seq, d, a in zip(seqs, drafts, accepted):
            if d:
                self.record(seq, len(d), len(a) - 1)
        return accepted

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """One verified proposal of `seq`: the counters, and its back-off."""
        self.counters.record(num_drafts, num_accepted)
        rates = self.engine_rates
        rates.add(num_drafts, num_accepted)
        if rates.tries[0] > GLOBAL_WINDOW:
            rates.tries = [t / 2 for t in rates.tries]
            rates.hits = [h / 2 for h in rates.hits]
        state = self._state.get(seq)
        if state is None:
            return
        state.record(num_drafts, num_accepted)
        if len(state.recent) == WINDOW:
            drafted = sum(d for d, _ in state.recent)
            if sum(a for _, a in state.recent) < self._min_acceptance * drafted:
                state.rest()

    def finish(self, seq: Sequence) -> None:
        """`seq` finished or was aborted."""
        self._state.pop(seq, None)
        self.proposer.finish(seq, seq.output_token_ids)
