"""Benchmark checkpoints: the demo model, or a ~50M-parameter random Llama like the peers' figures used.

Both are HF-format directories (config.json, model.safetensors, tokenizer.json) that inflight and HF
transformers load unchanged, written deterministically and cached under `.cache/models/`.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from inflight.demo_model import DEMO_CONFIG, build_weights, write_demo_model

CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "models"

# ~51M parameters: 16 layers x 3.15M + embeddings; GQA 8 query / 4 KV heads of 64, like the demo model's shape.
LLAMA_50M = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
MODELS = {"demo": {}, "llama50m": LLAMA_50M}


def num_parameters(cfg: dict) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * d * (2 * nq + 2 * nkv) + 3 * h * inter + 2 * h
    return cfg["num_hidden_layers"] * per_layer + 2 * v * h + h


def write_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """The demo checkpoint, with its config and weights replaced by the named shape (same tokenizer)."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: choose one of {', '.join(MODELS)} or pass a directory")
    out = write_demo_model(out_dir, seed)
    if not MODELS[name]:
        return out
    cfg_path = out / "config.json"
    cfg = dict(DEMO_CONFIG, vocab_size=json.loads(cfg_path.read_text())["vocab_size"], **MODELS[name])
    cfg_path.unlink()  # config.json marks a complete checkpoint: it goes back last
    save_file(build_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def resolve_model(name_or_dir: str, cache_dir: Path = CACHE_DIR) -> Path:
    """A named benchmark model (written once into the cache) or an existing checkpoint directory."""
    if name_or_dir not in MODELS:
        path = Path(name_or_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json) nor one of {list(MODELS)}")
        return path
    path = cache_dir / name_or_dir
    return path if (path / "config.json").is_file() else write_model(name_or_dir, path)
