"""Typed Python wrappers over the C++ CPU ops (`csrc/cpu`, built by `inflight.ops.native`).

Each op does its math in fp32 registers and rounds where HF rounds, row by row: a row's result never depends
on which other rows share its batch. The torch oracles are in `inflight.ops.reference`. Call `available()`
(or `gemm_supports`) first: the build takes a while, once per machine and source.
"""

from __future__ import annotations

import torch

from inflight.ops import native
from inflight.ops.native import record

PANEL = 48  # outputs per packed panel (gemm.h's NR)
# Work below which a GEMM runs on the calling thread (multiply-adds): waking a sleeping pool costs more.
MIN_MACS_PER_THREAD = 1 << 18


_module = None  # the built module, once loaded: the wrappers below skip the loader's lock


def load():
    """The compiled module, or None where it cannot be built."""
    global _module
    _module = native.load()
    return _module


def available() -> bool:
    """Whether the C++ ops built on this machine."""
    return load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    with record("rms_norm"):
        (_module or load()).rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, x = rms_norm(residual); returns (x, residual)."""
    with record("fused_add_rms_norm"):
        (_module or load()).fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rope(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query [T, Hq, D] and key [T, Hkv, D] in place (rows may be strided views) and returns them."""
    with record("rope"):
        (_module or load()).rope(query, key, positions, cos, sin)
    return query, key


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    with record("write_kv"):
        (_module or load()).write_kv(key, value, k_cache, v_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, up) -> silu(gate) * up, [T, I]."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    with record("silu_and_mul"):
        (_module or load()).silu_and_mul(out, x)
    return out


def paged_attention(
    query: torch.Tensor,  # [R, Hq, D]: R query rows (tokens); rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, >= blocks used] int32: each row's sequence's table
    seq_lens: torch.Tensor,  # [R] int32: each row's context length (its position + 1)
    scale: float,
    sliding_window: int | None = None,  # a row of length L sees keys L - W..L - 1; None: its whole context
) -> torch.Tensor:
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    with record("paged_attention"):
        (_module or load()).paged_attention(
            out, query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0
        )
    return out


def gemm_supports(dtype: torch.dtype, in_features: int) -> bool:
    """Whether our GEMM runs this dtype and width here (fp32: AVX-512, or AVX2 with FMA; bf16: AVX512-BF16 and an
    even K)."""
    module = load()
    if module is None:
        return False
    if dtype == torch.float32:
        return module.supports_f32()
    return dtype == torch.bfloat16 and in_features % 2 == 0 and module.supports_bf16()


def amx_for(in_features: int) -> bool:
    """Whether bf16 GEMMs of this width run on AMX tiles here: a CPU and kernel with AMX, K in whole 32s."""
    module = load()
    return module is not None and module.amx_for(in_features)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels of PANEL outputs, zero-padded past N: fp32 [P][K][48], bf16 [P][K/2][48][2]."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    if weight.dtype == torch.float32:
        return padded.view(panels, PANEL, k).permute(0, 2, 1).contiguous()
    return padded.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ the packed weight^T + bias -> [M, out_features], in x's dtype."""
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    with record("linear"):
        (_module or load()).linear(out, x, packed, bias, MIN_MACS_PER_THREAD)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (the first NaN where a row has one), torch.argmax's answer, of fp32 [B, V]."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    with record("argmax"):
        (_module or load()).argmax_rows(out, logits)
    return out


