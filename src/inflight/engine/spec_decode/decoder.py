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

# Back-off: a sequence whose last WINDOW proposals accepted less than the bound of their drafts stops
# proposing for COOLDOWN_STEPS decode steps, then tries again from a fresh window. The bound rises with the
# batch: alone, draft rows ride along with a step that streams the weights anyway; with more than SMALL_BATCH
# running they cost compute, and the measured break-even acceptance is higher (docs/PERFORMANCE.md).
WINDOW = 8
MIN_ACCEPTANCE = 0.2
SMALL_BATCH = 4
BATCHED_MIN_ACCEPTANCE = 0.4
COOLDOWN_STEPS = 32


class _SeqState:
    __slots__ = ("cooldown", "recent")

    def __init__(self) -> None:
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (drafted, accepted) per proposal
        self.cooldown = 0


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
        self._min_acceptance = MIN_ACCEPTANCE  # the bound for this step's batch

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
            seq.spec_token_ids = self.proposer.propose(seq, seq.prompt_token_ids, seq.output_token_ids, room)

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
        if len(state.recent) == WINDOW:
            drafted = sum(d for d, _ in state.recent)
            if sum(a for _, a in state.recent) < self._min_acceptance * drafted:
                state.cooldown = COOLDOWN_STEPS
                state.recent.clear()

    def finish(self, seq: Sequence) -> None:
        """`seq` finished or was aborted."""
        self._state.pop(seq, None)
        self.proposer.finish(seq, seq.output_token_ids)
