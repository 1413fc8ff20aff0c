"""Load a model — all or nothing: an HF checkpoint directory (config.json, *.safetensors, tokenizer.json)
or a GGUF file (a .gguf, or a directory holding one; tensors dequantized by models/gguf_loader.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from inflight.config import ConfigError
from inflight.model_source import find_gguf, gguf_metadata
from inflight.models.config import ModelConfig, config_errors
from inflight.models.gguf_loader import read_tensors
from inflight.models.llama import LlamaForCausalLM
from inflight.models.packed_linear import pack_linears
from inflight.ops import cpu

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ConfigError(f"{index}: has no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists shard(s) that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors file (and no model.safetensors.index.json)")
    return files


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    with config_errors():
        gguf_file = find_gguf(model_dir)
        if gguf_file is not None:
            return gguf_metadata(gguf_file).tokenizer()
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing (only HF fast tokenizers, tokenizer.json, are supported)")
    return Tokenizer.from_file(str(path))


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: str | torch.device
) -> tuple[LlamaForCausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    with config_errors():
        gguf_file = find_gguf(model_dir)
    cfg = ModelConfig.load(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if gguf_file is not None:
        loaded = read_tensors(gguf_file, cfg.num_attention_heads, cfg.num_key_value_heads, dtype, device)
        for name, tensor in loaded.items():
            _check_tensor(gguf_file.name, name, tensor, expected, cfg, "the GGUF metadata")
    else:
        loaded = _read_safetensors(model_dir, cfg, expected, dtype, device)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConfigError(f"{model_dir}: checkpoint lacks tensor(s) {missing[:5]}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse_projections()
    # CPU fp32/bf16 only; a no-op elsewhere. A tied lm_head is packed too where our GEMM runs it (a copy of the
    # embedding: the output layer is a large share of a small model's decode step); else it keeps the tensor.
    skip = set()
    if cfg.tie_word_embeddings and not _pack_tied_head(model.lm_head):
        skip = {model.lm_head}
    pack_linears(model, skip=skip)
    model.eval().requires_grad_(False)
    return model, cfg


TIED_HEAD_COPY_MAX_BYTES = 1 << 30  # a larger tied embedding is not copied into a packed output layer


def _pack_tied_head(head: torch.nn.Linear) -> bool:
    w = head.weight
    if w.device.type != "cpu" or not cpu.gemm_supports(w.dtype, head.in_features):
        return False
    copy = w.numel() * w.element_size()
    if copy > TIED_HEAD_COPY_MAX_BYTES:
        logger.info("tied output layer left unpacked: packing would copy %.0f MiB", copy / 2**20)
        return False
    return True


def _check_tensor(file: str, name: str, tensor: torch.Tensor, expected: dict, cfg: ModelConfig, source: str) -> None:
    if name not in expected:
        raise ConfigError(f"{file}: unexpected tensor {name!r} for {cfg.architecture}")
    if tuple(tensor.shape) != tuple(expected[name].shape):
        raise ConfigError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, {source} implies {tuple(expected[name].shape)}"
        )


def _read_safetensors(model_dir: Path, cfg: ModelConfig, expected: dict, dtype, device) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected and cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue
                tensor = f.get_tensor(name)
                _check_tensor(path.name, name, tensor, expected, cfg, "config.json")
                loaded[name] = tensor.to(device=device, dtype=dtype)
    return loaded
