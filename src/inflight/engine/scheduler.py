"""Iteration-level scheduler: re-decides the batch at every step.

One rule: a running sequence is scheduled `num_tokens - num_computed_tokens` tokens, capped by what is
left of `max_num_batched_tokens`. A fresh prompt is therefore prefilled (in chunks when long), a
sequence that just sampled gets 1 token (decode), and a preempted one recomputes — all in one batch.
A prefix cache hit at admission only sets `num_computed_tokens`: the same rule then computes the rest.
Speculative decoding counts a running sequence's draft tokens in: a decode with d drafts is a (d+1)-token
chunk, its drafts trimmed to what the budget leaves. After the forward, `update_from_output` appends the
sampled tokens and finishes the sequences that end (vLLM v1's `Scheduler.update_from_output`).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from inflight.config import EngineConfig
from inflight.engine.kv_cache import BlockManager
from inflight.engine.sequence import FinishReason, Sequence, SequenceStatus
from inflight.engine.structured_output import StructuredOutputManager
from inflight.outputs import RequestOutput, TokenLogprob


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Draft tokens of each scheduled sequence (aligned with `seqs`), or None when no sequence has any.
    spec_token_ids: list[list[int]] | None = None
    # Sequences that decode this step (one new token, plus any drafts it verifies) and their tokens.
    num_decode_seqs: int = 0
    num_decode_tokens: int = 0
    # Each scheduled sequence's LoRA slot (-1: none), set by the engine before the forward; None when no
    # sequence of the step has an adapter.
    lora_slots: list[int] | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def subset(self, lo: int, hi: int) -> SchedulerOutput:
        """The scheduled sequences lo..hi-1 as a step of their own (decode counts are kept for the whole step)."""
        spec = self.spec_token_ids[lo:hi] if self.spec_token_ids is not None else None
        lora = self.lora_slots[lo:hi] if self.lora_slots is not None else None
        return SchedulerOutput(self.seqs[lo:hi], self.num_scheduled_tokens[lo:hi], spec_token_ids=spec, lora_slots=lora)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: set[int],
        structured_outputs: StructuredOutputManager,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.structured_outputs = structured_outputs
        self.speculative = config.speculative_config is not None  # else no draft bookkeeping per step
        # Both queues stay sorted by (priority, arrival, admission order): lower priority values first,
        # so the running queue's tail holds the preemption victims and the waiting queue's head is next.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._order: dict[Sequence, tuple] = {}
        self._counter = itertools.count()
        self.num_preemptions = 0
        self.num_generation_tokens = 0
        # Prefix cache lookups at first admission, in prompt tokens (a resumed preemption is not a query).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def _key(self, seq: Sequence) -> tuple:
        return self._order[seq]

    def add(self, seq: Sequence) -> None:
        self._order[seq] = (seq.priority, seq.arrival_time, next(self._counter))
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out of whichever queue holds it and give its blocks back at once."""
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        i = bisect.bisect_left(queue, self._key(seq), key=self._key)
        if i < len(queue) and queue[i] is seq:
            del queue[i]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._order[seq]

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: drop the KV and replay prompt + output later; nothing is lost.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._key)

    # ---- schedule -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        speculative = self.speculative
        drafts: list[list[int]] = []
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            self.block_manager.release_out_of_window(seq)
            unspec = seq.num_tokens - seq.num_computed_tokens
            n = min(unspec + len(seq.spec_token_ids), budget)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                if seq.spec_token_ids:  # drafts never cost another sequence its place: drop them first
                    seq.spec_token_ids = []
                    n = min(unspec, budget)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(n)
                if unspec == 1:
                    out.num_decode_seqs += 1
                    out.num_decode_tokens += n
                if speculative:
                    drafts.append(seq.spec_token_ids[: max(n - unspec, 0)])
                    seq.spec_token_ids = []
                budget -= n
                i += 1
        if speculative:  # the ones not scheduled this step: their drafts would be stale by the next
            for j in range(i, len(self.running)):
                self.running[j].spec_token_ids = []

        if not out.preempted:
            self._admit(out, budget)
        if speculative and any(drafts):
            out.spec_token_ids = drafts + [[] for _ in range(len(out.seqs) - len(drafts))]
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting sequences join the running batch in queue order while seats, blocks and the token budget
        last; each is scheduled its first chunk. FCFS: a head short of blocks waits rather than be overtaken.

        The two baselines for A/B runs live here alone. scheduling_policy=static: a new batch joins only once
        the previous one drained, and joins whole, budget or not (the running loop schedules what this step has
        no room for). kv_reservation=max_length: a sequence holds max_model_len tokens' blocks from admission,
        as a contiguous allocator would, so the running loop never needs another block for it."""
        static = self.config.scheduling_policy == "static"
        if static and self.running:
            return
        max_length = self.config.kv_reservation == "max_length"
        # At most max_loras distinct adapters run at once: each needs a device slot every step it runs.
        adapters = {s.lora_name for s in self.running if s.lora_name is not None}
        w = 0
        while w < len(self.waiting) and len(self.running) < self.config.max_num_seqs and (budget > 0 or static):
            seq = self.waiting[w]
            if not self.structured_outputs.is_ready(seq.request_id):  # compiling: it must not hold up the queue
                w += 1
                continue
            if seq.lora_name is not None and seq.lora_name not in adapters and len(adapters) >= self.config.max_loras:
                w += 1  # its adapter waits for a slot; requests for the running adapters go ahead
                continue
            cached = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(seq, self.max_model_len if max_length else num_cached + n, cached):
                break
            self.waiting.pop(w)
            if seq.lora_name is not None:
                adapters.add(seq.lora_name)
            self._set_cached(seq, num_cached)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            if n > 0:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(n)
                budget -= n
                if n == 1 and num_cached == seq.num_tokens - 1:  # resumed with all but its last token cached
                    out.num_decode_seqs += 1
                    out.num_decode_tokens += 1

    def _set_cached(self, seq: Sequence, num_cached: int) -> None:
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = num_cached // self.block_manager.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached
            if self.block_manager.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached

    # ---- update from the step's output ----------------------------------------------------------------

    def update_from_output(
        self,
        sched: SchedulerOutput,
        sampled: list[Sequence],
        sampled_token_ids: list[list[int]],
        logprobs: list[TokenLogprob | None] | None,
    ) -> list[RequestOutput]:
        """After the forward over `sched`: its tokens' KV counts as computed (a draft's once it is accepted),
        then each sampling sequence takes its tokens (one; or the drafts it accepted and the token after them)
        one at a time, so that stop tokens, max_tokens and max_model_len hold at every position. One output
        per sampling sequence; a sequence that ends is finished here (its blocks go back)."""
        drafts = sched.spec_token_ids
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled_tokens)):
            seq.num_computed_tokens += n - len(drafts[i]) if drafts is not None else n
            self.block_manager.cache_full_blocks(seq)
        outputs = []
        for i, (seq, tokens) in enumerate(zip(sampled, sampled_token_ids)):
            lp = logprobs[i] if logprobs is not None else None
            outputs.append(self._append_tokens(seq, tokens, lp))
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprob: TokenLogprob | None) -> RequestOutput:
        structured = seq.request_id in self.structured_outputs
        new_logprobs = [logprob] if logprob is not None else None
        for j, tok in enumerate(tokens):
            if j:  # the token before this one was an accepted draft: its KV counts now
                seq.num_computed_tokens += 1
                self.block_manager.cache_full_blocks(seq)
            stop_token = self._is_stop_token(seq, tok)
            seq.output_token_ids.append(tok)
            self.num_generation_tokens += 1
            if structured:
                if not self.structured_outputs.accept(seq.request_id, tok):
                    return self._grammar_rejected(seq, tok)
                error = self.structured_outputs.over_budget(seq.request_id, len(seq.output_token_ids))
                if error is not None:  # its grammar would stall every other request
                    self.finish(seq, FinishReason.ABORT)
                    return request_output(seq, [], error=error, error_kind="limit", error_field="structured_outputs")
            if logprob is not None and j == 0:  # a sequence with logprobs does not speculate: one token
                seq.cumulative_logprob += logprob.logprob
            if stop_token or (structured and self.structured_outputs.is_terminated(seq.request_id)):
                self.finish(seq, FinishReason.STOP)
                return request_output(seq, tokens[: j + 1], new_logprobs, stop_reason=tok if stop_token else None)
            if len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, FinishReason.LENGTH)
                return request_output(seq, tokens[: j + 1], new_logprobs)
        return request_output(seq, tokens, new_logprobs)

    def _is_stop_token(self, seq: Sequence, tok: int) -> bool:
        p = seq.sampling_params
        if len(seq.output_token_ids) + 1 <= p.min_tokens:  # as the sampler's mask (vLLM): the first min_tokens
            return False
        return (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids

    def _grammar_rejected(self, seq: Sequence, tok: int) -> RequestOutput:
        """The grammar refused the sampled token: it allowed none (the user's grammar matches nothing), or the
        bitmask let through a token it should not have (an engine bug)."""
        self.finish(seq, FinishReason.ABORT)
        if self.structured_outputs.allows_no_token(seq.request_id):
            kind, n = seq.sampling_params.structured_outputs.kind, len(seq.output_token_ids) - 1
            error = f"structured_outputs.{kind} matches nothing: no token may follow {n} output tokens"
            return request_output(seq, [], error=error, error_field="structured_outputs")
        return request_output(seq, [], error=f"internal error: the grammar rejected token {tok}", error_kind="internal")


def request_output(
    seq: Sequence,
    new_token_ids: list[int],
    new_logprobs: list[TokenLogprob] | None = None,
    error: str | None = None,
    error_kind: str = "invalid",
    stop_reason: int | None = None,
    error_field: str | None = None,
) -> RequestOutput:
    """The sequence's progress this step: its new tokens and, once finished, why."""
    finished = seq.is_finished
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        new_token_ids=new_token_ids,
        new_text="",
        finished=finished,
        finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
        new_logprobs=new_logprobs,
        cumulative_logprob=seq.cumulative_logprob,
        num_output_tokens=len(seq.output_token_ids),
        error=error,
        error_kind=error_kind,
        error_field=error_field,
        num_cached_tokens=seq.num_cached_tokens or 0,
        stop_reason=stop_reason,
    )
