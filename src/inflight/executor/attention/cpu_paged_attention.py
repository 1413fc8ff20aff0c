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
#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// D is a compile-time constant for the common head sizes: the dot products and the V update then
// unroll into a few full-width FMAs (a runtime D left the loops scalar: ~2 GFLOP/s measured).
template <typename scalar_t, int64_t D_FIXED>
static void decode_kernel(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale) {
  const int64_t B = query.size(0), Hq = query.size(1);
  const int64_t D = D_FIXED > 0 ? D_FIXED : query.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const scalar_t* __restrict__ q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* __restrict__ k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* __restrict__ v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* __restrict__ o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0), table_stride = block_tables.stride(0);
  const int64_t row_stride = Hkv * D;  // between consecutive tokens of one head inside a block
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(G * D), accbuf(G * D), scores;
    float* __restrict__ q = qbuf.data();
    float* __restrict__ acc = accbuf.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lens[b];
      const int32_t* table = tables + b * table_stride;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          q[g * D + d] = to_f(q_ptr[b * q_stride + (h * G + g) * D + d]) * fscale;
      scores.resize(G * L);
      float* __restrict__ sc = scores.data();
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const scalar_t* __restrict__ kb = k_ptr + (int64_t(table[t0 / bs]) * bs * Hkv + h) * D;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* __restrict__ k = kb + i * row_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float* __restrict__ qg = q + g * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qg[d] * to_f(k[d]);
            sc[g * L + t0 + i] = s;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* __restrict__ sg = sc + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const scalar_t* __restrict__ vb = v_ptr + (int64_t(table[t0 / bs]) * bs * Hkv + h) * D;
        const int64_t n = std::min(bs, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* __restrict__ v = vb + i * row_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float p = sc[g * L + t0 + i];
            float* __restrict__ ag = acc + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += p * to_f(v[d]);
          }
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
    const int64_t D = query.size(2);
    if (D == 64) decode_kernel<scalar_t, 64>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    else if (D == 128) decode_kernel<scalar_t, 128>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    else if (D == 32) decode_kernel<scalar_t, 32>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    else decode_kernel<scalar_t, 0>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
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
    with torch.profiler.record_function("inflight::paged_decode_attention"):  # visible in op profiles
        _module.paged_decode_attention(out, query, k_cache, v_cache, block_tables, seq_lens, scale)
    return out
