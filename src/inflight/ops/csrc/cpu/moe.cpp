// Mixture-of-Experts: each (token, slot) pair through its expert's SwiGLU MLP, as a grouped GEMM. The pairs are
// grouped by expert; tiles of up to MR rows of one expert share every weight vector they read; tasks are (expert,
// output panel). Three passes: gate/up with the activation, down weighted by the router, the k slots summed.
// Each output sums its K products in order k = 0..K-1 in one fp32 chain: a row's bits depend on nothing but the row.
#include <vector>

#include "common.h"
#include "ops.h"

// The vectors pass only between this file's inline functions: no calling convention to keep across builds.
#pragma GCC diagnostic ignored "-Wpsabi"
// -ffast-math, but sums keep their written order, products round before they are added (where no FMA is written)
// and divisions are exact: an output must round the same wherever it is computed.
#pragma GCC optimize("no-associative-math", "fp-contract=off", "no-reciprocal-math")

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

// The build's native fp32 vector: sixteen lanes (one zmm) with AVX-512, eight (one ymm) elsewhere.
#ifdef __AVX512F__
constexpr int VW = 16;
constexpr int MR = 12;  // rows a tile: 24 accumulators of the 32 registers
#else
constexpr int VW = 8;
constexpr int MR = 6;  // 12 accumulators of the 16 registers
#endif
constexpr int PW = 2 * VW;  // values a panel step: two vectors (gate and up, or two vectors of outputs)
typedef float vf __attribute__((vector_size(4 * VW)));
typedef uint32_t vu32 __attribute__((vector_size(4 * VW)));
typedef int32_t vi32 __attribute__((vector_size(4 * VW)));

static inline vf madd(vf a, vf b, vf c) {  // a * b + c, one rounding where the CPU fuses it
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
static inline vf bcast(float s) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(s);
#elif defined(__AVX__)
  return _mm256_set1_ps(s);
#else
  vf v;
  for (int l = 0; l < VW; ++l) v[l] = s;
  return v;
#endif
}

// A panel step's two vectors. fp32: [a lanes, b lanes]; bf16: one word a lane, a's value in the low half and b's
// in the high half, so that a shift and a mask widen both (exact).
static inline void step(const float* p, vf& a, vf& b) {
  std::memcpy(&a, p, sizeof a);
  std::memcpy(&b, p + VW, sizeof b);
}
static inline void step(const c10::BFloat16* p, vf& a, vf& b) {
  vu32 w;
  std::memcpy(&w, p, sizeof w);
  a = (vf)(w << 16);
  b = (vf)(w & 0xffff0000u);
}

// The value held after rounding to the activations' dtype: fp32 as is, bf16 to nearest even (NaN kept). common.h's
// round_to, defined again under this file's options (GCC inlines no function built with other options).
static inline vf rounded(vf v, float) { return v; }
static inline vf rounded(vf v, c10::BFloat16) {
  vu32 u;
  std::memcpy(&u, &v, sizeof u);
  const vu32 nearest = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vu32 nan = (vu32)((vi32)((u & 0x7fffffffu) > 0x7f800000u));  // all ones where NaN
  const vu32 r = (nan & 0x7fc00000u) | (~nan & nearest);
  vf f;
  std::memcpy(&f, &r, sizeof f);
  return f;
}
static inline float rounded(float f, float) { return f; }
static inline float rounded(float f, c10::BFloat16) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline void store_out(float* o, float f) { *o = f; }
static inline void store_out(c10::BFloat16* o, float f) {
  const float r = rounded(f, c10::BFloat16());
  uint32_t u;
  std::memcpy(&u, &r, 4);
  o->x = uint16_t(u >> 16);
}

// acc[m] = the tile's M rows (fp32, a[m][0..K)) times a panel's two vectors of outputs, k in order. A tile that
// reads the panel first pulls the weights PREFETCH bytes ahead into the caches (the next panel's, past the end):
// the stream from memory keeps more lines in flight than the hardware prefetcher alone.
#ifndef MOE_PF
#define MOE_PF 2048
#endif
#ifndef MOE_PFL
#define MOE_PFL 3
#endif
constexpr int64_t PREFETCH = MOE_PF;
template <int M, typename W>
static inline void dot_tile(vf (&ca)[M], vf (&cb)[M], const float* const* a, const W* w, int64_t K, bool first) {
  for (int m = 0; m < M; ++m) ca[m] = cb[m] = vf{};
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH;
  for (int64_t k = 0; k < K; ++k) {
    if (first) __builtin_prefetch(ahead + k * PW * sizeof(W), 0, MOE_PFL);
    vf wa, wb;
    step(w + k * PW, wa, wb);
    for (int m = 0; m < M; ++m) {
      const vf xk = bcast(a[m][k]);
      ca[m] = madd(xk, wa, ca[m]);
      cb[m] = madd(xk, wb, cb[m]);
    }
  }
}

