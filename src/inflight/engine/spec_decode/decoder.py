"""Which sequences speculate this step, their drafts from the method's proposer (ngram.py, suffix.py), and what
came of them (acceptance counters, back-off). Which drafts a step accepts: verify.py."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from inflight.engine.spec_decode.ngram import NgramProposer
from inflight.engine.spec_decode.suffix import SuffixProposer
from inflight.engine.spec_decode.verify import accepted_tokens

if TYPE_CHECKING:
    from inflight.config import SpeculativeConfig
    from inflight.engine.sequence import Sequence

# How many drafts a sequence gets (StepCost): its j-th draft is worth proposing while the chance that it is
# accepted (its acceptance rate a, estimated over its last WINDOW proposals, to the power j) exceeds what one
# more row costs the step, counted in the tokens the step would otherwise give: from the engine's own measured
# step times. No draft is worth it: the sequence stops proposing for COOLDOWN_STEPS decode steps, then tries
# again from a fresh window. Until the step cost is known, a fixed bound on the window's acceptance (lower
# alone, where draft rows ride along with a step that streams the weights anyway) decides.
WINDOW = 8
MIN_ACCEPTANCE = 0.2
SMALL_BATCH = 4
BATCHED_MIN_ACCEPTANCE = 0.4
COOLDOWN_STEPS = 32
PRIOR = (1.0, 1.0)  # (accepted, rejected) a fresh sequence starts from: a = 0.5


class _SeqState:
    __slots__ = ("cooldown", "recent")

    def __init__(self) -> None:
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (drafted, accepted) per proposal
        self.cooldown = 0

    def acceptance(self) -> float:
        """The chance that a draft is accepted given that the ones before it were: accepted drafts over
        accepted plus rejections (a proposal has at most one), with PRIOR."""
        accepted = PRIOR[0] + sum(a for _, a in self.recent)
        rejected = PRIOR[1] + sum(1 for d, a in self.recent if a < d)
        return accepted / (accepted + rejected)


class StepCost:
    """Seconds of a step without prompt tokens as a + b * rows, a least-squares fit over the last STEPS such
    steps; `row_cost(batch)`: what one more row costs a step of `batch` sequences, as a share of the time per
    token it gives (b * batch / (a + b * batch)). None until the rows have varied enough to tell b."""

    STEPS = 64
    MIN_STEPS = 8

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=self.STEPS)
        self.fit: tuple[float, float] | None = None  # (a, b)

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))
        n = len(self._steps)
        self.fit = None
        if n < self.MIN_STEPS:
            return
        mean_r = sum(r for r, _ in self._steps) / n
        mean_s = sum(t for _, t in self._steps) / n
        var = sum((r - mean_r) ** 2 for r, _ in self._steps)
        if var < n:  # rows within about one of each other: no slope to read
            return
        b = max(0.0, sum((r - mean_r) * (t - mean_s) for r, t in self._steps) / var)
        self.fit = (max(0.0, mean_s - b * mean_r), b)

    def row_cost(self, batch: int) -> float | None:
        if self.fit is None:
            return None
        a, b = self.fit
        step = a + b * batch
        return b * batch / step if step > 0 else None


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
        self.counters = SpecDecodeCounters(self.k)
        self.step_cost = StepCost()
        self._min_acceptance = MIN_ACCEPTANCE  # the bound for this step's batch, while the step cost is unknown

    @staticmethod
    def can_speculate(seq: Sequence) -> bool:
        # Structured outputs advance a grammar matcher per token and logprobs report per token: those
        # sequences decode one token a step.
        p = seq.sampling_params
        return seq.structured is None and p.logprobs is None

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of the running sequences that speculate this step (the others get none)."""
        if len(running) > self.config.disable_by_batch_size:
            return  # the scheduler drops drafts left on sequences it does not schedule; none are set here
        self._min_acceptance = MIN_ACCEPTANCE if len(running) <= SMALL_BATCH else BATCHED_MIN_ACCEPTANCE
        row_cost = self.step_cost.row_cost(len(running))
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not self.can_speculate(seq):
                continue  # prefilling or recomputing: the rule schedules its own tokens
            state = self._state.get(seq)
            if state is None:
                state = self._state[seq] = _SeqState()
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
            if row_cost is not None:
                room = min(room, self.worth(state.acceptance(), row_cost))
                if room < 1:  # not even one draft pays: rest, then try again
                    state.cooldown = COOLDOWN_STEPS
                    state.recent.clear()
                    continue
            seq.spec_token_ids = self.proposer.propose(seq, seq.prompt_token_ids, seq.output_token_ids, room)

    def worth(self, acceptance: float, row_cost: float) -> int:
        """Drafts worth proposing: the j-th is while acceptance ** j (the chance it is accepted) exceeds what
        its row costs (StepCost.row_cost), at most k."""
        n, p = 0, acceptance
        while n < self.k and p > row_cost:
            n += 1
            p *= acceptance
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
        state = self._state.get(seq)
        if state is None:
            return
        state.recent.append((num_drafts, num_accepted))
        if len(state.recent) == WINDOW and self.step_cost.fit is None:
            drafted = sum(d for d, _ in state.recent)
            if sum(a for _, a in state.recent) < self._min_acceptance * drafted:
                state.cooldown = COOLDOWN_STEPS
                state.recent.clear()

    def finish(self, seq: Sequence) -> None:
        """`seq` finished or was aborted."""
        self._state.pop(seq, None)
        self.proposer.finish(seq, seq.output_token_ids)
