"""The CPU hot path as a few small C++ ops (built once with `torch.utils.cpp_extension`), as vLLM's CPU backend has.

A decode step of a 16-layer model ran ~530 aten ops, most of them elementwise pieces of RMSNorm, RoPE
and SiLU, each a Python dispatch and a pass over memory. Here each of those is one op that does its
math in fp32 registers and rounds once where HF rounds (so bf16 results stay next to HF's):
- `rms_norm`, `fused_add_rms_norm` (the residual add rounded to the activations' dtype, as HF adds);
- `rope` (in place on q and k, which may be strided views into the fused qkv output) and `write_kv`;
- `silu_and_mul` over the fused gate/up output;
- `paged_attention`: every query token is a row with its own block table and context length (a prompt
  token at position p attends to 0..p exactly as a decode step at p would); K/V read in place through
  the block table (no gather into a padded tensor, which cost as much as the attention itself), one
  pass with an online softmax per block, each K/V row loaded once for the head's whole GQA group.
Every op works row by row: a row's result never depends on which other rows share its batch.
`TorchBackend`'s plain-torch path stays the oracle these are tested against. Each op's body is a function
over a range of rows (`*_rows`, `attention_tasks`) that `executor/cpu_forward.py` also builds into its
one-call layer stack, so both run the same code.

The build needs a C++ compiler (gcc is on every supported machine; `inflight.native_build` caches it per
source and CPU). If it cannot be built, `load()` returns None and the backend keeps the plain-torch path.
"""

from __future__ import annotations

from typing import Any

import torch

from inflight import native_build

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Conversions the compiler can vectorize: bf16 is the top half of an fp32; back with round-to-nearest-even.
// NaN is tested on the bits, since -ffast-math may fold a float x != x test away.
static inline float to_f(float x) { return x; }
static inline float to_f(c10::BFloat16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float to_f(c10::Half x) { return static_cast<float>(x); }
static inline float to_f(double x) { return static_cast<float>(x); }  // dispatched, never used by the engine
template <typename T> static inline T from_f(float f) { return static_cast<T>(f); }
template <> inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  c10::BFloat16 r;
  r.x = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return r;
}
// The value HF would hold after rounding to the activations' dtype (identity in fp32).
template <typename T> static inline float round_to(float f) { return to_f(from_f<T>(f)); }

#define DISPATCH(TYPE, NAME, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// Rows per parallel chunk: below ~32k elements an op runs on the calling thread. Waking the pool costs
// tens of microseconds (more with OMP_WAIT_POLICY=PASSIVE), far more than such an op's own work.
static inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

static void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with contiguous rows");
}

// ---- RMSNorm: HF's order (x * rsqrt(mean(x^2) + eps), rounded, then * weight, rounded) ----
// The *_rows functions are the ops' bodies over a range of rows, shared by the ops below (one parallel
// region each) and by cpu_forward's layer stack (one region a step). noinline: both callers then run the
// same machine code, so a row's bits cannot depend on which caller ran it (-ffast-math may vectorize an
// inlined copy's sum differently).
template <typename T>
__attribute__((noinline)) void rms_norm_rows(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w,
                                             int64_t H, float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* xr = x + r * xs;
    const T* src = xr;
    float ss = 0.f;
    if (res != nullptr) {  // residual <- x + residual, in the activations' dtype as HF adds
      T* rr = res + r * rs;
      for (int64_t i = 0; i < H; ++i) {
        const T v = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        rr[i] = v;
        const float f = to_f(v);
        ss += f * f;
      }
      src = rr;
    } else {
      for (int64_t i = 0; i < H; ++i) {
        const float f = to_f(xr[i]);
        ss += f * f;
      }
    }
    const float inv = 1.f / std::sqrt(ss / float(H) + eps);
    T* o = out + r * os;
    for (int64_t i = 0; i < H; ++i) o[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(src[i]) * inv));
  }
}