// act = silu(gate) * up for one vector of a row, rounded where HF rounds (gate and up, silu, the product). Not
// inlined: every row's activation runs the same machine code (the exp's vector and scalar forms may differ).
template <typename T>
__attribute__((noinline)) static void activate(float* __restrict act, const float* __restrict gate, const float* __restrict up) {
  for (int l = 0; l < VW; ++l) {
    const float g = rounded(gate[l], T());
    act[l] = rounded(rounded(g / (1.f + expf(-g)), T()) * rounded(up[l], T()), T());
  }
}

// M rows' activations for one panel of the intermediate outputs (act[m] at the panel's first output).
template <int M, typename T>
static void gate_up_tile(float* const* act, const float* const* x, const T* w, int64_t H, bool first) {
  vf g[M], u[M];
  dot_tile<M>(g, u, x, w, H, first);
  for (int m = 0; m < M; ++m) {
    alignas(64) float gs[VW], us[VW];
    std::memcpy(gs, &g[m], sizeof gs);
    std::memcpy(us, &u[m], sizeof us);
    activate<T>(act[m], gs, us);
  }
}

// M rows' down projection for one panel of hidden outputs, rounded to the activations' dtype, then times the
// router's weight in fp32 (y[m] at the panel's first output).
template <int M, typename T>
static void down_tile(float* const* y, const float* weight, const float* const* act, const T* w, int64_t I,
                      bool first) {
  vf a[M], b[M];
  dot_tile<M>(a, b, act, w, I, first);
  for (int m = 0; m < M; ++m) {
    const vf ya = rounded(a[m], T()) * weight[m], yb = rounded(b[m], T()) * weight[m];
    std::memcpy(y[m], &ya, sizeof ya);
    std::memcpy(y[m] + VW, &yb, sizeof yb);
  }
}

// A tile of m rows (1..MR) through the instantiation for m.
template <typename T, int M = MR>
static void gate_up_rows(int m, float* const* act, const float* const* x, const T* w, int64_t H, bool first) {
  if constexpr (M > 1)
    if (m < M) return gate_up_rows<T, M - 1>(m, act, x, w, H, first);
  gate_up_tile<M, T>(act, x, w, H, first);
}
template <typename T, int M = MR>
static void down_rows(int m, float* const* y, const float* weight, const float* const* act, const T* w, int64_t I,
                      bool first) {
  if constexpr (M > 1)
    if (m < M) return down_rows<T, M - 1>(m, y, weight, act, w, I, first);
  down_tile<M, T>(y, weight, act, w, I, first);
}

// n rows cut into the fewest tiles of at most MR, the rows shared evenly (7: 4 + 3, not 6 + 1): fn(first, rows).
template <typename F>
static inline void for_tiles(int64_t n, F&& fn) {
  const int64_t tiles = (n + MR - 1) / MR;
  for (int64_t b = 0; b < tiles; ++b) fn(n * b / tiles, (int)(n * (b + 1) / tiles - n * b / tiles));
}

template <typename T>
static void fused_moe_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                           const float* topk_weights, const int32_t* ids, int64_t k, int64_t min_macs_per_thread) {
  const int64_t tokens = x.size(0), H = x.size(1), E = w13.size(0), P1 = w13.size(1), P2 = w2.size(1), I = w2.size(2);
  const int64_t pairs = tokens * k, Ip = P1 * VW, Hp = P2 * PW;
  // The pairs (p = token * k + slot) grouped by expert: expert e's are order[start[e]..start[e + 1]), in pair order.
  std::vector<int64_t> start(E + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[fill[ids[p]]++] = p;
  std::vector<int64_t> active;  // the experts with pairs: an idle expert's weights are never read
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t A = (int64_t)active.size(), rows_per_expert = (pairs + A - 1) / A;

  // x's rows as fp32 (bf16 widened once, exact); the activations by grouped position; the weighted outputs by pair.
  const at::Tensor xf = std::is_same_v<T, float> ? x : x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  const int64_t xs = xf.stride(0);
  at::Tensor act_t = at::empty({pairs, Ip}, x.options().dtype(at::kFloat));
  at::Tensor weighted_t = at::empty({pairs, Hp}, x.options().dtype(at::kFloat));
  float* act = act_t.data_ptr<float>();
  float* weighted = weighted_t.data_ptr<float>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();

  // Tasks are (active expert, panel), the expert's panels in a row: a thread streams one stretch of weights.
  const int64_t grain1 = std::max<int64_t>(1, min_macs_per_thread / std::max<int64_t>(1, rows_per_expert * H * PW));
  at::parallel_for(0, A * P1, grain1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = active[t / P1], p = t % P1, s = start[e];
      const T* w = w13p + (e * P1 + p) * H * PW;
      for_tiles(start[e + 1] - s, [&](int64_t r0, int rows) {
        const float* xr[MR];
        float* ar[MR];
        for (int i = 0; i < rows; ++i) {
          const int64_t pos = s + r0 + i;
          xr[i] = xp + (order[pos] / k) * xs;
          ar[i] = act + pos * Ip + p * VW;
        }
        gate_up_rows<T>(rows, ar, xr, w, H, r0 == 0);
      });
    }
  });

  const int64_t grain2 = std::max<int64_t>(1, min_macs_per_thread / std::max<int64_t>(1, rows_per_expert * I * PW));
  at::parallel_for(0, A * P2, grain2, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = active[t / P2], p = t % P2, s = start[e];
      const T* w = w2p + (e * P2 + p) * I * PW;
      for_tiles(start[e + 1] - s, [&](int64_t r0, int rows) {
        const float* ar[MR];
        float* yr[MR];
        float wt[MR];
        for (int i = 0; i < rows; ++i) {
          const int64_t pos = s + r0 + i, pair = order[pos];
          ar[i] = act + pos * Ip;
          yr[i] = weighted + pair * Hp + p * PW;
          wt[i] = topk_weights[pair];
        }
        down_rows<T>(rows, yr, wt, ar, w, I, r0 == 0);
      });
    }
  });

  // Each token's k weighted outputs summed in fp32 in top-k order, rounded once.
  T* o = out.data_ptr<T>();
  const int64_t os = out.stride(0);
  at::parallel_for(0, tokens, grain(k * H), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(H);
    for (int64_t t = begin; t < end; ++t) {
      const float* w = weighted + t * k * Hp;
      std::memcpy(sum.data(), w, H * sizeof(float));
      for (int64_t j = 1; j < k; ++j)
        for (int64_t h = 0; h < H; ++h) sum[h] += w[j * Hp + h];
      for (int64_t h = 0; h < H; ++h) store_out(o + t * os + h, sum[h]);
    }
  });
}

