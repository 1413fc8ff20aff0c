"""A request for a LoRA adapter by name (vLLM's `LoRARequest`): the offline API's way to name one, and to
register it on first use."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MAX_LORA_NAME = 256  # characters of an adapter's name


def stable_lora_id(name: str) -> int:
    """A positive 31-bit id derived from the adapter's name: every replica gives the same adapter the same id, so a
    KV-aware router can match the `lora_id` of KV events across them."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") & 0x7FFFFFFF or 1


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int | None = None  # None: stable_lora_id(lora_name)
    lora_path: str | None = None  # a PEFT adapter directory; None: an adapter the engine already knows by name

    @property
    def lora_id(self) -> int:
        return self.lora_int_id if self.lora_int_id is not None else stable_lora_id(self.lora_name)