template <typename T>
static void rms_norm_impl(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w, int64_t rows,
                          int64_t H, float eps) {
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    rms_norm_rows<T>(out, os, x, xs, res, rs, w, H, eps, begin, end);
  });
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [width]");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.scalar_type() == x.scalar_type() &&
              out.scalar_type() == x.scalar_type(), "one dtype, out like x");
  DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(), x.stride(0), nullptr, 0,
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), float(eps));
  });
}

// In place: residual <- x + residual; x <- rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual like x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: [width], x's dtype");
  DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.data_ptr<scalar_t>(), x.stride(0),
                            residual.data_ptr<scalar_t>(), residual.stride(0), weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), float(eps));
  });
}

// ---- RoPE (HF rotate-half), in place on q [T, Hq, D] and k [T, Hkv, D]; heads contiguous inside a row ----
template <typename T>
static inline void rope_heads(T* base, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
      // HF rounds each product to the activations' dtype, then the sum: the same points here.
      x[i] = from_f<T>(round_to<T>(x1 * c[i]) - round_to<T>(x2 * s[i]));
      x[i + half] = from_f<T>(round_to<T>(x2 * c[i]) + round_to<T>(x1 * s[i]));
    }
  }
}

// Rows begin..end; positions must already be checked against the table (nothing here throws).
template <typename T>
__attribute__((noinline)) void rope_rows(T* q, int64_t qs, int64_t Hq, T* k, int64_t ks, int64_t Hkv, int64_t D,
                                         const int64_t* pos, const float* cp, const float* sp, int64_t begin,
                                         int64_t end) {
  const int64_t half = D / 2;
  float cbuf[256], sbuf[256];  // D <= 512, checked by the callers
  for (int64_t t = begin; t < end; ++t) {
    const int64_t p = pos[t];
    // HF casts cos/sin to the activations' dtype before multiplying.
    for (int64_t i = 0; i < half; ++i) {
      cbuf[i] = round_to<T>(cp[p * half + i]);
      sbuf[i] = round_to<T>(sp[p * half + i]);
    }
    rope_heads(q + t * qs, Hq, D, cbuf, sbuf);
    rope_heads(k + t * ks, Hkv, D, cbuf, sbuf);
  }
}

static void check_positions(const int64_t* pos, int64_t n, int64_t max_pos) {
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of the RoPE table");
}

void rope(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
              k.stride(1) == k.size(2) && q.size(2) == k.size(2) && q.size(2) % 2 == 0 && q.size(2) <= 512,
              "q, k: [T, H, D], heads contiguous, D even and <= 512");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "positions: int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
              sin.is_contiguous() && cos.size(1) == q.size(2) / 2, "cos, sin: float32 [max_pos, D/2]");
  const int64_t T_ = q.size(0), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  check_positions(pos, T_, cos.size(0));
  DISPATCH(q.scalar_type(), "rope", [&] {
    TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k: one dtype");
    at::parallel_for(0, T_, grain((q.size(1) + k.size(1)) * D), [&](int64_t begin, int64_t end) {
      rope_rows<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.size(1), k.data_ptr<scalar_t>(), k.stride(0),
                          k.size(1), D, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), begin, end);
    });
  });
}

// ---- KV write: this step's k/v rows [T, Hkv, D] (heads contiguous) to their flat cache slots ----
// Slots must already be checked against the cache (nothing here throws).
__attribute__((noinline)) void write_kv_rows(char* kc, char* vc, const char* kp, int64_t ks, const char* vp,
                                             int64_t vs, const int64_t* slots, int64_t row_bytes, int64_t begin,
                                             int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    std::memcpy(kc + slots[t] * row_bytes, kp + t * ks, row_bytes);
    std::memcpy(vc + slots[t] * row_bytes, vp + t * vs, row_bytes);
  }
}

static void check_slots(const int64_t* slots, int64_t n, int64_t num_slots) {
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of the cache");
}

