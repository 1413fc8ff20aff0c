"""Load a model — all or nothing: an HF checkpoint directory (config.json, *.safetensors, tokenizer.json)
or a GGUF file (a .gguf, or a directory holding one): its quantized linears and embedding kept as the file's
blocks where a kernel computes them (`weight_format`), the other tensors dequantized by models/gguf_loader.py."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from inflight.config import ConfigError
from inflight.model_source import find_gguf, gguf_metadata
from inflight.models.config import ModelConfig, config_errors
from inflight.models.gguf_loader import FLOAT_TENSOR_TYPES, read_tensors, release_file_pages, tensor_types
from inflight.models.llama import LlamaForCausalLM
from inflight.models.moe import ExpertStacker, MoEForCausalLM
from inflight.models.packed_linear import pack_linears
from inflight.models.parallel import SINGLE, Shard, TensorParallel, check_sizes, local_part, pad_part, shard_of
from inflight.models.quantized import GGUFWeight, QuantizedEmbedding, QuantizedLinear, packed_kernel_available
from inflight.models.registry import model_class
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


WEIGHT_FORMATS = ("auto", "packed", "dequantized")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    weight_format: str = "auto",
    tp: TensorParallel = SINGLE,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`weight_format` (GGUF files): `packed` keeps every quantized linear and embedding as its blocks (an error
    names a tensor no kernel here computes), `dequantized` none, `auto` those a kernel computes on this device.
    `tp`: this rank's shard only (models/parallel.py), read without the rest of each tensor (a GGUF's blocks
    too, kept or dequantized)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"weight_format={weight_format!r} is invalid: must be one of {', '.join(WEIGHT_FORMATS)}")
    model_dir = Path(model_dir)
    device = torch.device(device)
    with config_errors():
        gguf_file = find_gguf(model_dir)
    cfg = ModelConfig.load(model_dir)
    cls = model_class(cfg.architecture)
    if tp.size > 1:
        check_tensor_parallel(cfg, tp.size)
    with torch.device("meta"):
        model = cls(cfg, tp) if tp.size > 1 else cls(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    packed: dict[str, GGUFWeight] = {}
    if gguf_file is not None:
        source = "the GGUF metadata"
        types = tensor_types(gguf_file)
        keep = packed_groups(gguf_file.name, types, model, dtype, device, weight_format)
        part_of = _part_picker(model, expected, gguf_file.name, source) if tp.size > 1 else None
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
        loaded = read_tensors(gguf_file, *heads, dtype, device, keep, part_of)
        if part_of is not None:  # parts shorter than their parameter: the vocabulary's last, a row-parallel bias
            loaded = {name: _padded(model, name, value, expected) for name, value in loaded.items()}
        for name, tensor in loaded.items():
            _check_tensor(gguf_file.name, name, tuple(tensor.shape), expected, cfg, source)
        packed = {name: w for name, w in loaded.items() if isinstance(w, GGUFWeight)}
        loaded = {name: t for name, t in loaded.items() if not isinstance(t, GGUFWeight)}
    else:
        loaded = _read_safetensors(model_dir, model, expected, dtype, device, sharded=tp.size > 1)
    missing = sorted(set(expected) - set(loaded) - set(packed))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConfigError(f"{model_dir}: checkpoint lacks tensor(s) {missing[:5]}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    _install_packed(model, packed, dtype, device)
    if cfg.tie_word_embeddings and not isinstance(model.model.embed_tokens, QuantizedEmbedding):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse_projections()
    # CPU fp32/bf16 only; a no-op elsewhere. A tied lm_head is packed too where our GEMM runs it (a copy of the
    # embedding: the output layer is a large share of a small model's decode step); else it keeps the tensor.
    skip = set()
    if cfg.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear) and not _pack_tied_head(model.lm_head):
        skip = {model.lm_head}
    pack_linears(model, skip=skip)
    model.eval().requires_grad_(False)
    if gguf_file is not None and packed:
        release_file_pages(gguf_file)
    return model, cfg


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ConfigError unless `size` ranks can split this model."""
    if not getattr(model_class(cfg.architecture), "supports_tensor_parallel", False):
        raise ConfigError(
            f"tensor_parallel_size={size}: {cfg.architecture} is not split across ranks (the dense families are: "
            "Llama, Mistral, Qwen2, Qwen3, Gemma 3); use tensor_parallel_size=1"
        )
    check_sizes(cfg, size)