def gumbel_noise(keys: torch.Tensor, hashed: torch.Tensor) -> torch.Tensor:
    """Gumbel noise fp32 [R, N] for row keys int64 [R] and hashed vocab ids int32 ([N] or [R, N]): the sampler's
    hash and formula in one pass (gumbel.cpp)."""
    out = torch.empty((keys.shape[0], hashed.shape[-1]), dtype=torch.float32)
    with record("gumbel_noise"):
        (_module or load()).gumbel_noise(out, keys, hashed)
    return out


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    hashed: torch.Tensor,
    floor: torch.Tensor | None,
) -> torch.Tensor:
    """argmax(logits / temperature + gumbel_noise) per row of fp32 [R, V] (temperature fp32 [R], the division
    torch's), among tokens whose scaled logit is >= the row's floor (None: all)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    with record("gumbel_argmax"):
        (_module or load()).gumbel_argmax(out, logits, temperature, keys, hashed, floor)
    return out


def lora_apply(
    out: torch.Tensor,  # [T, N] fp32/bf16, rows contiguous: the base linear's output, added to in place
    x: torch.Tensor,  # [T, K], out's dtype: the linear's input
    a: torch.Tensor,  # fp32 [S, L, R, K]: per output slice and slot, the A rows
    b: torch.Tensor,  # fp32 [L, N, R]: per slot, B with the adapter's scale folded in
    offsets: torch.Tensor,  # int64 [S+1]: slice s owns outputs offsets[s]:offsets[s+1]
    token_slots: torch.Tensor,  # int32 [T]: each row's slot, -1 for none (its row is left as it is)
) -> None:
    """out[t, slice s] += B[slot] (A[s, slot] x[t]) for each row with an adapter: the shrink in fp32, the sum
    rounded once to out's dtype (`reference.lora_apply`'s semantics), each row in a fixed order."""
    with record("lora_apply"):
        # The op reads A and B transposed (models/lora.py stores them so: no copy there)
        a_t, b_t = a.transpose(2, 3).contiguous(), b.transpose(1, 2).contiguous()
        pad = -a_t.shape[3] % 16  # ranks in whole 16s: zero ranks add nothing
        if pad:
            a_t = torch.nn.functional.pad(a_t, (0, pad))
            b_t = torch.nn.functional.pad(b_t, (0, 0, 0, pad))
        (_module or load()).lora_apply(out, x, a_t, b_t, offsets, token_slots, MIN_MACS_PER_THREAD)


def moe_pack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FusedExperts' w13 [E, 2I, H] and w2 [E, H, I] (fp32 or bf16) in `fused_moe`'s panels (this build's vector
    width), made once at load: each gate panel beside its up panel, zero-padded past the outputs."""
    module = _module or load()
    return module.moe_pack(w13, True), module.moe_pack(w2, False)


def fused_moe(
    x: torch.Tensor,  # [T, H] fp32/bf16, rows contiguous
    packed: tuple[torch.Tensor, torch.Tensor],  # moe_pack(w13, w2), x's dtype
    topk_weights: torch.Tensor,  # fp32 [T, k]
    topk_ids: torch.Tensor,  # int32 [T, k]
) -> torch.Tensor:
    """Each token through its k experts' SwiGLU MLPs weighted by the router, `reference.fused_moe`'s rounding
    -> [T, H] in x's dtype; each output's sum runs in one fixed order, whatever shares the batch."""
    out = torch.empty(x.shape, dtype=x.dtype)
    with record("fused_moe"):
        (_module or load()).fused_moe(
            out, x, *packed, topk_weights.contiguous(), topk_ids.contiguous(), MIN_MACS_PER_THREAD
        )
    return out


# Router work below which its rows stay on the calling thread: a step's router is far below a pool wake-up's cost.
MIN_ROUTER_MACS_PER_THREAD = 1 << 22


