"""LoRA adapters on the model's linears: per linear, `max_loras` device slots an adapter's A and B are
copied into; a step's rows each name a slot (or none), and the backend's `lora_apply` adds
B (A x) to the base linear's output for those rows (vLLM's punica layout, one shrink and one expand).

Fused projections (q/k/v, gate/up) take one A per slice and one B over all of their outputs; a slice the
adapter does not target stays zero. A and B are kept in fp32 with the adapter's scale folded into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inflight.models.config import ModelConfig

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
    """One linear's adapter slots. `a` and `b` are views of A and B stored transposed (`a_t`, `b_t`): the CPU op
    runs both steps as outer products over them; the rank is padded to a whole 16 with zeros."""

    a_t: torch.Tensor  # fp32 [S, max_loras, in_features, rank]
    b_t: torch.Tensor  # fp32 [max_loras, rank, out_features], scale folded in
    offsets: torch.Tensor  # int64 [S+1] on the CPU: slice s owns outputs offsets[s]:offsets[s+1]

    @property
    def a(self) -> torch.Tensor:
        """A: [S, max_loras, rank, in_features] (a view)."""
        return self.a_t.transpose(2, 3)

    @property
    def b(self) -> torch.Tensor:
        """B: [max_loras, out_features, rank] (a view)."""
        return self.b_t.transpose(1, 2)

    @classmethod
    def empty(
        cls, slice_sizes: tuple[int, ...], in_features: int, max_loras: int, max_rank: int, device: torch.device
    ) -> LoRASlots:
        offsets = torch.tensor([0, *slice_sizes], dtype=torch.int64).cumsum(0)
        rank = -(-max_rank // 16) * 16
        a_t = torch.zeros(len(slice_sizes), max_loras, in_features, rank, device=device)
        b_t = torch.zeros(max_loras, rank, int(offsets[-1]), device=device)
        return cls(a_t, b_t, offsets)

    def clear(self, slot: int) -> None:
        self.a_t[:, slot].zero_()
        self.b_t[slot].zero_()


_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_SLICE_OF = {name: (linear, i) for linear, names in LORA_LINEARS.items() for i, name in enumerate(names)}


class AdapterError(ValueError):
    """An adapter this model cannot take: the message names the adapter and why."""


@dataclass
class LoRAAdapter:
    """A PEFT LoRA adapter read into host memory: per (layer, HF module) its A [r, in] and B [out, r] in fp32,
    the scale (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into B."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_peft_adapter(name: str, path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """PEFT's `adapter_config.json` + `adapter_model.safetensors` from a directory, checked against the model
    (ranks, target modules, shapes); raises AdapterError naming the adapter."""
    root = Path(path)

    def refuse(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({root}): {why}")

    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise refuse(f"{f.name} is missing (a PEFT LoRA adapter directory holds adapter_config.json and "
                         "adapter_model.safetensors)")  # fmt: skip
    try:
        meta = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise refuse(f"adapter_config.json is not valid JSON ({e})") from None
    if meta.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type={meta['peft_type']!r}: only LORA adapters are served")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("rank_pattern", "rank_pattern"),
                     ("alpha_pattern", "alpha_pattern"), ("fan_in_fan_out", "fan_in_fan_out")):  # fmt: skip
        if meta.get(key):
            raise refuse(f"{why} is not supported")
    if meta.get("bias", "none") != "none":
        raise refuse(f"bias={meta['bias']!r} is not supported (only 'none')")
    rank, alpha = meta.get("r"), meta.get("lora_alpha", meta.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise refuse(f"adapter_config.json needs an integer r >= 1 and a number lora_alpha (r={rank!r})")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} exceeds max_lora_rank={max_lora_rank}")
    scale = alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            m = _PEFT_KEY.search(key)
            if m is None or m.group(2) not in _SLICE_OF:
                raise refuse(f"tensor {key!r} targets a module LoRA is not served on (q/k/v/o/gate/up/down "
                             "projections only)")  # fmt: skip
            layer = int(m.group(1))
            if layer >= cfg.num_hidden_layers:
                raise refuse(f"tensor {key!r}: the model has {cfg.num_hidden_layers} layers")
            parts.setdefault((layer, m.group(2)), {})[m.group(3)] = f.get_tensor(key).float()
    if not parts:
        raise refuse("adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        in_features, out_features = module_shape(cfg, module)
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise refuse(f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                         f"rank {rank} on a {in_features} -> {out_features} projection")  # fmt: skip
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    return LoRAAdapter(name, str(root), rank, weights)


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection of a layer."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (h, cfg.num_attention_heads * d),
        "k_proj": (h, cfg.num_key_value_heads * d),
        "v_proj": (h, cfg.num_key_value_heads * d),
        "o_proj": (cfg.num_attention_heads * d, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def attach_slots(model: Any, max_loras: int, max_rank: int, device: torch.device) -> None:
    """Give every fused linear of every layer `max_loras` empty adapter slots (zeros: no effect)."""
    cfg = model.cfg
    for layer in model.model.layers:
        owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn, "gate_up_proj": layer.mlp,
                  "down_proj": layer.mlp}  # fmt: skip
        for linear, modules in LORA_LINEARS.items():
            sizes = tuple(module_shape(cfg, m)[1] for m in modules)
            in_features = module_shape(cfg, modules[0])[0]
            slots = LoRASlots.empty(sizes, in_features, max_loras, max_rank, device)
            setattr(owners[linear], _slot_attr(linear), slots)


def install(model: Any, slot: int, adapter: LoRAAdapter | None) -> None:
    """Copy an adapter's weights into `slot` of every linear (None: clear the slot)."""
    for index, layer in enumerate(model.model.layers):
        for linear, modules in LORA_LINEARS.items():
            owner = layer.self_attn if linear in ("qkv_proj", "o_proj") else layer.mlp
            lora: LoRASlots = getattr(owner, _slot_attr(linear))
            lora.clear(slot)
            if adapter is None:
                continue
            for s, module in enumerate(modules):
                ab = adapter.weights.get((index, module))
                if ab is None:
                    continue
                a, b = ab
                lo, hi = int(lora.offsets[s]), int(lora.offsets[s + 1])
                lora.a[s, slot, : a.shape[0]].copy_(a)
                lora.b[slot, lo:hi, : b.shape[1]].copy_(b)


def _slot_attr(linear: str) -> str:
    return linear.removesuffix("_proj") + "_lora"
