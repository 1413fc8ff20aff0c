"""Random Llama checkpoints of any shape: the demo checkpoint (tokenizer config, chat template) with its
config and weights replaced, and a byte-level BPE tokenizer of exactly the vocabulary asked for. HF
transformers and vLLM load them unchanged; the benchmarks' models and the wide-vocabulary tests use them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from inflight.demo_model import DEMO_CONFIG, SPECIAL_TOKENS, build_weights, write_demo_model

_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_SPACE = "Ġ"  # byte-level BPE's picture of a space


def num_parameters(cfg: dict) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    mlp = 3 * h * inter
    if cfg.get("num_experts"):  # a router and every expert (write_moe)
        mlp = cfg["num_experts"] * (h + 3 * h * cfg["moe_intermediate_size"])
    per_layer = h * d * (2 * nq + 2 * nkv) + mlp + 2 * h
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


def write_moe(out_dir: str | Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """A random Qwen3-MoE checkpoint: `write_llama`'s attention and tokenizer, every layer's MLP a router over
    `num_experts` SwiGLU experts of `moe_intermediate_size` (top `num_experts_per_tok`, renormalised)."""
    import torch

    out = write_llama(out_dir, shape, seed)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").unlink()
    cfg |= {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
    h, d, e, inter = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    weights = {k: v for k, v in build_weights(cfg, seed).items() if ".mlp." not in k}
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
        weights[p + "self_attn.k_norm.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
        weights[p + "mlp.gate.weight"] = torch.randn(e, h, generator=g) / h**0.5
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            weights[q + "gate_proj.weight"] = torch.randn(inter, h, generator=g) / h**0.5
            weights[q + "up_proj.weight"] = torch.randn(inter, h, generator=g) / h**0.5
            weights[q + "down_proj.weight"] = torch.randn(h, inter, generator=g) / inter**0.5
    save_file(
        {k: t.contiguous() for k, t in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
