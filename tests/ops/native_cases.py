"""Every C++ CPU op on fixed seeded inputs, for the bit-for-bit check of the build (test_native_bits.py).

`outputs(ops, tmp)` runs each op through `ops` (an object with inflight.ops.cpu's functions) and the
one-call layer stack through `ModelRunner.cpu_forward` on a small random Llama written to `tmp`; it
returns every tensor the ops wrote, by name. `digests()` turns those into sha256 hex strings.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}
BLOCK = 8
# (context length, query tokens) per sequence: decode rows, a fresh prompt, a chunk after a cached prefix.
BATCH = [(37, 1), (11, 11), (29, 13), (BLOCK * 3, 1)]


def cpu_key() -> str:
    """What decides the build's machine code: the compiler, its -march=native target and the ISA flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    present = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if re.search(rf"\b{f}\b", flags)]
    try:
        version = subprocess.run(["c++", "-dumpversion"], capture_output=True, text=True, check=True).stdout.strip()
        target = subprocess.run(
            ["c++", "-march=native", "-Q", "--help=target"], capture_output=True, text=True, check=True
        ).stdout
        march = re.search(r"-march=\s+(\S+)", target).group(1)
    except (OSError, subprocess.CalledProcessError, AttributeError):
        version, march = "?", "?"
    return f"c++-{version}/{march}/{'+'.join(present) or 'no-avx512'}"


def digests(out: dict[str, torch.Tensor]) -> dict[str, str]:
    def sha(t: torch.Tensor) -> str:
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()

    return {name: sha(t) for name, t in sorted(out.items())}


def _ops_cases(ops: Any, name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    out: dict[str, torch.Tensor] = {}
    x, w = randn(33, 320), 1.0 + 0.1 * randn(320)
    out["rms_norm"] = ops.rms_norm(x, w, 1e-5)
    res = randn(33, 320)
    xa, ra = ops.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    out["fused_add_rms_norm.x"], out["fused_add_rms_norm.residual"] = xa, ra

    for d in (64, 48):  # a SIMD head size and one for the generic loop
        qkv = randn(19, (8 + 2 * 2) * d)
        q, k = qkv[:, : 8 * d].view(19, 8, d), qkv[:, 8 * d : 10 * d].view(19, 2, d)
        pos = torch.randint(0, 200, (19,), generator=g)
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = torch.arange(256, dtype=torch.float32)[:, None] * inv[None]
        ops.rope(q, k, pos, ang.cos(), ang.sin())
        out[f"rope.d{d}"] = qkv

        hq, hkv, blocks, bs = 8, 2, 12, 16
        k_cache, v_cache = randn(blocks, bs, hkv, d), randn(blocks, bs, hkv, d)
        key, value = randn(5, hkv, d), randn(5, hkv, d)
        slots = torch.randperm(blocks * bs, generator=g)[:5]
        ops.write_kv(key, value, k_cache, v_cache, slots)
        out[f"write_kv.d{d}.k"], out[f"write_kv.d{d}.v"] = k_cache, v_cache
        lens = torch.tensor([1, 7, 16, 17, 40, 100, 192], dtype=torch.int32)
        tables = torch.stack([torch.randperm(blocks, generator=g) for _ in lens]).to(torch.int32)
        query = randn(len(lens), hq, d)
        out[f"paged_attention.d{d}"] = ops.paged_attention(query, k_cache, v_cache, tables, lens, d**-0.5)

    out["silu_and_mul"] = ops.silu_and_mul(randn(21, 2 * 200))

    for m, n, k, bias in ((1, 100, 256, False), (13, 96, 320, True), (70, 200, 128, True)):
        weight, xs = randn(n, k), randn(m, k)
        b = randn(n) if bias else None
        out[f"linear.{m}x{n}x{k}"] = ops.linear(xs, ops.pack(weight), n, b)
    return {f"{name}/{key}": t for key, t in out.items()}


def _metadata(seq_lens: list[int], query_lens: list[int]):
    from inflight.executor.attention import AttentionMetadata

    lens = np.asarray(seq_lens, dtype=np.int64)
    nblk = -(-lens // BLOCK)
    tables = np.zeros((len(lens), int(nblk.max())), dtype=np.int32)
    first = np.concatenate([[0], np.cumsum(nblk)[:-1]])
    for row, (f, k) in enumerate(zip(first, nblk)):
        tables[row, :k] = np.arange(f, f + k)
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    positions = np.concatenate([np.arange(s - q, s) for s, q in zip(lens, query_lens)])
    rows = np.repeat(np.arange(len(lens)), query_lens)
    slots = tables[rows, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(lens.astype(np.int32)),
        block_tables=torch.from_numpy(tables),
        query_start_loc_np=qsl,
        seq_lens_np=lens,
    )
    return torch.from_numpy(positions), meta


def _layer_stack(tmp: Path, name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    from inflight.demo_model import build_weights
    from inflight.executor.model_runner import ModelRunner
    from inflight.models.loader import load_model

    path = tmp / "llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    save_file(build_weights(LLAMA, seed=0), str(path / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(path, dtype, torch.device("cpu"))
    runner = ModelRunner(model, 64, BLOCK, 256, dtype, torch.device("cpu"), "torch")
    if runner.cpu_forward is None:
        return {}
    g = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:  # the cached prefixes: anything but zeros
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    seq_lens, query_lens = zip(*BATCH)
    positions, meta = _metadata(list(seq_lens), list(query_lens))
    ids = torch.randint(0, LLAMA["vocab_size"], (len(positions),), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = {"llama_forward": runner.cpu_forward(ids, positions, meta)}
    for layer, (k, v) in enumerate(runner.kv_caches):
        out[f"llama_forward.k{layer}"], out[f"llama_forward.v{layer}"] = k, v
    return {f"{name}/{key}": t for key, t in out.items()}


def outputs(ops: Any, tmp: Path, supports: Any) -> dict[str, torch.Tensor]:
    """Every output on this machine; `supports(dtype)` says whether its GEMM runs that dtype."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype in DTYPES.items():
        if supports(dtype):
            out |= _ops_cases(ops, name, dtype)
            out |= _layer_stack(tmp, name, dtype)
    return out


if __name__ == "__main__":  # prints this machine's key and digests, a line for native_bits.json
    import tempfile

    from inflight.ops import cpu

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps({cpu_key(): digests(outputs(cpu, Path(tmp), lambda dt: cpu.gemm_supports(dt, 64)))}))
