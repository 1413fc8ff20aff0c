"""The torch oracles, one per op: the C++ CPU ops and the Triton kernels are tested against these, and
`TorchBackend`'s plain-torch path runs them where no kernel does. Numerics follow HF: a value is rounded to
the activations' dtype wherever HF rounds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, bit-identical to the HF steps below in fp32
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # HF's order in half precision: normalise in fp32, round to the activations' dtype, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum, rounded to the activations' dtype, is the new residual."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rope_tables(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token [T, 1, D] cos and signed sin (rotate_half's sign folded in), cast to `dtype` as HF casts them."""
    cos, sin = cos[positions], sin[positions]  # each [T, D/2]
    return (
        torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
        torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate-half: x * cos + rotate_half(x) * sin, with `rope_tables`' tables."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def rope(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, D/2] float32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated (query, key), out of place."""
    c, s = rope_tables(positions, cos, sin, query.dtype)
    return apply_rope(query, c, s), apply_rope(key, c, s)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; a negative slot is skipped
) -> None:
    block_size = k_cache.shape[1]
    for tok, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[tok]
            v_cache[slot // block_size, slot % block_size] = value[tok]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, up halves of the fused projection) -> silu(gate) * up, [T, I]."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> gelu(gate, tanh approximation) * up, [T, I]: Gemma's GeGLU (HF's `gelu_pytorch_tanh`)."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def paged_attention(
    query: torch.Tensor,  # [N, Hq, D]: sequence b's queries are the last q_len of its seq_lens[b] positions
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    sliding_window: int | None = None,  # HF's: the query at i sees keys i - W < j <= i; None: all j <= i
) -> torch.Tensor:
    """Per sequence: gather its context through the block table, causal softmax in fp32. Only keys some
    query sees are gathered: positions before every query's window are never read."""
    out = torch.empty_like(query)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        first_q = seq_len - (end - start)
        first_key = max(0, first_q - sliding_window + 1) if sliding_window else 0
        pos = torch.arange(first_key, seq_len, device=query.device)
        slots = block_tables[b].long()[pos // block_size]
        k = k_cache[slots, pos % block_size].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots, pos % block_size].float().repeat_interleave(group, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(first_q, seq_len, device=query.device)
        hidden = pos[None, :] > q_pos[:, None]
        if sliding_window:
            hidden |= pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Split-K decode's partial results [S, ...] merged by their base-2 log-sum-exps."""
    weight = torch.softmax(partial_lse * torch.log(torch.tensor(2.0)), dim=0)  # base-2 lse -> natural
    weight = torch.nan_to_num(weight)
    return (partial_out * weight[..., None]).sum(0)


def gguf_weight(raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """GGUF rows uint8 [N, row_bytes] -> fp32 [N, in_features], by `gguf.quants.dequantize`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weight = dequantize(raw.cpu().numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(weight).reshape(raw.shape[0], in_features).to(raw.device)


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
    """x @ W^T for GGUF rows `raw`: W dequantized to fp32, the product in fp32, rounded once to x's dtype."""
    weight = gguf_weight(raw, qtype, x.shape[1])
    assert weight.shape[0] == out_features
    return (x.float() @ weight.T).to(x.dtype)


def gguf_embedding(
    ids: torch.Tensor, raw: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """The rows `ids` of a GGUF table, dequantized in fp32 and rounded to dtype."""
    return gguf_weight(raw[ids.reshape(-1).long()], qtype, embedding_dim).to(dtype)


def lora_apply(
    out: torch.Tensor,  # [T, N] in the model's dtype: the base linear's output, added to in place
    x: torch.Tensor,  # [T, K]: the linear's input
    lora_a: torch.Tensor,  # fp32 [S, L, R, K]: per output slice, per adapter slot, the A rows (zero past its rank)
    lora_b: torch.Tensor,  # fp32 [L, N, R]: per slot, B with the adapter's scale folded in
    offsets: torch.Tensor,  # int64 [S+1]: slice s owns outputs offsets[s]:offsets[s+1]
    token_slots: torch.Tensor,  # int32 [T]: each row's slot, -1 for none (its row is left as it is)
) -> None:
    """out[t, slice s] += B[slot] (A[s, slot] x[t]) for every row t with an adapter; the shrink's result stays
    fp32 and the sum is rounded once into out's dtype (vLLM's punica ops keep the same fp32 intermediate)."""
    rows = torch.nonzero(token_slots >= 0).flatten()
    if rows.numel() == 0:
        return
    slots = token_slots[rows].long()
    xf = x[rows].float()
    acc = out[rows].float()
    bounds = offsets.tolist()
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        shrunk = torch.einsum("tk,trk->tr", xf, lora_a[s, slots])  # [n, R]
        acc[:, lo:hi] += torch.einsum("tr,tnr->tn", shrunk, lora_b[slots, lo:hi])
    out[rows] = acc.to(out.dtype)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router: softmax in fp32 over all experts, the top-k, renormalised to sum 1 where the config says.
    Returns (topk_weights fp32 [T, k], topk_ids int32 [T, k]); ties go to the lower expert id (torch.topk)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]: each expert's down projection
    topk_weights: torch.Tensor,  # fp32 [T, k]
    topk_ids: torch.Tensor,  # int32 [T, k]
) -> torch.Tensor:  # [T, H], x's dtype
    """Each token through its k experts' SwiGLU MLPs, weighted by the router. Every expert's MLP rounds as HF's
    does (gate/up, the activation, down, each in x's dtype); the k weighted outputs are summed in fp32 in top-k
    order and rounded once, so a token's result depends on nothing but its own row."""
    inter = w13.shape[1] // 2
    weighted = torch.zeros((*topk_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)  # [T, k, H]
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = x[rows] @ w13[e].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        weighted[rows, slot] = (act @ w2[e].t()).float() * topk_weights[rows, slot][:, None]
    out = weighted[:, 0].clone()
    for j in range(1, weighted.shape[1]):
        out += weighted[:, j]
    return out.to(x.dtype)
