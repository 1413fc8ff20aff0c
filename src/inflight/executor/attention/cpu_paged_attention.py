"""Paged decode attention for the CPU as a small C++ op (built once with `torch.utils.cpp_extension`).

The torch reference gathers each sequence's K/V blocks into a padded tensor in every layer before
SDPA: on a CPU that copy costs about as much as the attention itself. This op reads K/V in place
through the block table, one (sequence, KV head) per task, and serves the head's whole GQA group from
each K/V row it loads. Math in fp32 whatever the cache dtype (bf16 rows are widened in registers).
`TorchBackend`'s gather + SDPA path stays the oracle it is tested against.

The build needs a C++ compiler (gcc is on every supported machine); it is cached by torch under
`TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). If it cannot be built, `load()` returns
None and the backend keeps the reference path.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

template <typename scalar_t>
static void decode_kernel(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale) {
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0), table_stride = block_tables.stride(0);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), acc(G * D), scores, row(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lens[b];
      const int32_t* table = tables + b * table_stride;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          q[g * D + d] = to_f(q_ptr[b * q_stride + (h * G + g) * D + d]) * fscale;
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const scalar_t* k = k_ptr + ((int64_t(table[t / bs]) * bs + t % bs) * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_f(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = q.data() + g * D;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
          scores[g * L + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const scalar_t* v = v_ptr + ((int64_t(table[t / bs]) * bs + t % bs) * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_f(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          o_ptr[b * o_stride + (h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [B, Hq, D], rows contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2), "out: like query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(), "one dtype");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables: int32, rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens: int32 [B]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}
"""

_lock = threading.Lock()
_module: Any = None
_tried = False


def load() -> Any:
    """The compiled module, or None if this machine cannot build it (logged once)."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                from torch.utils.cpp_extension import load_inline

                _module = load_inline(
                    name="inflight_cpu_paged_attention_v1",
                    cpp_sources=_SOURCE,
                    functions=["paged_decode_attention"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"],
                )
            except Exception as exc:  # no compiler / headers: the reference path still works
                logger.warning("CPU paged attention op could not be built (%s); using gather + SDPA", exc)
    return _module


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= blocks used] int32, rows may be strided
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    _module.paged_decode_attention(out, query, k_cache, v_cache, block_tables, seq_lens, scale)
    return out
