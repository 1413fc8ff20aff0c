"""Random PEFT LoRA adapters on a checkpoint, made by `peft` itself (the reference for multi-LoRA)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(base_dir: str, out_dir: Path, rank: int, targets: list[str], seed: int, alpha: int | None = None,
                 scale: float = 1.0) -> str:  # fmt: skip
    """Save a random adapter (A and B both random: PEFT's default B = 0 would change nothing) and return its
    directory. `scale` multiplies B, to make the adapter's effect on the logits large or small."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def peft_model(base_dir: str, adapter_dir: str):
    """HF's model with the adapter applied (PEFT's forward), fp32, eval mode."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