void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
              key.stride(1) == key.size(2) && value.stride(1) == value.size(2), "key, value: [T, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == key.scalar_type() &&
              v_cache.scalar_type() == key.scalar_type() && value.scalar_type() == key.scalar_type(),
              "contiguous caches of the activations' dtype");
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == key.size(1) * key.size(2), "cache rows: Hkv * D");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == key.size(0), "slot_mapping: int64 [T]");
  const int64_t T_ = key.size(0), width = key.size(1) * key.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = key.element_size();
  check_slots(slots, T_, k_cache.size(0) * k_cache.size(1));
  at::parallel_for(0, T_, 4 * grain(width), [&](int64_t begin, int64_t end) {
    write_kv_rows(static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()),
                  static_cast<const char*>(key.data_ptr()), key.stride(0) * elem,
                  static_cast<const char*>(value.data_ptr()), value.stride(0) * elem, slots, width * elem, begin, end);
  });
}

// ---- SiLU(gate) * up over the fused [T, 2I] projection; HF rounds silu's output, then the product ----
template <typename T>
__attribute__((noinline)) void silu_and_mul_rows(T* op, int64_t os, const T* xp, int64_t xs, int64_t I,
                                                 int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const T* g = xp + t * xs;
    const T* u = g + I;
    T* o = op + t * os;
    for (int64_t i = 0; i < I; ++i) {
      const float a = to_f(g[i]);
      o[i] = from_f<T>(round_to<T>(a / (1.f + std::exp(-a))) * to_f(u[i]));
    }
  }
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "x: [T, 2I], out: [T, I]");
  const int64_t T_ = x.size(0), I = out.size(1);
  DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, T_, grain(I), [&](int64_t begin, int64_t end) {
      silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(), x.stride(0), I,
                                  begin, end);
    });
  });
}

// ---- AVX-512 pieces of the attention op (head sizes that are multiples of 16, fp32 and bf16) ----
#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32: the bits into the top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// Sixteen vectors -> one vector of their sixteen horizontal sums, in a fixed tree (45 ops for 16 sums
// where one reduction at a time costs ~8 each): lane i is the sum of v[i]'s lanes.
static inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#define HAVE_SIMD_ATTENTION 1
#else
#define HAVE_SIMD_ATTENTION 0
#endif

// ---- Paged attention by rows: each query row has its own block table row and context length ----
// A task is (sequence, range of KV heads) and streams each block's rows for those heads in address order:
// one task per (sequence, head) read 256 of every 1024 bytes and ran at half the bandwidth (measured, one
// thread, 32 rows x 300 tokens fp32: 9 -> 21 GB/s). The GQA group rides along: each K/V row loaded
// serves every query head that shares it. D is a compile-time constant for the common head sizes, so the
// dot products and the V update unroll into a few full-width FMAs.
template <typename scalar_t>
struct AttentionArgs {
  scalar_t* out;
  int64_t o_stride;
  const scalar_t* query;
  int64_t q_stride;
  const scalar_t* k_cache;
  const scalar_t* v_cache;
  int64_t bs, Hkv, Hq, D;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* lens;
  int64_t B;
  float scale;
  int64_t splits;  // tasks per row: KV-head ranges; a task's bits do not depend on how heads are split
};

// Enough tasks for every thread when the batch is small (batch 1: heads split across threads).
static inline int64_t attention_splits(int64_t Hkv, int64_t B, int64_t threads) {
  return std::min<int64_t>(Hkv, std::max<int64_t>(1, (2 * threads + B - 1) / B));
}

