"""The output processor (vLLM v1's name): an engine's outputs of token ids -> outputs with text, cut at stop strings.

The engine decides what needs its state (max_tokens, EOS and stop_token_ids, grammars) and outputs token ids
only; this module owns the text: incremental detokenization and stop strings with vLLM's rules (a stop
string's text is not output unless include_stop_str_in_output; it must end in the text of a token after the
first min_tokens; a stop token's text is not output either; held-back text is flushed at a finish, where it
may still complete a stop string). A stop string ends the request at the token whose text completed it:
tokens, logprobs and counts after it are cut, and the engine is told to abort it (it may have run further).
A request with `detokenize=False` passes through with no text.
The front runs it on the engine core process's step messages; the offline LLM on its in-process engine's outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tokenizers

from inflight.outputs import RequestOutput
from inflight.sampling_params import SamplingParams
from inflight.text.detokenizer import IncrementalDetokenizer, detokenize_batch


class RequestState:
    """One request's text so far: its detokenizer and what of its output has been let through."""

    __slots__ = ("cumulative_logprob", "detokenizer", "min_tokens", "num_output_tokens", "skip_stop_token_text")

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
            )
            if params.detokenize
            else None
        )
        self.min_tokens = params.min_tokens
        self.skip_stop_token_text = not params.include_stop_str_in_output
        self.num_output_tokens = 0
        self.cumulative_logprob = 0.0

    @property
    def stopped(self) -> bool:
        return self.detokenizer is not None and self.detokenizer.stopped


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]  # one per input output, in order, with text
    reqs_to_abort: list[str]  # ended by a stop string while the engine still runs them


def process_outputs(states: list[RequestState], outputs: list[RequestOutput]) -> OutputProcessorOutput:
    """`outputs[i]` (at most one per request, not stopped yet) is the newest step of the request `states[i]`
    tracks. Tokens go through in rounds, the r-th of every output in round r, so a stop string ends the text
    at the token that completed it and the sequences of a round share one decode call."""
    n = len(outputs)
    texts: list[list[str]] = [[] for _ in range(n)]
    kept = [len(out.new_token_ids) for out in outputs]  # tokens let through: all, unless a stop string cuts
    r = 0
    texted = [i for i in range(n) if states[i].detokenizer is not None]
    while live := [i for i in texted if r < len(outputs[i].new_token_ids) and not states[i].stopped]:
        feeds, checks = [], []
        for i in live:
            out, state = outputs[i], states[i]
            is_stop_token = isinstance(out.stop_reason, int) and out.finished and r == len(out.new_token_ids) - 1
            feeds.append([] if is_stop_token and state.skip_stop_token_text else [out.new_token_ids[r]])
            checks.append(state.num_output_tokens + r + 1 > state.min_tokens)
        deltas = detokenize_batch([states[i].detokenizer for i in live], feeds, checks)
        for i, (text, stop_hit) in zip(live, deltas):
            texts[i].append(text)
            if stop_hit:
                kept[i] = r + 1
        r += 1
    results, reqs_to_abort = [], []
    for out, state, text, num_kept in zip(outputs, states, texts, kept):
        if state.stopped:
            if not out.finished:
                reqs_to_abort.append(out.request_id)
            out = _cut(out, state, num_kept)
        elif out.finished and out.error is None and out.finish_reason != "abort" and state.detokenizer is not None:
            past_min = state.num_output_tokens + len(out.new_token_ids) > state.min_tokens
            rest, stop_hit = state.detokenizer.flush(check_stop=past_min)
            text.append(rest)
            if stop_hit:  # the held-back text completed a stop string after all
                out = dataclasses.replace(out, finish_reason="stop", stop_reason=state.detokenizer.stop_string)
        state.num_output_tokens += num_kept
        state.cumulative_logprob = out.cumulative_logprob
        results.append(dataclasses.replace(out, new_text="".join(text)))
    return OutputProcessorOutput(results, reqs_to_abort)


def _cut(out: RequestOutput, state: RequestState, num_kept: int) -> RequestOutput:
    """The output ended at its `num_kept`-th token by a stop string: what the engine made after it goes."""
    logprobs = out.new_logprobs[:num_kept] if out.new_logprobs is not None else None
    cumulative = state.cumulative_logprob
    for lp in logprobs or ():  # in the engine's order, so the sum is the engine's to the last bit
        cumulative += lp.logprob
    return dataclasses.replace(
        out,
        new_token_ids=out.new_token_ids[:num_kept],
        new_logprobs=logprobs,
        cumulative_logprob=cumulative,
        num_output_tokens=state.num_output_tokens + num_kept,
        finished=True,
        finish_reason="stop",
        stop_reason=state.detokenizer.stop_string,
        error=None,
    )
