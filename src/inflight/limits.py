"""The limits a request meets, as the model's configuration publishes them, with one rule for each default.

The engine resolves its limits with these rules; the OpenAI front and the Dynamo worker, which see the model
only over Triton, resolve the same figures from the same config.pbtxt parameters (`get_model_config`) and
the checkpoint (its context length). No dependencies: the fronts import it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PROMPT_BYTES_PER_TOKEN = 16  # max_prompt_bytes' default per token of max_model_len


def resolve_max_model_len(configured: int | None, native: int | None) -> int | None:
    """The configured length capped by the checkpoint's context length (either may be unknown)."""
    known = [n for n in (configured, native) if n]
    return min(known) if known else None


def default_max_prompt_bytes(max_model_len: int) -> int:
    """UTF-8 bytes of prompt text when max_prompt_bytes is not set: bounded before tokenizing, which takes
    seconds on megabytes."""
    return PROMPT_BYTES_PER_TOKEN * max_model_len


@dataclass(frozen=True)
class ModelLimits:
    """What a client of the served model can know before it sends a request. None: not known to it."""

    max_model_len: int | None
    max_prompt_bytes: int | None
    kv_capacity_tokens: int | None  # num_kv_blocks x block_size where num_kv_blocks is configured
    block_size: int | None
    num_kv_blocks: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str], native_max_model_len: int | None = None) -> ModelLimits:
        """From the model's config.pbtxt parameters (empty: the engine's default) and the checkpoint's
        context length."""
        number = {name: _int(parameters.get(name)) for name in _NUMBERS}
        max_model_len = resolve_max_model_len(number["max_model_len"], native_max_model_len)
        max_prompt_bytes = number["max_prompt_bytes"]
        if max_prompt_bytes is None and max_model_len is not None:
            max_prompt_bytes = default_max_prompt_bytes(max_model_len)
        blocks, block_size = number["num_kv_blocks"], number["block_size"]
        return cls(
            max_model_len,
            max_prompt_bytes,
            blocks * block_size if blocks and block_size else None,
            block_size,
            blocks,
            number["max_num_seqs"],
            number["max_num_batched_tokens"],
        )

    def max_tokens_after(self, num_prompt_tokens: int) -> int | None:
        """OpenAI's default max_tokens: the rest of the context, which the KV cache must hold too (the engine
        refuses a request that could never fit). None: unknown, or nothing is left."""
        known = [n for n in (self.max_model_len, self.kv_capacity_tokens) if n]
        if not known or num_prompt_tokens >= min(known):
            return None
        return min(known) - num_prompt_tokens


_NUMBERS = (
    "max_model_len",
    "max_prompt_bytes",
    "num_kv_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
)


def _int(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None
