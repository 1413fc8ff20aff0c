// Mixture-of-Experts: each (token, slot) pair through its expert's SwiGLU MLP, as a grouped GEMM. The pairs are
// grouped by expert; tiles of up to MR rows of one expert share every weight vector they read; tasks are (expert,
// a group of output panels). Three passes: gate/up with the activation, down weighted by the router, the k slots
// summed. Each output sums its K products in order k = 0..K-1 in one fp32 chain, whatever the tile or the panels
// computed beside it: a row's bits depend on nothing but the row.
#include <omp.h>

#include <atomic>
#include <vector>

#include "common.h"
#include "ops.h"

// The vectors pass only between this file's inline functions: no calling convention to keep across builds.
#pragma GCC diagnostic ignored "-Wpsabi"
// -ffast-math, but sums keep their written order, products round before they are added (where no FMA is written)
// and divisions are exact: an output must round the same wherever it is computed.
#pragma GCC optimize("no-associative-math", "fp-contract=off", "no-reciprocal-math")

// The build's native fp32 vector: sixteen lanes (one zmm) with AVX-512, eight (one ymm) elsewhere. A tile of M rows
// runs panels(M) panels at once: a tile of few rows keeps more multiply-add chains in flight.
#ifdef __AVX512F__
constexpr int VW = 16;
constexpr int MR = 12;  // rows a tile: 24 accumulators of the 32 registers
static constexpr int panels(int M) { return M <= 5 ? 2 : 1; }
#else
constexpr int VW = 8;
constexpr int MR = 6;  // 12 accumulators of the 16 registers
static constexpr int panels(int M) { return M <= 2 ? 2 : 1; }
#endif
constexpr int PW = 2 * VW;  // values a panel step: two vectors (gate and up, or two vectors of outputs)
constexpr int GROUP = 4;    // panels a task
// Zero steps after each panel's K: panels read side by side (and the ones prefetched beside them) then start a cache
// line apart, not in one cache set.
static constexpr int64_t pad_steps(int64_t elem_size) { return 64 / (PW * elem_size) > 1 ? 64 / (PW * elem_size) : 1; }
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

// c[j][0/1][m] = the tile's M rows (fp32, a[m][0..K)) times panel j's two vectors of outputs, k in order; panel j at
// w + j * stride. With `next` (the first tile over these panels), the panels the next call reads are pulled into
// L2 at the same step: the weights stream from memory while this call computes.
template <int M, int NP, typename W>
static inline void dot_tile(vf (&c)[NP][2][M], const float* const* a, const W* w, int64_t stride, int64_t K,
                            const W* next) {
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) c[j][0][m] = c[j][1][m] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    if (next)
      for (int j = 0; j < NP; ++j) __builtin_prefetch(next + j * stride + k * PW, 0, 2);
    vf wa[NP], wb[NP];
    for (int j = 0; j < NP; ++j) step(w + j * stride + k * PW, wa[j], wb[j]);
    for (int m = 0; m < M; ++m) {
      const vf xk = bcast(a[m][k]);
      for (int j = 0; j < NP; ++j) {
        c[j][0][m] = madd(xk, wa[j], c[j][0][m]);
        c[j][1][m] = madd(xk, wb[j], c[j][1][m]);
      }
    }
  }
}

// act = silu(gate) * up for one vector of a row, rounded where HF rounds (gate and up, silu, the product). Not
// inlined: every row's activation runs the same machine code (the exp's vector and scalar forms may differ).
template <typename T>
__attribute__((noinline)) static void activate(float* __restrict act, const float* __restrict gate,
                                               const float* __restrict up) {
  for (int l = 0; l < VW; ++l) {
    const float g = rounded(gate[l], T());
    act[l] = rounded(rounded(g / (1.f + expf(-g)), T()) * rounded(up[l], T()), T());
  }
}

// M rows' activations for NP panels of the intermediate outputs (act[m] at the first panel's first output).
template <int M, int NP, typename T>
static void gate_up_tile(float* const* act, const float* const* x, const T* w, int64_t stride, int64_t H,
                         const T* next) {
  vf c[NP][2][M];
  dot_tile<M, NP>(c, x, w, stride, H, next);
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) {
      alignas(64) float g[VW], u[VW];
      std::memcpy(g, &c[j][0][m], sizeof g);
      std::memcpy(u, &c[j][1][m], sizeof u);
      activate<T>(act[m] + j * VW, g, u);
    }
}