def moe_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.select_experts` of x [T, H] @ weight [E, H]^T (x's dtype, rows contiguous) in one pass a row:
    (topk_weights fp32 [T, k], topk_ids int32 [T, k])."""
    weights = torch.empty((x.shape[0], top_k), dtype=torch.float32)
    ids = torch.empty((x.shape[0], top_k), dtype=torch.int32)
    with record("moe_route"):
        (_module or load()).moe_route(weights, ids, x, weight, renormalize, MIN_ROUTER_MACS_PER_THREAD)
    return weights, ids


_NO_SEGMENTS = torch.empty((0, 5), dtype=torch.int64)
_NO_SLOTS = torch.empty(0, dtype=torch.int32)


def llama_forward(
    out: torch.Tensor,  # [T, H]: the final norm's output
    h: torch.Tensor,  # [T, H]: the embeddings, used as scratch
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,  # [T, W] int32: each token's sequence's table
    seq_lens: torch.Tensor,  # [T] int32: each token's context length
    weights: list[torch.Tensor],  # 12 a layer, packed GEMM weights (layer_stack.cpp's WEIGHTS_PER_LAYER)
    kv_caches: list[torch.Tensor],  # k, v per layer
    final_norm: torch.Tensor,
    dims: tuple[int, int, int, int],  # Hq, Hkv, D, intermediate size
    eps: float,
    qk_eps: float,
    scale: float,
    segments: list[torch.Tensor] | None = None,  # GGUF-packed weights of the GEMMs whose slot is empty
    segment_table: torch.Tensor | None = None,  # int64 [segments, 5]: (layer, gemm 0-3, qtype, start, N) each
    lora: list[torch.Tensor] | None = None,  # (a, b, offsets) per layer and gemm 0-3 (three empty tensors: none)
    token_slots: torch.Tensor | None = None,  # int32 [T]: each token's adapter slot, -1 for none; None: no adapter
    moe: list[torch.Tensor] | None = None,  # (router, moe_pack'ed w13, w2) per layer (three empty tensors: dense)
    top_k: int = 0,
    renormalize: bool = False,
) -> torch.Tensor:
    """The Llama layer stack (dense or Mixture-of-Experts MLPs) as one call a step; returns `out`."""
    if segment_table is None:
        segments, segment_table = [], _NO_SEGMENTS
    if token_slots is None:
        token_slots = _NO_SLOTS
    with record("llama_forward"):
        (_module or load()).llama_forward(
            out, h, positions, cos, sin, slot_mapping, block_tables, seq_lens, weights, kv_caches, final_norm,
            *dims, eps, qk_eps, scale, segments, segment_table, lora or [], token_slots, moe or [], top_k, renormalize,
        )  # fmt: skip
    return out


# GGUF block types (gguf.GGMLQuantizationType codes) our GGUF GEMM computes as shipped, with the weights per block.
GGUF_CPU_TYPES: dict[int, int] = {8: 32, 2: 32, 3: 32, 6: 32, 7: 32, 12: 256, 13: 256, 14: 256}


def gguf_supports(qtype: int, dtype: torch.dtype, in_features: int) -> bool:
    """Whether our GGUF GEMM computes `qtype` blocks with `dtype` activations and this width here."""
    block = GGUF_CPU_TYPES.get(int(qtype))
    return block is not None and in_features % block == 0 and gemm_supports(dtype, in_features)


def gguf_pack(raw: torch.Tensor, qtype: int, out_features: int, in_features: int) -> torch.Tensor:
    """The file's rows, uint8 [N, row bytes], repacked once into the GEMM's panels (uint8, the same bytes a block)."""
    return (_module or load()).gguf_pack(raw.contiguous(), int(qtype), out_features, in_features)


def gguf_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    qtype: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ W^T + bias, W a `gguf_pack`ed weight, into `out` (may be a column slice of a
    wider output) or a new [M, out_features] tensor, in x's dtype."""
    if out is None:
        out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    with record("gguf_linear"):
        (_module or load()).gguf_linear(out, x, packed, int(qtype), out_features, x.shape[1], bias, MIN_MACS_PER_THREAD)
    return out


def gguf_embedding(
    ids: torch.Tensor, packed: torch.Tensor, qtype: int, num_rows: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` (int64 [T]) of a `gguf_pack`ed [num_rows, width] weight, dequantized -> [T, width] in `dtype`."""
    out = torch.empty((ids.shape[0], width), dtype=dtype)
    with record("gguf_embedding"):
        (_module or load()).gguf_embedding_rows(out, ids.contiguous(), packed, int(qtype), num_rows, width)
    return out


def shm_all_reduce(x: torch.Tensor, flags: torch.Tensor, slots: torch.Tensor, rank: int, timeout_s: float) -> None:
    """Contiguous fp32/bf16 `x` summed over the ranks of a shared-memory group in place (csrc/cpu/shm.h's
    `flags` and `slots`): in rank order, in fp32, rounded once; RuntimeError if a rank is late or the group
    aborted."""
    with record("shm_all_reduce"):
        (_module or load()).shm_all_reduce(x, flags, slots, rank, timeout_s)


def shm_gather(
    out: torch.Tensor | None, x: torch.Tensor, flags: torch.Tensor, slots: torch.Tensor, rank: int, timeout_s: float
) -> None:
    """Every rank's contiguous `x` into rank 0's `out` [size, *x.shape] (None on the other ranks)."""
    with record("shm_gather"):
        (_module or load()).shm_gather(out, x, flags, slots, rank, timeout_s)
