"""The embedded demo model: a small Llama-architecture HF checkpoint written deterministically.

No weights can be downloaded here, so the package makes its own: a byte-level BPE tokenizer trained on
a generated corpus and random weights scaled so the next-token distribution is sharp (greedy decoding
is then decided by the model, not by float noise). It loads unchanged in HF transformers.

    python -m inflight.demo_model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Bump when the generated checkpoint changes, so the cached copy (`cached_demo_model`) is rebuilt.
DEMO_MODEL_VERSION = 2
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": None,  # set to the trained tokenizer's size so every id the model emits decodes
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

# A Zephyr-style chat template (as in HF's tokenizer_config.json): the OpenAI front renders it for
# /v1/chat/completions. The tokenizer adds <s> itself, so the front drops the template's leading bos_token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the demo chat template knows the roles system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORDS = """
the a an of to in on at by for with from into over under model token batch block cache request
stream server engine kernel memory queue step sequence prompt answer river mountain city light
night morning story music garden window ocean forest bright quiet fast slow small large new old
red blue green warm cold runs flows sings reads writes builds waits moves turns grows falls
rises shines learns keeps sends gives takes finds makes sees knows thinks and but or so because
while when where which that this those these it they we you he she is are was were be been has
have had will would can could should may might must not very more most
""".split()  # noqa: SIM905 - a word list reads better as text
_MULTIBYTE = ["héllo", "wörld", "café", "naïve", "日本語", "東京", "über", "señor", "🙂", "🚀", "Ωmega", "π"]


def _corpus(seed: int = 0, sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), rng.choice(_MULTIBYTE))
        lines.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","]))
    return lines


def build_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = SPECIAL_TOKENS.index("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def _fragment_token_ids(tok: Tokenizer) -> list[int]:
    """Tokens that decode to a piece of a multi-byte character or a control byte on their own."""
    ids = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text or not text.isprintable():
            ids.append(i)
    return ids


def build_weights(cfg: dict, seed: int = 0, quiet_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        # Unit-variance-preserving init (std 1/sqrt(fan_in)) so every layer moves the residual stream.
        return torch.randn(rows, cols, generator=g) * (gain / cols**0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    weights = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(nq * d, h, 2.0),
            p + "self_attn.k_proj.weight": w(nkv * d, h, 2.0),
            p + "self_attn.v_proj.weight": w(nkv * d, h),
            p + "self_attn.o_proj.weight": w(h, nq * d),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    weights["model.norm.weight"] = norm(h)
    # A large output gain makes the next-token distribution sharp: top-1 margins far above float noise.
    weights["lm_head.weight"] = w(v, h, 6.0)
    if quiet_ids:
        # Byte fragments rarely win, so the demo's text reads as words rather than broken characters.
        weights["lm_head.weight"][quiet_ids] *= 0.25
    return {k: t.contiguous() for k, t in weights.items()}


def write_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = dict(DEMO_CONFIG, vocab_size=tok.get_vocab_size())
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "model_max_length": cfg["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2)
    )
    save_file(
        build_weights(cfg, seed, _fragment_token_ids(tok)), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    # config.json last: its presence marks a complete checkpoint for callers that create it lazily.
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def cached_demo_model() -> Path:
    """The embedded default, written once under $INFLIGHT_CACHE_DIR (~/.cache/inflight); atomic, so
    concurrent servers agree. The directory name carries DEMO_MODEL_VERSION: a changed generator rebuilds."""
    cache = Path(os.environ.get("INFLIGHT_CACHE_DIR") or Path.home() / ".cache" / "inflight")
    target = cache / f"demo_model-v{DEMO_MODEL_VERSION}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo_model-", dir=cache))
    write_demo_model(tmp)
    try:
        tmp.rename(target)
    except OSError:  # someone else finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_demo_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    return out if (out / "config.json").is_file() else write_demo_model(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_demo_model(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
