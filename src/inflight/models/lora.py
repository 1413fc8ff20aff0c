"""LoRA adapters on the model's linears: per linear, `max_loras` device slots an adapter's A and B are
copied into; a step's rows each name a slot (or none), and the backend's `lora_apply` adds
B (A x) to the base linear's output for those rows (vLLM's punica layout, one shrink and one expand).

Fused projections (q/k/v, gate/up) take one A per slice and one B over all of their outputs; a slice the
adapter does not target stays zero. A and B are kept in fp32 with the adapter's scale folded into B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The fused linears of a layer that adapters can target, in the layer stack's order, and the HF module names
# (PEFT's target_modules) of each one's output slices.
LORA_LINEARS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LoRASlots:
    """One linear's adapter slots."""

    a: torch.Tensor  # fp32 [S, max_loras, max_rank, in_features]
    b: torch.Tensor  # fp32 [max_loras, out_features, max_rank], scale folded in
    offsets: torch.Tensor  # int64 [S+1] on the CPU: slice s owns outputs offsets[s]:offsets[s+1]

    @classmethod
    def empty(
        cls, slice_sizes: tuple[int, ...], in_features: int, max_loras: int, max_rank: int, device: torch.device
    ) -> LoRASlots:
        offsets = torch.tensor([0, *slice_sizes], dtype=torch.int64).cumsum(0)
        a = torch.zeros(len(slice_sizes), max_loras, max_rank, in_features, device=device)
        b = torch.zeros(max_loras, int(offsets[-1]), max_rank, device=device)
        return cls(a, b, offsets)

    def clear(self, slot: int) -> None:
        self.a[:, slot].zero_()
        self.b[slot].zero_()