def _part_picker(model: torch.nn.Module, expected: dict, file: str, source: str):
    """For read_tensors: the whole tensor's shape checked against the config, then the part this rank reads."""
    cfg = model.cfg

    def part_of(name: str, shape: tuple[int, int]) -> Shard | None:
        shard = shard_of(model, name) if name in expected else None
        if shard is not None:
            _check_tensor(file, name, shape, expected, cfg, source, shard)
        return shard

    return part_of


def _padded(model: torch.nn.Module, name: str, value, expected: dict):
    """A rank's part zero-padded to its parameter's shape (zero bytes are zero weights in every block format)."""
    shard = shard_of(model, name) if name in expected else None
    if shard is None:
        return value
    shape = tuple(expected[name].shape)
    if not isinstance(value, GGUFWeight):
        return pad_part(value, shard, shape)
    missing = shape[0] - value.shape[0]  # blocks are split by rows only
    if missing <= 0:
        return value
    data = torch.cat([value.data, value.data.new_zeros(missing, value.data.shape[1])])
    return GGUFWeight(value.qtype, data, (shape[0], value.shape[1]))


# Modules built from GGUF blocks: the HF names of their parts, fused along the outputs in this order.
def _groups(model: LlamaForCausalLM) -> dict[str, tuple[str, ...]]:
    groups: dict[str, tuple[str, ...]] = {"model.embed_tokens": ("model.embed_tokens.weight",)}
    if not model.cfg.tie_word_embeddings:
        groups["lm_head"] = ("lm_head.weight",)
    for i in range(len(model.model.layers)):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        groups[f"{attn}.qkv_proj"] = tuple(f"{attn}.{p}_proj.weight" for p in "qkv")
        groups[f"{attn}.o_proj"] = (f"{attn}.o_proj.weight",)
        groups[f"{mlp}.gate_up_proj"] = (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")
        groups[f"{mlp}.down_proj"] = (f"{mlp}.down_proj.weight",)
    return groups


def packed_groups(
    file: str, types: dict[str, str], model: LlamaForCausalLM, dtype: torch.dtype, device, weight_format: str
) -> set[str]:
    """The tensors to keep as blocks: every part of a module whose parts are all block-quantized with a kernel
    for them on `device` in `dtype` (`auto`); `packed` raises naming a part without one."""
    if weight_format == "dequantized":
        return set()
    state = model.state_dict()
    keep: set[str] = set()
    for parts in _groups(model).values():
        quantized = [p for p in parts if p in types and types[p] not in FLOAT_TENSOR_TYPES]
        if not quantized:
            continue
        in_features = state[parts[0]].shape[1]
        missing = [p for p in quantized if not packed_kernel_available(types[p], dtype, device, in_features)]
        if weight_format == "packed" and missing:
            raise ConfigError(
                f"{file}: weight_format='packed' but no {device.type} kernel computes {missing[0]} "
                f"({types[missing[0]]}) in {str(dtype).removeprefix('torch.')}; use weight_format='auto' or "
                "'dequantized'"
            )
        if len(quantized) == len(parts) and not missing:
            keep.update(parts)
    summary = sorted({types[p] for p in keep})
    logger.info(
        "weights: %d tensors kept as GGUF blocks (%s), %d dequantized to %s",
        len(keep),
        ", ".join(summary) or "none",
        len(types) - len(keep),
        str(dtype).removeprefix("torch."),
    )
    return keep


def _install_packed(model: LlamaForCausalLM, packed: dict[str, GGUFWeight], dtype: torch.dtype, device) -> None:
    """Put the modules computed on blocks in place of their meta-device HF modules (before fusing)."""
    for module_name, parts in _groups(model).items():
        if parts[0] not in packed:
            continue
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weights = [packed[p] for p in parts]
        if attr == "embed_tokens":
            # A rank's rows from its vocabulary's start; the padding rows past the vocabulary are never looked up
            meta = parent.embed_tokens
            tp, start = getattr(meta, "tp", SINGLE), getattr(meta, "vocab_start", 0)
            embedding = QuantizedEmbedding.from_gguf(weights[0], dtype, device, tp, start)
            parent.embed_tokens = embedding
            if model.cfg.tie_word_embeddings:
                model.lm_head = embedding.lm_head()
            continue
        names = [p.removesuffix(".weight").rpartition(".")[2] for p in parts]  # the HF-named modules it replaces
        # Their biases (loaded as tensors: Qwen2's q/k/v), concatenated as the fused linear's outputs are.
        biases = [getattr(parent, name).bias for name in names]
        bias = torch.cat(biases) if biases[0] is not None else None
        setattr(parent, attr, QuantizedLinear.from_gguf(weights, dtype, device, bias=bias))
        for name in names:
            if name != attr and hasattr(parent, name):
                delattr(parent, name)


def release_load_memory() -> None:
    """After the model and tokenizer are loaded: forget the parsed GGUF metadata (its vocabulary arrays) and hand
    the heap that loading freed back to the OS, so the process's resident size is what it holds."""
    gguf_metadata.cache_clear()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds once (a tied head counted with its embedding)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and id(module) not in seen:
            seen.add(id(module))
            total += module.weight_bytes()
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False), *_packed_of(module)]:
            if tensor.is_mkldnn or tensor.layout != torch.strided:  # oneDNN's packed weight: opaque, no storage
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
                continue
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += tensor.untyped_storage().nbytes()
    return total