// Tasks begin..end of B * splits (row, KV-head range); nothing here throws.
template <typename scalar_t, int64_t D_FIXED>
__attribute__((noinline)) void attention_tasks(const AttentionArgs<scalar_t>& a, int64_t begin, int64_t end) {
  // The SIMD path: AVX-512, fp32 or bf16, a head size of whole 16-lane vectors.
  constexpr bool SIMD = HAVE_SIMD_ATTENTION && D_FIXED > 0 && D_FIXED % 16 == 0 &&
                        (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);
  const int64_t D = D_FIXED > 0 ? D_FIXED : a.D;
  const int64_t bs = a.bs, Hkv = a.Hkv;
  const int64_t G = a.Hq / Hkv;
  const scalar_t* __restrict__ q_ptr = a.query;
  const scalar_t* __restrict__ k_ptr = a.k_cache;
  const scalar_t* __restrict__ v_ptr = a.v_cache;
  scalar_t* __restrict__ o_ptr = a.out;
  const int32_t* tables = a.tables;
  const int32_t* lens = a.lens;
  const int64_t q_stride = a.q_stride, o_stride = a.o_stride, table_stride = a.table_stride;
  const int64_t row_stride = Hkv * D;  // between consecutive tokens inside a block
  const float fscale = a.scale;
  const int64_t splits = a.splits;
  const int64_t per = (Hkv + splits - 1) / splits;
  {
    std::vector<float> qv(per * G * D), accv(per * G * D), sv(per * G * bs), mv(per * G), lv(per * G), rowv(D);
    float* __restrict__ q = qv.data();
    float* __restrict__ acc = accv.data();
    float* __restrict__ sc = sv.data();
    float* __restrict__ m = mv.data();
    float* __restrict__ l = lv.data();
    float row_fixed[D_FIXED > 0 ? D_FIXED : 1];
    float* __restrict__ row = D_FIXED > 0 ? row_fixed : rowv.data();  // one head's K or V row, widened
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, h0 = (task % splits) * per;
      const int64_t nh = std::min(Hkv, h0 + per) - h0;
      if (nh <= 0) continue;
      const int64_t L = lens[b];
      const int32_t* table = tables + b * table_stride;
      for (int64_t x = 0; x < nh * G; ++x) {  // x = local head * G + group member
        for (int64_t d = 0; d < D; ++d) {
          q[x * D + d] = to_f(q_ptr[b * q_stride + (h0 * G + x) * D + d]) * fscale;
          acc[x * D + d] = 0.f;
        }
        m[x] = -INFINITY;
        l[x] = 0.f;
      }
      // One pass: a block's scores, then the running max/sum rescaled (online softmax), then its V rows.
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const int64_t base = (int64_t(table[t0 / bs]) * bs * Hkv + h0) * D;
        const scalar_t* __restrict__ kb = k_ptr + base;
        const scalar_t* __restrict__ vb = v_ptr + base;
        const int64_t n = std::min(bs, L - t0);
        if (t0 + bs < L) {  // the next block sits elsewhere in the cache: ask for its rows (our heads) now
          const int64_t next = (int64_t(table[t0 / bs + 1]) * bs * Hkv + h0) * D;
          const int64_t bytes = nh * D * int64_t(sizeof(scalar_t));
          for (int64_t i = 0; i < bs; ++i)
            for (int64_t o = 0; o < bytes; o += 64) {
              __builtin_prefetch((const char*)(k_ptr + next + i * row_stride) + o);
              __builtin_prefetch((const char*)(v_ptr + next + i * row_stride) + o);
            }
        }
        if constexpr (SIMD) {
#if HAVE_SIMD_ATTENTION
          // Sixteen tokens at a time: each score's D products summed chunk by chunk into one vector,
          // then the sixteen vectors reduced together (sum16): no reduction per score.
          constexpr int C = D_FIXED / 16;
          for (int64_t hh = 0; hh < nh; ++hh) {
            for (int64_t i0 = 0; i0 < n; i0 += 16) {
              const int64_t nc = std::min<int64_t>(16, n - i0);
              const scalar_t* __restrict__ k0 = kb + i0 * row_stride + hh * D;
              for (int64_t g = 0; g < G; ++g) {
                const int64_t x = hh * G + g;
                __m512 qc[C], v[16];
                for (int c = 0; c < C; ++c) qc[c] = _mm512_loadu_ps(q + x * D + 16 * c);
                for (int64_t i = 0; i < 16; ++i) {
                  if (i >= nc) {
                    v[i] = _mm512_setzero_ps();
                    continue;
                  }
                  const scalar_t* __restrict__ k = k0 + i * row_stride;
                  v[i] = _mm512_mul_ps(qc[0], load16(k));
                  for (int c = 1; c < C; ++c) v[i] = _mm512_fmadd_ps(qc[c], load16(k + 16 * c), v[i]);
                }
                _mm512_mask_storeu_ps(sc + x * bs + i0, (__mmask16)((1u << nc) - 1u), sum16(v));
              }
            }
          }
#endif
        } else {
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t hh = 0; hh < nh; ++hh) {
              const scalar_t* __restrict__ k = kb + i * row_stride + hh * D;
              for (int64_t d = 0; d < D; ++d) row[d] = to_f(k[d]);
              for (int64_t g = 0; g < G; ++g) {
                const float* __restrict__ qx = q + (hh * G + g) * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; ++d) s += qx[d] * row[d];
                sc[(hh * G + g) * bs + i] = s;
              }
            }
          }
        }
        for (int64_t x = 0; x < nh * G; ++x) {
          float* __restrict__ sx = sc + x * bs;
          float bm = m[x];
          for (int64_t i = 0; i < n; ++i) bm = std::max(bm, sx[i]);
          const float corr = std::exp(m[x] - bm);  // exp(-inf) = 0 on the first block
          float sum = 0.f;
          for (int64_t i = 0; i < n; ++i) {
            sx[i] = std::exp(sx[i] - bm);
            sum += sx[i];
          }
          l[x] = l[x] * corr + sum;
          m[x] = bm;
          float* __restrict__ ax = acc + x * D;
          for (int64_t d = 0; d < D; ++d) ax[d] *= corr;
        }
        if constexpr (SIMD) {
#if HAVE_SIMD_ATTENTION
          // Each head's accumulator stays in registers across the block's V rows. Two heads of a GQA group
          // at a time share each V row's loads and widening, and give 2C independent FMA chains instead of
          // C (one head's C chains, each a dependent FMA per token, waited on the FMA's latency). Every
          // accumulator still adds its tokens in order: the same bits as one head at a time.
          constexpr int C = D_FIXED / 16;
          for (int64_t hh = 0; hh < nh; ++hh) {
            int64_t g = 0;
            for (; g + 1 < G; g += 2) {
              const int64_t x0 = hh * G + g, x1 = x0 + 1;
              __m512 a0[C], a1[C];
              for (int c = 0; c < C; ++c) {
                a0[c] = _mm512_loadu_ps(acc + x0 * D + 16 * c);
                a1[c] = _mm512_loadu_ps(acc + x1 * D + 16 * c);
              }
              for (int64_t i = 0; i < n; ++i) {
                const __m512 p0 = _mm512_set1_ps(sc[x0 * bs + i]), p1 = _mm512_set1_ps(sc[x1 * bs + i]);
                const scalar_t* __restrict__ v = vb + i * row_stride + hh * D;
                for (int c = 0; c < C; ++c) {
                  const __m512 vc = load16(v + 16 * c);
                  a0[c] = _mm512_fmadd_ps(p0, vc, a0[c]);
                  a1[c] = _mm512_fmadd_ps(p1, vc, a1[c]);
                }
              }
              for (int c = 0; c < C; ++c) {
                _mm512_storeu_ps(acc + x0 * D + 16 * c, a0[c]);
                _mm512_storeu_ps(acc + x1 * D + 16 * c, a1[c]);
              }
            }
            for (; g < G; ++g) {
              const int64_t x = hh * G + g;
              __m512 a[C];
              for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + x * D + 16 * c);
              for (int64_t i = 0; i < n; ++i) {
                const __m512 p = _mm512_set1_ps(sc[x * bs + i]);
                const scalar_t* __restrict__ v = vb + i * row_stride + hh * D;
                for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), a[c]);
              }
              for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + x * D + 16 * c, a[c]);
            }
          }