// M rows' down projection for NP panels of hidden outputs, rounded to the activations' dtype, then times the
// router's weight in fp32 (y[m] at the first panel's first output).
template <int M, int NP, typename T>
static void down_tile(float* const* y, const float* weight, const float* const* act, const T* w, int64_t stride,
                      int64_t I, const T* next) {
  vf c[NP][2][M];
  dot_tile<M, NP>(c, act, w, stride, I, next);
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < M; ++m) {
      const vf ya = rounded(c[j][0][m], T()) * weight[m], yb = rounded(c[j][1][m], T()) * weight[m];
      std::memcpy(y[m] + j * PW, &ya, sizeof ya);
      std::memcpy(y[m] + j * PW + VW, &yb, sizeof yb);
    }
}

// A tile of m rows (1..MR) over np panels (1..panels(m)) through the instantiation for both.
template <typename T, int M = MR, int NP = panels(M)>
static void gate_up_rows(int m, int np, float* const* act, const float* const* x, const T* w, int64_t stride, int64_t H,
                         const T* next) {
  if constexpr (M > 1)
    if (m < M) return gate_up_rows<T, M - 1>(m, np, act, x, w, stride, H, next);
  if constexpr (NP > 1)
    if (np < NP) return gate_up_rows<T, M, NP - 1>(m, np, act, x, w, stride, H, next);
  gate_up_tile<M, NP, T>(act, x, w, stride, H, next);
}
template <typename T, int M = MR, int NP = panels(M)>
static void down_rows(int m, int np, float* const* y, const float* weight, const float* const* act, const T* w,
                      int64_t stride, int64_t I, const T* next) {
  if constexpr (M > 1)
    if (m < M) return down_rows<T, M - 1>(m, np, y, weight, act, w, stride, I, next);
  if constexpr (NP > 1)
    if (np < NP) return down_rows<T, M, NP - 1>(m, np, y, weight, act, w, stride, I, next);
  down_tile<M, NP, T>(y, weight, act, w, stride, I, next);
}

// n rows cut into the fewest tiles of at most MR, the rows shared evenly (7: 4 + 3, not 6 + 1): fn(first, rows).
static inline int largest_tile(int64_t n) {
  const int64_t tiles = (n + MR - 1) / MR;
  return (int)((n + tiles - 1) / tiles);
}
template <typename F>
static inline void for_tiles(int64_t n, F&& fn) {
  const int64_t tiles = (n + MR - 1) / MR;
  for (int64_t b = 0; b < tiles; ++b) fn(n * b / tiles, (int)(n * (b + 1) / tiles - n * b / tiles));
}

// Tasks 0..n-1 claimed in shrinking runs (guided): a thread slowed by a busy core takes fewer, and a run is a stretch
// of consecutive panels, read in memory order.
template <typename F>
static void claim(std::atomic<int64_t>& next, int64_t n, int nt, F&& run) {
  for (;;) {
    int64_t b = next.load(std::memory_order_relaxed), c;
    do {
      if (b >= n) return;
      c = std::max<int64_t>(1, (n - b) / (4 * nt));
    } while (!next.compare_exchange_weak(b, b + c, std::memory_order_relaxed));
    run(b, std::min(n, b + c));
  }
}

// One call: the pairs grouped by expert, then three passes between the region's barriers: gate/up with the
// activation into act (by grouped position), down weighted into `weighted` (by pair), then each token's k weighted
// outputs summed in fp32 in top-k order and rounded once.
template <typename T>
struct Moe {
  const float* x;  // [tokens, xs] fp32 (bf16 widened once, exact)
  int64_t xs;
  const T *w13, *w2;
  const float* topk_weights;
  int64_t tokens, k, H, I, pad, P1, P2, G1, G2, Ip, Hp;  // G1, G2: tasks an expert
  const int64_t *start, *order, *active;  // expert e's pairs: order[start[e]..start[e + 1]); the experts with pairs
  int64_t A;
  float *act, *weighted;
  T* out;
  int64_t os;
  MoeTasks* next;
  SpinBarrier* barrier;

