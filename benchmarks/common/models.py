"""Benchmark checkpoints: the demo model, a ~50M-parameter random Llama like the peers' figures used
(16 layers: the layers dominate), and one of similar size with a 32k vocabulary and 4 layers (the
embedding and lm_head dominate).

All are HF-format directories (config.json, model.safetensors, tokenizer.json) that inflight, HF
transformers and vLLM load unchanged, written deterministically and cached under `.cache/models/`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from inflight.demo_model import DEMO_CONFIG, SPECIAL_TOKENS, build_weights, write_demo_model

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
MODELS: dict[str, dict[str, Any]] = {"demo": {}, "llama50m": LLAMA_50M, "llama32k": LLAMA_32K, "llama1b": LLAMA_1B}

_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_SPACE = "Ġ"  # byte-level BPE's picture of a space


def num_parameters(cfg: dict) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * d * (2 * nq + 2 * nkv) + 3 * h * inter + 2 * h
    return cfg["num_hidden_layers"] * per_layer + 2 * v * h + h


def build_tokenizer(vocab_size: int, seed: int = 0, max_token_chars: int = 10) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` entries, so that every id a model of that
    vocabulary samples decodes to text. The merges are drawn, not trained: training on a generated
    corpus runs out of merges long before 32k, and drawing is deterministic across library versions
    (0.2 s for 32k). Tokens are the demo's specials, the 256 byte symbols, then letter strings with
    or without a leading space, each the concatenation of two earlier tokens (what BPE needs)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size={vocab_size} must be >= {len(vocab)} (specials and the 256 bytes)")
    rng = random.Random(seed)
    letters = list(_LETTERS)
    inner, starts = list(letters), [_SPACE]  # pieces that may follow another; pieces that begin a word
    merges = []
    while len(vocab) < vocab_size:
        left = rng.choice(starts) if rng.random() < 0.4 else rng.choice(inner)
        right = rng.choice(inner) if rng.random() < 0.5 else rng.choice(letters)
        token = left + right
        if token in vocab or len(token) > max_token_chars:
            continue
        vocab[token] = len(vocab)
        merges.append((left, right))
        (starts if token.startswith(_SPACE) else inner).append(token)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, byte_fallback=False))
    tok.add_special_tokens(SPECIAL_TOKENS)  # already in the vocabulary: this keeps their ids, marks them special
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS.index("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def write_llama(out_dir: str | Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """The demo checkpoint (tokenizer config, chat template) with its config and weights replaced by
    `shape`; a `vocab_size` in `shape` also replaces the demo tokenizer by `build_tokenizer` of that size."""
    out = write_demo_model(out_dir, seed)
    if not shape:
        return out
    cfg_path = out / "config.json"
    demo_vocab = json.loads(cfg_path.read_text())["vocab_size"]
    cfg_path.unlink()  # config.json marks a complete checkpoint: it goes back last
    cfg = dict(DEMO_CONFIG, vocab_size=demo_vocab) | shape
    if "vocab_size" in shape:
        build_tokenizer(shape["vocab_size"], seed).save(str(out / "tokenizer.json"))
    save_file(build_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def write_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: choose one of {', '.join(MODELS)} or pass a directory")
    return write_llama(out_dir, MODELS[name], seed)


def resolve_model(name_or_dir: str, cache_dir: Path = CACHE_DIR) -> Path:
    """A named benchmark model (written once into the cache) or an existing checkpoint directory."""
    if name_or_dir not in MODELS:
        path = Path(name_or_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json) nor one of {list(MODELS)}")
        return path
    path = cache_dir / name_or_dir
    return path if (path / "config.json").is_file() else write_model(name_or_dir, path)