// out [T, H] = each token through its k experts (topk_ids int32 [T, k]) weighted by topk_weights (fp32 [T, k]),
// x [T, H] and the moe_pack'ed w13, w2 of one dtype, fp32 or bf16. Tasks run on the calling thread below
// min_macs_per_thread multiply-adds a chunk.
void fused_moe(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights,
               at::Tensor topk_ids, int64_t min_macs_per_thread) {
  check_rows(x, "x");
  check_rows(out, "out");
  const auto dt = x.scalar_type();
  const int64_t T_ = x.size(0), H = x.size(1);
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "fused_moe: fp32 or bf16");
  TORCH_CHECK(out.scalar_type() == dt && out.size(0) == T_ && out.size(1) == H, "out: [T, H] in x's dtype");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == dt && w2.scalar_type() == dt,
              "w13, w2: moe_pack'ed, contiguous, in x's dtype");
  const int64_t E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(3) == PW && w2.size(3) == PW && w13.size(2) == H && w2.size(0) == E &&
                  w13.size(1) == (I + VW - 1) / VW && w2.size(1) == (H + PW - 1) / PW,
              "w13, w2: not moe_pack'ed for this build and x's width");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.is_contiguous() && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == T_,
              "topk_ids: int32 [T, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights: fp32 [T, k]");
  const int64_t k = topk_ids.size(1);
  const int32_t* ids = topk_ids.data_ptr<int32_t>();
  for (int64_t p = 0; p < T_ * k; ++p) TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "topk_ids: an expert outside 0..E-1");
  if (T_ == 0 || k == 0) {
    out.zero_();
    return;
  }
  if (dt == at::kFloat)
    fused_moe_impl<float>(out, x, w13, w2, topk_weights.data_ptr<float>(), ids, k, min_macs_per_thread);
  else
    fused_moe_impl<c10::BFloat16>(out, x, w13, w2, topk_weights.data_ptr<float>(), ids, k, min_macs_per_thread);
}

// w [E, N, K] (fp32 or bf16) -> [E, P, K, PW] panels of two vectors a step, zero past the outputs. gate_up: w13,
// panel p pairs gate outputs p*VW.. with the same up outputs (I = N / 2); else panel p holds outputs p*PW...
// bf16 steps interleave the two vectors (step's layout).
at::Tensor moe_pack(at::Tensor w, bool gate_up) {
  TORCH_CHECK(w.dim() == 3 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "moe_pack: fp32 or bf16 [E, N, K]");
  TORCH_CHECK(!gate_up || w.size(1) % 2 == 0, "moe_pack: gate and up rows of one size");
  w = w.contiguous();
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2), I = N / 2;
  const int64_t P = gate_up ? (I + VW - 1) / VW : (N + PW - 1) / PW;
  at::Tensor packed = at::zeros({E, P, K, PW}, w.options());
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const int64_t es = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, E * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t e = t / P, p = t % P;
      for (int half = 0; half < 2; ++half)
        for (int l = 0; l < VW; ++l) {
          const int64_t n = gate_up ? (p * VW + l < I ? half * I + p * VW + l : N) : p * PW + half * VW + l;
          if (n >= N) continue;
          const int64_t lane = bf16 ? 2 * l + half : half * VW + l;  // the slot of (half, l) in a step
          const char* row = src + (e * N + n) * K * es;
          char* col = dst + (t * K * PW + lane) * es;
          for (int64_t kk = 0; kk < K; ++kk) std::memcpy(col + kk * PW * es, row + kk * es, es);
        }
    }
  });
  return packed;
}