def _packed_of(module: torch.nn.Module) -> list[torch.Tensor]:
    packed = getattr(module, "packed", None)
    return [packed] if isinstance(packed, torch.Tensor) else []


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


def _check_tensor(
    file: str,
    name: str,
    shape: tuple[int, ...],
    expected: dict,
    cfg: ModelConfig,
    source: str,
    shard: Shard | None = None,
) -> None:
    """`shape`: the checkpoint tensor's; `shard`: the part of it this rank holds (then it is checked whole)."""
    if name not in expected:
        raise ConfigError(f"{file}: unexpected tensor {name!r} for {cfg.architecture}")
    want = tuple(expected[name].shape)
    if shard is not None:
        want = shard.checkpoint_shape(want)
    if tuple(shape) != want:
        raise ConfigError(f"{file}: tensor {name!r} has shape {tuple(shape)}, {source} implies {want}")


def _read_safetensors(
    model_dir: Path, model: LlamaForCausalLM, expected: dict, dtype, device, sharded: bool = False
) -> dict:
    cfg = model.cfg
    loaded: dict[str, torch.Tensor] = {}
    rename = getattr(model, "checkpoint_name", None)
    experts = ExpertStacker(model, dtype, device) if isinstance(model, MoEForCausalLM) else None
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if stored.endswith(_IGNORED_SUFFIXES):
                    continue
                name = rename(stored) if rename else stored
                if name not in expected and cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue
                shard = shard_of(model, name) if sharded and name in expected else None
                if shard is not None:  # this rank's rows or columns, read without the rest of the tensor
                    part = f.get_slice(stored)
                    _check_tensor(path.name, name, tuple(part.get_shape()), expected, cfg, "config.json", shard)
                    loaded[name] = local_part(part, shard, tuple(expected[name].shape)).to(device=device, dtype=dtype)
                    continue
                tensor = f.get_tensor(stored)
                if experts is not None and experts.take(name, tensor):
                    continue
                _check_tensor(path.name, name, tuple(tensor.shape), expected, cfg, "config.json")
                loaded[name] = tensor.to(device=device, dtype=dtype)
    if experts is not None:
        loaded |= experts.finish()
    return loaded
