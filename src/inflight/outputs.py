"""What the engine hands back: per-step deltas for streaming, whole results for `LLM.generate`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the N most likely tokens and their logprobs (raw model distribution)


@dataclass
class RequestOutput:
    """One request's progress in one engine step. Streaming clients send `new_text` as it comes."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str  # the delta; "" while text is held back (partial UTF-8 char or possible stop string)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    new_logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    num_output_tokens: int = 0
    # Set when the request failed after it was accepted (e.g. its grammar cannot compile): the message
    # names the field and the reason. `finished` is then True.
    error: str | None = None
    error_kind: str = "invalid"  # an inflight.errors.ErrorKind's value ("invalid": the request's own input)
    error_field: str | None = None  # the request field at fault, if one is
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # vLLM's: the stop string, or the stop token's id (EOS too, where vLLM gives None), that ended it.
    stop_reason: int | str | None = None


@dataclass
class CompletionOutput:
    """One request's whole result, as `LLM.generate` returns it (vLLM's shape, flattened)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: int | str | None = None  # as RequestOutput's


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying both deltas of a request (`later` is the newer)."""
    logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (later.new_logprobs or [])
    return dataclasses.replace(
        later,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
        new_logprobs=logprobs,
    )