#endif
        } else {
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t hh = 0; hh < nh; ++hh) {
              const scalar_t* __restrict__ v = vb + i * row_stride + hh * D;
              for (int64_t d = 0; d < D; ++d) row[d] = to_f(v[d]);
              for (int64_t g = 0; g < G; ++g) {
                const float p = sc[(hh * G + g) * bs + i];
                float* __restrict__ ax = acc + (hh * G + g) * D;
                for (int64_t d = 0; d < D; ++d) ax[d] += p * row[d];
              }
            }
          }
        }
      }
      for (int64_t x = 0; x < nh * G; ++x) {
        const float inv = 1.f / l[x];
        for (int64_t d = 0; d < D; ++d)
          o_ptr[b * o_stride + (h0 * G + x) * D + d] = from_f<scalar_t>(acc[x * D + d] * inv);
      }
    }
  }
}

template <typename scalar_t>
void attention_tasks_any(const AttentionArgs<scalar_t>& a, int64_t begin, int64_t end) {
  if (a.D == 64) attention_tasks<scalar_t, 64>(a, begin, end);
  else if (a.D == 128) attention_tasks<scalar_t, 128>(a, begin, end);
  else if (a.D == 32) attention_tasks<scalar_t, 32>(a, begin, end);
  else attention_tasks<scalar_t, 0>(a, begin, end);
}

