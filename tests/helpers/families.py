"""Tiny random checkpoints of the model families, made by HF transformers itself (the reference), with a
tokenizer of exactly their vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 300
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip

# architecture -> (transformers config class name, its family's fields)
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16, norm_topk_prob=True),
    ),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, eos_token_id=2, pad_token_id=1)),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),  # fmt: skip
    ),
}


def write_family(out_dir: Path, architecture: str, config_class: str, fields: dict[str, Any], seed: int = 0):
    """Save a random HF model of `architecture` (every weight drawn with std 0.2, so greedy tokens vary) and a
    tokenizer of its vocabulary; returns (directory, the HF model in fp32, eval mode)."""
    import transformers

    from inflight.random_llama import build_tokenizer

    cfg = getattr(transformers, config_class)(**(BASE | fields))
    cfg.architectures = [architecture]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    build_tokenizer(cfg.vocab_size, seed).save(str(Path(out_dir) / "tokenizer.json"))
    return Path(out_dir), model
