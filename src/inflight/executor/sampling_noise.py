"""Seeded Gumbel noise for sampling: a key per (seed, output index), a hash per vocabulary id, and the noise
and Gumbel-max they give, with integer hashing only, so no RNG state is shared between rows or steps.

On a CPU both are one native pass (ops/csrc/cpu/gumbel.cpp, one function for either), so a token's noise is the
same bits whether its row is sampled over the whole vocabulary or over a top-k window; elsewhere torch ops.
"""

from __future__ import annotations

import math

import torch

from inflight.ops import cpu as cpu_ops

_CPU_CHUNK_ELEMENTS = 1 << 17

_M32 = 0xFFFFFFFF
# lowbias32 (C. Wellons, hash-prospector) on uint32 values held in int64 lanes. The second constant is
# stored minus 2**32: the low 32 bits of the product are the same and |value * constant| < 2**63.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)
_SEED_SALT = 0x243F6A88
_ID_SALT = 0x85A308D3


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche hash, in place."""
    x ^= x >> 16
    x.mul_(_C1).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_C2).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed < 2**63, output index): distinct steps of one seed get distinct keys."""
    k = _mix32_((seeds >> 32) ^ _SEED_SALT)
    k = _mix32_(k ^ (seeds & _M32))
    return _mix32_(k ^ (steps & _M32))


def id_hashes(ids: torch.Tensor) -> torch.Tensor:
    return _mix32_(ids.to(torch.int64) ^ _ID_SALT)


def _native(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and cpu_ops.available()


def gumbel_noise(keys: torch.Tensor, hashed_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [R, N] for row keys [R] and hashed vocab ids ([N] or [R, N])."""
    if _native(keys):  # one pass (gumbel.cpp), the same function as gumbel_argmax's on a CPU
        return cpu_ops.gumbel_noise(keys.contiguous(), hashed_ids.to(torch.int32).contiguous())
    x = _mix32_(keys[:, None] ^ hashed_ids)
    # -u with u = x / 2**32 kept inside (0, 1); E = -log1p(-u) is exact for small u, where the Gumbel
    # upper tail (rare tokens winning) is decided.
    f = x.to(torch.float32).mul_(-(2.0**-32)).clamp_(-(1.0 - 2.0**-24), -(2.0**-33))
    return f.log1p_().neg_().log_().neg_()


def gumbel_argmax(
    logits: torch.Tensor,
    temps: torch.Tensor,
    keys: torch.Tensor,
    hashed: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """argmax(logits / temperature + noise) per row over the whole vocabulary, among tokens whose scaled logit
    is >= the row's floor. On a CPU one pass a row (gumbel.cpp: the division rounds as torch's)."""
    if _native(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        floor = None if floor is None else floor.float().contiguous()
        return cpu_ops.gumbel_argmax(logits, temps.contiguous(), keys.contiguous(), hashed.to(torch.int32), floor)
    scaled = logits.float() / temps[:, None]

    def pick(rows: slice) -> torch.Tensor:
        score = gumbel_noise(keys[rows], hashed).add_(scaled[rows])
        if floor is not None:
            score.masked_fill_(scaled[rows] < floor[rows, None], -math.inf)
        return score.argmax(-1)

    if scaled.device.type != "cpu":
        return pick(slice(None))
    # On CPU the ~20 elementwise passes are memory bound: run them on row chunks that stay in cache.
    step = max(1, _CPU_CHUNK_ELEMENTS // scaled.shape[1])
    out = torch.empty(scaled.shape[0], dtype=torch.int64)
    for i in range(0, scaled.shape[0], step):
        out[i : i + step] = pick(slice(i, i + step))
    return out