void paged_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [B, Hq, D], heads contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2), "out: like query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(), "one dtype");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables: int32, rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens: int32 [B]");
  DISPATCH(query.scalar_type(), "paged_attention", [&] {
    const int64_t B = query.size(0), Hkv = k_cache.size(2);
    const AttentionArgs<scalar_t> a{out.data_ptr<scalar_t>(), out.stride(0), query.data_ptr<scalar_t>(),
                                    query.stride(0), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    k_cache.size(1), Hkv, query.size(1), query.size(2),
                                    block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                                    seq_lens.data_ptr<int32_t>(), B, static_cast<float>(scale),
                                    attention_splits(Hkv, B, at::get_num_threads())};
    at::parallel_for(0, B * a.splits, 1, [&](int64_t begin, int64_t end) { attention_tasks_any(a, begin, end); });
  });
}
"""

_FUNCTIONS = ["rms_norm", "fused_add_rms_norm", "rope", "write_kv", "silu_and_mul", "paged_attention"]
_module: Any = None


def load() -> Any:
    """The compiled module, or None if this machine cannot build it (logged once)."""
    global _module
    _module = native_build.build("inflight_cpu_ops", SOURCE, _FUNCTIONS, fast_math=True)
    return _module


_record = native_build.record


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    with _record("rms_norm"):
        _module.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, x = rms_norm(residual); returns (x, residual)."""
    with _record("fused_add_rms_norm"):
        _module.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rope(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query [T, Hq, D] and key [T, Hkv, D] in place (rows may be strided views) and returns them."""
    with _record("rope"):
        _module.rope(query, key, positions, cos, sin)
    return query, key


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    with _record("write_kv"):
        _module.write_kv(key, value, k_cache, v_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, up) -> silu(gate) * up, [T, I]."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    with _record("silu_and_mul"):
        _module.silu_and_mul(out, x)
    return out


def paged_attention(
    query: torch.Tensor,  # [R, Hq, D]: R query rows (tokens); rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, >= blocks used] int32: each row's sequence's table
    seq_lens: torch.Tensor,  # [R] int32: each row's context length (its position + 1)
    scale: float,
) -> torch.Tensor:
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    with _record("paged_attention"):
        _module.paged_attention(out, query, k_cache, v_cache, block_tables, seq_lens, scale)
    return out
