"""Load a Llama-family GGUF file: tensors dequantized at load to the engine's dtype (no quantized compute).

llama.cpp's names map onto HF's (token_embd -> model.embed_tokens, blk.N.attn_q -> ...q_proj, ...), and
its converter stored Q and K with the rows of each head interleaved for its RoPE layout (pairs (i, i+d/2)
side by side); that permutation is undone here, as transformers' GGUF loader does.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from inflight.config import ConfigError
from inflight.model_source import gguf_metadata

# The tensor types this loader dequantizes (gguf.quants does the arithmetic).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

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
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of a Q or K projection (rows = n_head * head_dim)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_tensors(path: Path, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its HF name, dequantized, in `dtype` on `device`."""
    from gguf.quants import dequantize

    reader = gguf_metadata(path).reader  # the parse the config and tokenizer already paid for
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if unsupported:
        which = [t.name for t in reader.tensors if t.tensor_type.name in unsupported]
        more = f" (+{len(which) - 3} more)" if len(which) > 3 else ""
        raise ConfigError(
            f"{path.name}: GGUF tensor type(s) {', '.join(unsupported)} not supported (in {which[:3]}{more}); "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ConfigError(f"{path.name}: unexpected GGUF tensor {t.name!r} for a llama model")
        array = np.ascontiguousarray(dequantize(t.data, t.tensor_type))  # float32, shape reversed from ggml's
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
            array = array.copy()
        tensor = torch.from_numpy(array).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if t.name.endswith("attn_q.weight"):
            tensor = unpermute_qk(tensor, num_heads)
        elif t.name.endswith("attn_k.weight"):
            tensor = unpermute_qk(tensor, num_kv_heads)
        out[name] = tensor.to(device=device, dtype=dtype)
    return out