  // Task t: expert active[t / G1], its panels GROUP * (t % G1).. of w13. Panels outer, tiles inner: the panels come
  // from memory for the first tile and from the caches for the others.
  void gate_up(int64_t t) const {
    const int64_t e = active[t / G1], s = start[e], n = start[e + 1] - s, stride = (H + pad) * PW;
    const int64_t p0 = GROUP * (t % G1), p1 = std::min(P1, p0 + GROUP);
    const int run = panels(largest_tile(n));  // every tile of the expert runs this many panels at once
    for (int64_t p = p0; p < p1; p += run) {
      const int np = (int)std::min<int64_t>(run, p1 - p);
      const T* w = w13 + (e * P1 + p) * stride;
      for_tiles(n, [&](int64_t r0, int rows) {
        const float* xr[MR];
        float* ar[MR];
        for (int i = 0; i < rows; ++i) {
          const int64_t pos = s + r0 + i;
          xr[i] = x + (order[pos] / k) * xs;
          ar[i] = act + pos * Ip + p * VW;
        }
        gate_up_rows<T>(rows, np, ar, xr, w, stride, H, r0 == 0 ? w + np * stride : nullptr);
      });
    }
  }
  void down(int64_t t) const {
    const int64_t e = active[t / G2], s = start[e], n = start[e + 1] - s, stride = (I + pad) * PW;
    const int64_t p0 = GROUP * (t % G2), p1 = std::min(P2, p0 + GROUP);
    const int run = panels(largest_tile(n));  // every tile of the expert runs this many panels at once
    for (int64_t p = p0; p < p1; p += run) {
      const int np = (int)std::min<int64_t>(run, p1 - p);
      const T* w = w2 + (e * P2 + p) * stride;
      for_tiles(n, [&](int64_t r0, int rows) {
        const float* ar[MR];
        float* yr[MR];
        float wt[MR];
        for (int i = 0; i < rows; ++i) {
          const int64_t pos = s + r0 + i, pair = order[pos];
          ar[i] = act + pos * Ip;
          yr[i] = weighted + pair * Hp + p * PW;
          wt[i] = topk_weights[pair];
        }
        down_rows<T>(rows, np, yr, wt, ar, w, stride, I, r0 == 0 ? w + np * stride : nullptr);
      });
    }
  }
  void sum(int64_t t) const {  // in place over the token's first slot
    float* w = weighted + t * k * Hp;
    for (int64_t j = 1; j < k; ++j)
      for (int64_t h = 0; h < H; ++h) w[h] += w[j * Hp + h];
    for (int64_t h = 0; h < H; ++h) store_out(out + t * os + h, w[h]);
  }
  void run(int tid, int nt) {
    claim(next->gate_up, A * G1, nt, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) gate_up(t);
    });
    barrier->wait(nt);
    claim(next->down, A * G2, nt, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) down(t);
    });
    barrier->wait(nt);
    for (int64_t t = tokens * tid / nt; t < tokens * (tid + 1) / nt; ++t) sum(t);
  }
};

MoeShape moe_shape(const at::Tensor& w13, const at::Tensor& w2, int64_t H, at::ScalarType dt) {
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.is_contiguous() && w2.is_contiguous() && w13.scalar_type() == dt &&
                  w2.scalar_type() == dt,
              "w13, w2: moe_pack'ed, contiguous, in x's dtype");
  const int64_t E = w13.size(0), pad = pad_steps(at::elementSize(dt)), I = w2.size(2) - pad;
  TORCH_CHECK(w13.size(3) == PW && w2.size(3) == PW && w13.size(2) == H + pad && w2.size(0) == E && I > 0 &&
                  w13.size(1) == (I + VW - 1) / VW && w2.size(1) == (H + PW - 1) / PW,
              "w13, w2: not moe_pack'ed for this build and x's width");
  return MoeShape{E, H, I, w13.size(1), w2.size(1), w13.size(1) * VW, w2.size(1) * PW};
}

template <typename T>
void moe_experts_region(const MoeShape& s, const float* x, int64_t xs, const T* w13, const T* w2,
                        const float* topk_weights, const int32_t* ids, int64_t tokens, int64_t k, float* act,
                        float* weighted, T* out, int64_t os, MoeTasks& tasks, SpinBarrier& bar, int tid, int nt) {
  // Every thread groups the pairs by expert itself (a few hundred integers): the same lists, no barrier.
  const int64_t E = s.E, pairs = tokens * k;
  std::vector<int64_t> start(E + 1, 0), order(pairs), active;
  for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[fill[ids[p]]++] = p;  // pair order kept within an expert
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);  // an idle expert's weights are never read

  Moe<T> m;
  m.x = x;
  m.xs = xs;
  m.w13 = w13;
  m.w2 = w2;
  m.topk_weights = topk_weights;
  m.tokens = tokens;
  m.k = k;
  m.H = s.H;
  m.pad = pad_steps(sizeof(T));
  m.I = s.I;
  m.P1 = s.P1;
  m.P2 = s.P2;
  m.G1 = (m.P1 + GROUP - 1) / GROUP;
  m.G2 = (m.P2 + GROUP - 1) / GROUP;
  m.Ip = s.Ip;
  m.Hp = s.Hp;
  m.start = start.data();
  m.order = order.data();
  m.active = active.data();
  m.A = (int64_t)active.size();
  m.act = act;
  m.weighted = weighted;
  m.out = out;
  m.os = os;
  m.next = &tasks;
  m.barrier = &bar;
  m.run(tid, nt);
}

