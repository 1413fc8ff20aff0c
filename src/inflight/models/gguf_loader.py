"""Load a GGUF file of a Llama, Qwen or Mixture-of-Experts model: each tensor either kept as the file's blocks
(for the packed-weight kernels) or dequantized at load to the engine's dtype.

llama.cpp's names map onto HF's (token_embd -> model.embed_tokens, blk.N.attn_q -> ...q_proj, ...). For the
`llama` architecture its converter stored Q and K with the rows of each head interleaved for its RoPE layout
(pairs (i, i+d/2) side by side); that permutation is undone here, as transformers' GGUF loader does (the Qwen
and OLMoE converters keep HF's order). Experts come stacked, [E, I, H] per projection: gate and up are joined
into the model's `w13`, down is its `w2` (always dequantized).
"""

from __future__ import annotations

import mmap
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from inflight.config import ConfigError
from inflight.model_source import gguf_metadata
from inflight.models.parallel import Shard
from inflight.models.quantized import GGUFWeight

# The tensor types this loader reads (gguf.quants dequantizes each of them; the block formats may stay packed).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TENSOR_TYPES = ("F32", "F16", "BF16")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_exps": "mlp.experts.w13",  # its first half
    "ffn_up_exps": "mlp.experts.w13",  # its second half
    "ffn_down_exps": "mlp.experts.w2",
}
# Architectures whose converter permuted Q and K (LlamaModel.permute)
_PERMUTED_QK = ("llama",)
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        return name if ".experts." in name else f"{name}.{m.group(3)}"  # the stacks are parameters themselves
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of a Q or K projection (rows = n_head * head_dim)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's HF name and GGUF type name (e.g. "Q4_K"); raises naming the first unsupported tensor."""
    reader = gguf_metadata(path).reader
    unsupported = [t for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES]
    if unsupported:
        which = ", ".join(f"{t.name} ({t.tensor_type.name})" for t in unsupported[:3])
        more = f" (+{len(unsupported) - 3} more)" if len(unsupported) > 3 else ""
        supported = ", ".join(SUPPORTED_TENSOR_TYPES)
        raise ConfigError(f"{path.name}: GGUF tensor type not supported: {which}{more}; supported: {supported}")
    types: dict[str, str] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ConfigError(f"{path.name}: unexpected GGUF tensor {t.name!r} for a llama model")
        types[name] = t.tensor_type.name
    return types


def read_tensors(
    path: Path,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device,
    keep_packed: frozenset[str] | set[str] = frozenset(),
    part_of: Callable[[str, tuple[int, int]], Shard | None] | None = None,
) -> dict[str, torch.Tensor | GGUFWeight]:
    """Every tensor of the file under its HF name: those named in `keep_packed` as their blocks (`GGUFWeight`,
    rows in HF order, on the CPU), the others dequantized, in `dtype` on `device`.

    `part_of(name, whole shape)`: the part of a tensor to read (a tensor-parallel rank's shard; None: all of it;
    not for experts). Only that part's blocks are read and dequantized: rows are whole blocks, columns are where
    the part starts and ends on block boundaries (else the tensor is dequantized whole, then sliced)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    tensor_types(path)  # the checks above
    meta = gguf_metadata(path)  # the parse the config and tokenizer already paid for
    reader, permutes = meta.reader, meta.architecture in _PERMUTED_QK
    out: dict[str, torch.Tensor | GGUFWeight] = {}
    experts: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        heads = num_heads if t.name.endswith("attn_q.weight") else num_kv_heads
        permuted = permutes and t.name.endswith(("attn_q.weight", "attn_k.weight"))
        expert = ".experts." in name
        part = part_of(name, shape) if part_of is not None and not expert else None
        raw = np.asarray(t.data).view(np.uint8).reshape(shape[0], -1)  # [rows, bytes]: whole blocks a row
        rows = np.arange(shape[0])
        if permuted:  # a permutation of whole rows: each row's blocks move as they are
            rows = unpermute_qk(torch.from_numpy(rows), heads).numpy()
        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        columns = None  # a column range to cut from the dequantized tensor
        if part is not None and part.dim == 0:
            rows = rows[part.start : part.start + part.size]
        elif part is not None and (part.start % block or part.size % block):
            columns = slice(part.start, part.start + part.size)
        elif part is not None:
            raw = raw[:, part.start // block * block_bytes : (part.start + part.size) // block * block_bytes]
        if permuted or (part is not None and part.dim == 0):
            raw = raw[rows]  # this part's rows only, copied out of the file
        if name in keep_packed:
            if columns is not None:
                raise ValueError(f"{name}: columns {columns} do not fall on {t.tensor_type.name} block boundaries")
            with warnings.catch_warnings():  # whole: a view of the file, only ever read (repacked or copied)
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(np.ascontiguousarray(raw))
            out[name] = GGUFWeight(int(t.tensor_type), blocks, (len(raw), raw.shape[1] // block_bytes * block))
            continue
        array = np.ascontiguousarray(dequantize(raw, t.tensor_type)).reshape(len(raw), -1)  # float32
        if columns is not None:
            array = np.ascontiguousarray(array[:, columns])
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
            array = array.copy()
        tensor = torch.from_numpy(array).reshape(shape if part is None else part.part_shape(shape))
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            experts[t.name] = tensor
            continue
        out[name] = tensor.to(device=device, dtype=dtype)
    for gate_name, gate in experts.items():  # each layer's gate and up experts as one [E, 2I, H] stack
        if gate_name.endswith("ffn_gate_exps.weight"):
            up = experts[gate_name.replace("ffn_gate_exps", "ffn_up_exps")]
            out[hf_name(gate_name)] = torch.cat([gate, up], dim=1).to(device=device, dtype=dtype)
    return out


def release_file_pages(path: Path) -> None:
    """Drop the file's pages this process touched while loading (the packed copies hold what is needed)."""
    data = getattr(gguf_metadata(path).reader, "data", None)
    mapping = getattr(data, "_mmap", None)
    if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)
