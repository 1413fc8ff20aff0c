"""Random PEFT LoRA adapters on a checkpoint, made by `peft` itself (the reference for multi-LoRA)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def _base(base) -> torch.nn.Module:
    """An HF model to wrap: loaded from a directory, or a copy of a model already loaded (PEFT changes it)."""
    if isinstance(base, torch.nn.Module):
        return copy.deepcopy(base)
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)


def make_adapter(base, out_dir: Path, rank: int, targets: list[str], seed: int, alpha: int | None = None,
                 scale: float = 1.0) -> str:  # fmt: skip
    """Save a random adapter on `base` (a checkpoint directory or a loaded HF model; A and B both random: PEFT's
    default B = 0 would change nothing) and return its directory. `scale` multiplies B, to make the adapter's
    effect on the logits large or small."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(_base(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def peft_model(base, adapter_dir: str):
    """HF's model with the adapter applied (PEFT's forward), fp32, eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(base), adapter_dir).eval()