template void moe_experts_region<float>(const MoeShape&, const float*, int64_t, const float*, const float*,
                                        const float*, const int32_t*, int64_t, int64_t, float*, float*, float*, int64_t,
                                        MoeTasks&, SpinBarrier&, int, int);
template void moe_experts_region<c10::BFloat16>(const MoeShape&, const float*, int64_t, const c10::BFloat16*,
                                                const c10::BFloat16*, const float*, const int32_t*, int64_t, int64_t,
                                                float*, float*, c10::BFloat16*, int64_t, MoeTasks&, SpinBarrier&, int,
                                                int);

template <typename T>
static void fused_moe_impl(at::Tensor& out, const at::Tensor& x, const MoeShape& s, const at::Tensor& w13,
                           const at::Tensor& w2, const float* topk_weights, const int32_t* ids, int64_t k,
                           int64_t min_macs_per_thread) {
  const int64_t tokens = x.size(0), pairs = tokens * k;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor act = at::empty({pairs, s.Ip}, x.options().dtype(at::kFloat));
  const at::Tensor weighted = at::empty({pairs, s.Hp}, x.options().dtype(at::kFloat));
  MoeTasks tasks;
  SpinBarrier bar;
  const auto run = [&](int tid, int nt) {
    moe_experts_region<T>(s, xf.data_ptr<float>(), xf.stride(0), w13.data_ptr<T>(), w2.data_ptr<T>(), topk_weights, ids,
                          tokens, k, act.data_ptr<float>(), weighted.data_ptr<float>(), out.data_ptr<T>(),
                          out.stride(0), tasks, bar, tid, nt);
  };
  // A sleeping pool costs tens of microseconds to wake: a small call stays on the calling thread.
  const int64_t macs = pairs * 3 * s.H * s.I;
  const int nt = at::in_parallel_region()
                     ? 1
                     : (int)std::min<int64_t>(at::get_num_threads(),
                                              std::max<int64_t>(1, macs / std::max<int64_t>(1, min_macs_per_thread)));
  if (nt == 1) {
    run(0, 1);
    return;
  }
#pragma omp parallel num_threads(nt)
  run(omp_get_thread_num(), omp_get_num_threads());
}

// out [T, H] = each token through its k experts (topk_ids int32 [T, k]) weighted by topk_weights (fp32 [T, k]),
// x [T, H] and the moe_pack'ed w13, w2 of one dtype, fp32 or bf16. Each thread takes min_macs_per_thread
// multiply-adds at least (fewer threads on a small call).
void fused_moe(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights,
               at::Tensor topk_ids, int64_t min_macs_per_thread) {
  check_rows(x, "x");
  check_rows(out, "out");
  const auto dt = x.scalar_type();
  const int64_t T_ = x.size(0), H = x.size(1);
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "fused_moe: fp32 or bf16");
  TORCH_CHECK(out.scalar_type() == dt && out.size(0) == T_ && out.size(1) == H, "out: [T, H] in x's dtype");
  const MoeShape shape = moe_shape(w13, w2, H, dt);
  const int64_t E = shape.E;
  TORCH_CHECK(
      topk_ids.scalar_type() == at::kInt && topk_ids.is_contiguous() && topk_ids.dim() == 2 && topk_ids.size(0) == T_,
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
    fused_moe_impl<float>(out, x, shape, w13, w2, topk_weights.data_ptr<float>(), ids, k, min_macs_per_thread);
  else
    fused_moe_impl<c10::BFloat16>(out, x, shape, w13, w2, topk_weights.data_ptr<float>(), ids, k, min_macs_per_thread);
}

// w [E, N, K] (fp32 or bf16) -> [E, P, K + pad_steps, PW]: panels of two vectors a step, zero past the outputs and
// in the pad steps. gate_up: w13, panel p pairs gate outputs p*VW.. with the same up outputs (I = N / 2); else panel
// p holds outputs p*PW... bf16 steps interleave the two vectors (step's layout).
at::Tensor moe_pack(at::Tensor w, bool gate_up) {
  TORCH_CHECK(w.dim() == 3 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "moe_pack: fp32 or bf16 [E, N, K]");
  TORCH_CHECK(!gate_up || w.size(1) % 2 == 0, "moe_pack: gate and up rows of one size");
  w = w.contiguous();
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2), I = N / 2;
  const int64_t P = gate_up ? (I + VW - 1) / VW : (N + PW - 1) / PW;
  const int64_t Ks = K + pad_steps(w.element_size());
  at::Tensor packed = at::zeros({E, P, Ks, PW}, w.options());
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
          char* col = dst + (t * Ks * PW + lane) * es;
          for (int64_t kk = 0; kk < K; ++kk) std::memcpy(col + kk * PW * es, row + kk * es, es);
        }
    }
  });
  return packed;
}
