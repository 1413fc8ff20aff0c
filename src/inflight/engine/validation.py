"""Request checks: a request the engine cannot serve is refused before it queues, with the field, value and limit
(kind LIMIT: over a bound of this server; INVALID: wrong whatever the server).

No torch here: the front of a server imports this module for the checks it runs before a request reaches the
engine core (tokenizing the prompt, the parameters' bounds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inflight.errors import ErrorKind, InvalidRequestError
from inflight.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from inflight.config import EngineConfig


def tokenize_prompt(tokenizer: Tokenizer, prompt: str, max_prompt_bytes: int, max_model_len: int) -> list[int]:
    """Prompt text -> token ids, bounded by max_prompt_bytes: tokenizing megabytes takes seconds."""
    if not prompt:
        raise InvalidRequestError("prompt is empty: give at least one character", "prompt", ErrorKind.INVALID)
    limit = max_prompt_bytes
    if len(prompt) * 4 > limit and len(prompt.encode("utf-8")) > limit:
        raise InvalidRequestError(
            f"prompt is {len(prompt.encode('utf-8'))} bytes: the limit is max_prompt_bytes={limit} "
            f"(16 bytes per token of max_model_len={max_model_len} unless set)",
            "prompt",
            ErrorKind.LIMIT,
        )
    return tokenizer.encode(prompt).ids


def check_prompt_token_ids(prompt: list[int], vocab_size: int) -> list[int]:
    if not prompt:
        raise InvalidRequestError("prompt_token_ids is empty: give at least one token", "prompt", ErrorKind.INVALID)
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})", "prompt", ErrorKind.INVALID
        )
    return list(prompt)


def check_logit_bias_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every biased token is in the vocabulary."""
    bad = sorted(t for t in params.logit_bias or () if t >= vocab_size)
    if bad:
        raise InvalidRequestError(
            f"logit_bias has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})", "logit_bias"
        )


def check_fits(num_prompt: int, max_tokens: int, max_model_len: int, kv_capacity: int) -> None:
    """The prompt and every token it may grow to fit max_model_len and the whole KV cache."""
    if num_prompt >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {num_prompt} tokens; it must be shorter than max_model_len={max_model_len}",
            "prompt",
            ErrorKind.LIMIT,
        )
    total = num_prompt + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"max_tokens={max_tokens} is too large: prompt ({num_prompt} tokens) + max_tokens must be "
            f"<= max_model_len={max_model_len}, so max_tokens <= {max_model_len - num_prompt}",
            "max_tokens",
            ErrorKind.LIMIT,
        )
    if total > kv_capacity:
        raise InvalidRequestError(
            f"prompt ({num_prompt} tokens) + max_tokens={max_tokens} exceeds the KV cache capacity of "
            f"{kv_capacity} tokens",
            "max_tokens",
            ErrorKind.LIMIT,
        )


def check_params(cfg: EngineConfig, params: SamplingParams) -> None:
    """The engine's bounds on one request's parameters."""
    check_structured_outputs(cfg, params.structured_outputs)
    if params.logit_bias and len(params.logit_bias) > cfg.max_logit_bias:
        raise InvalidRequestError(
            f"logit_bias has {len(params.logit_bias)} entries: the limit is max_logit_bias={cfg.max_logit_bias}",
            "logit_bias",
            ErrorKind.LIMIT,
        )
    if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
        raise InvalidRequestError(
            f"logprobs={params.logprobs} is too large: the limit is max_logprobs={cfg.max_logprobs}",
            "logprobs",
            ErrorKind.LIMIT,
        )
    if len(params.stop) > cfg.max_stop_strings:
        raise InvalidRequestError(
            f"stop has {len(params.stop)} strings: the limit is max_stop_strings={cfg.max_stop_strings}",
            "stop",
            ErrorKind.LIMIT,
        )
    longest = max((len(s) for s in params.stop), default=0)
    if longest > cfg.max_stop_str_len:
        raise InvalidRequestError(
            f"stop has a string of {longest} characters: the limit is max_stop_str_len={cfg.max_stop_str_len}",
            "stop",
            ErrorKind.LIMIT,
        )
    if len(params.stop_token_ids) > cfg.max_stop_strings:
        raise InvalidRequestError(
            f"stop_token_ids has {len(params.stop_token_ids)} ids: the limit is "
            f"max_stop_strings={cfg.max_stop_strings}",
            "stop_token_ids",
            ErrorKind.LIMIT,
        )


def check_structured_outputs(cfg: EngineConfig, params: StructuredOutputsParams | None) -> None:
    """The complexity budget of a constraint, checked before it is compiled: its text's bytes and its nesting
    depth. A compile's time and memory grow with both."""
    if params is None:
        return
    kind = params.kind
    text = params.key[1]
    size = len(text.encode("utf-8"))
    if size > cfg.max_grammar_spec_bytes:
        raise InvalidRequestError(
            f"structured_outputs.{kind} is {size} bytes: the limit is max_grammar_spec_bytes="
            f"{cfg.max_grammar_spec_bytes}",
            "structured_outputs",
            ErrorKind.LIMIT,
        )
    depth = _spec_depth(kind, getattr(params, kind))
    if depth > cfg.max_grammar_depth:
        raise InvalidRequestError(
            f"structured_outputs.{kind} nests {depth} levels deep: the limit is max_grammar_depth="
            f"{cfg.max_grammar_depth}",
            "structured_outputs",
            ErrorKind.LIMIT,
        )


def _spec_depth(kind: str, spec: Any) -> int:
    """How deep a constraint nests: objects/arrays of a JSON schema; brackets of a regex or EBNF grammar."""
    if kind in ("json", "structural_tag"):
        depth, stack = 0, [(spec, 1)]
        while stack:
            value, d = stack.pop()
            if isinstance(value, (dict, list)):
                depth = max(depth, d)
                stack += [(v, d + 1) for v in (value.values() if isinstance(value, dict) else value)]
        return depth
    if kind in ("regex", "grammar"):
        depth = deepest = 0
        escaped = False
        for ch in spec:  # a bracket inside a string literal counts too: an over-estimate, never an under
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch in "([{":
                depth += 1
                deepest = max(deepest, depth)
            elif ch in ")]}":
                depth = max(0, depth - 1)
        return deepest
    return 1
