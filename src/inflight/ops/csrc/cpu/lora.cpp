// Multi-LoRA on a linear's output (vLLM's punica shrink and expand, in one pass over a tile of rows of one
// adapter): for every row with an adapter slot, per output slice s, t = A[s, slot] x (R fp32 sums over K), then for the
// slice's outputs out[n] = out[n] + B[slot, n] . t, summed in fp32 and rounded once to out's dtype. A and B are stored
// transposed, so both steps are outer products: a vector of ranks (or of outputs) takes one multiply-add per k (or r),
// each value summed in an order that no row's address, neighbours or vector width changes. A row's bits do not depend
// on its batch, the thread count, or whether the per-op path or the layer stack ran it.
#include <vector>

#include "common.h"
#include "ops.h"

// The vectors pass only between this file's inline functions: no calling convention to keep across builds.
#pragma GCC diagnostic ignored "-Wpsabi"
// -ffast-math, but sums keep their written order and products round before they are added: GCC fuses a
// multiply-add in one loop and not in another, and an output must round the same wherever it is computed.
#pragma GCC optimize("no-associative-math", "fp-contract=off")

// The build's native fp32 vector as GCC vector extensions: sixteen lanes (one zmm) with AVX-512, eight (one ymm)
// elsewhere. Lanes never meet (no sums across them), so each width gives the same bits.
#ifdef __AVX512F__
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef uint16_t vu16 __attribute__((vector_size(2 * VW)));
typedef uint32_t vu32 __attribute__((vector_size(4 * VW)));
typedef int32_t vi32 __attribute__((vector_size(4 * VW)));

static inline vf lanes(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline vf lanes(const c10::BFloat16* p) {  // the bits into the top half (exact)
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu32) << 16);
}
// o[i] = round(o[i] + d[i]) for a vector of outputs: fp32, or bf16 rounded to nearest even as from_f (NaN kept).
static inline void add_store(float* o, const vf& d) {
  const vf v = lanes(o) + d;
  std::memcpy(o, &v, sizeof v);
}
static inline void add_store(c10::BFloat16* o, const vf& d) {
  const vf f = lanes(o) + d;
  vu32 u;
  std::memcpy(&u, &f, sizeof u);
  const vu32 nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu32 nan = (vu32)((vi32)((u & 0x7fffffffu) > 0x7f800000u));  // all ones where NaN
  const vu16 h = __builtin_convertvector((nan & 0x7fc0u) | (~nan & nearest), vu16);
  std::memcpy(o, &h, sizeof h);
}
static inline void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
// common.h's to_f, defined again under this file's options: GCC does not inline a function built with other
// optimization options, and a call per multiply-add costs most of the op.
static inline float scalar(float x) { return x; }
static inline float scalar(c10::BFloat16 x) {
  const uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A tile: up to MR rows of one adapter run together, so each vector of A and B read serves them all (a row alone
// streams its adapter's A and B from L2 again). A tile's accumulators fill at most ACC vector registers.
constexpr int MR = 4;
constexpr int ACC = VW == 16 ? 16 : 8;
static constexpr int vectors_for(int rows) {
  const int nv = ACC / rows;
  return nv < 1 ? 1 : (nv > 4 ? 4 : nv);
}

// t[m][r] = sum over k of x[m][k] * At[k][r] for M rows (At: A transposed, [K, R]), k in order: a vector of
// ranks takes one multiply-add per k; the tile's rows and vectors keep enough of them in flight.
template <int M, int NV, typename T>
static inline void shrink_tile(float* const* t, int64_t r0, const float* at, const T* const* x, int64_t R, int64_t K) {
  vf c[M][NV] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* row = at + k * R + r0;
    vf a[NV];
    for (int v = 0; v < NV; ++v) a[v] = lanes(row + VW * v);
    for (int m = 0; m < M; ++m) {
      const float xk = scalar(x[m][k]);
      for (int v = 0; v < NV; ++v) c[m][v] += xk * a[v];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) store(t[m] + r0 + VW * v, c[m][v]);
}
template <int M, typename T>
static void shrink(float* const* t, const float* at, const T* const* x, int64_t R, int64_t K) {
  constexpr int NV = vectors_for(M);
  int64_t r = 0;
  for (; r + NV * VW <= R; r += NV * VW) shrink_tile<M, NV>(t, r, at, x, R, K);
  for (; r + 2 * VW <= R; r += 2 * VW) shrink_tile<M, 2>(t, r, at, x, R, K);
  for (; r < R; r += VW) shrink_tile<M, 1>(t, r, at, x, R, K);
}

// out[m][n] = round(out[m][n] + sum over r of t[m][r] * Bt[r][n]) for M rows (Bt: B transposed, [R, N]), r in
// order: a vector of outputs takes one multiply-add per r.
template <int M, int NV, typename T>
static inline void expand_tile(T* const* out, int64_t n, const float* bt, const float* const* t, int64_t R, int64_t N) {
  vf c[M][NV] = {};
  for (int64_t r = 0; r < R; ++r) {
    const float* row = bt + r * N + n;
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = lanes(row + VW * v);
    for (int m = 0; m < M; ++m) {
      const float tr = t[m][r];
      for (int v = 0; v < NV; ++v) c[m][v] += tr * b[v];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) add_store(out[m] + n + VW * v, c[m][v]);
}
template <int M, typename T>
static void expand(T* const* out, const float* bt, const float* const* t, int64_t R, int64_t N, int64_t lo,
                   int64_t hi) {
  constexpr int NV = vectors_for(M);
  int64_t n = lo;
  for (; n + NV * VW <= hi; n += NV * VW) expand_tile<M, NV>(out, n, bt, t, R, N);
  for (; n + VW <= hi; n += VW) expand_tile<M, 1>(out, n, bt, t, R, N);
  if (n < hi) {  // the last outputs through the same code, on zero-padded copies
    const int64_t m = hi - n;
    alignas(64) float tail[MAX_LORA_RANK * VW] = {};
    for (int64_t r = 0; r < R; ++r) std::memcpy(tail + r * VW, bt + r * N + n, m * sizeof(float));
    T o[M][VW] = {};
    T* op[M];
    for (int i = 0; i < M; ++i) {
      std::memcpy(o[i], out[i] + n, m * sizeof(T));
      op[i] = o[i];
    }
    expand_tile<M, 1>(op, 0, tail, t, R, VW);
    for (int i = 0; i < M; ++i) std::memcpy(out[i] + n, o[i], m * sizeof(T));
  }
}

// M rows of one slot: per output slice, the shrink then the expand.
template <int M, typename T>
static void lora_tile(T* const* out, const T* const* x, const LoraWeights& w, int64_t slot) {
  alignas(64) float t[M][MAX_LORA_RANK];
  float* tp[M];
  for (int m = 0; m < M; ++m) tp[m] = t[m];
  const int64_t R = w.R;
  const float* bt = w.b + slot * R * w.N;
  for (int64_t s = 0; s < w.S; ++s) {
    shrink<M, T>(tp, w.a + (s * w.L + slot) * w.K * R, x, R, w.K);
    expand<M, T>(out, bt, tp, R, w.N, w.offsets[s], w.offsets[s + 1]);
  }
}

template <typename T>
__attribute__((noinline)) void lora_rows(T* out, int64_t os, const T* x, int64_t xs, const LoraWeights& w,
                                         const int32_t* slots, int64_t begin, int64_t end) {
  // the rows with an adapter, grouped by slot (row order kept within a slot), then tiles of up to MR rows
  std::vector<int64_t> rows;
  rows.reserve(end - begin);
  for (int64_t row = begin; row < end; ++row)
    if (slots[row] >= 0) rows.push_back(row);
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });
  for (size_t i = 0; i < rows.size();) {
    const int32_t slot = slots[rows[i]];
    int m = 0;
    T* op[MR];
    const T* xp[MR];
    for (; m < MR && i < rows.size() && slots[rows[i]] == slot; ++m, ++i) {
      op[m] = out + rows[i] * os;
      xp[m] = x + rows[i] * xs;
    }
    static_assert(MR == 4, "a tile of each size up to MR");
    if (m == 4)
      lora_tile<4, T>(op, xp, w, slot);
    else if (m == 3)
      lora_tile<3, T>(op, xp, w, slot);
    else if (m == 2)
      lora_tile<2, T>(op, xp, w, slot);
    else
      lora_tile<1, T>(op, xp, w, slot);
  }
}

template void lora_rows<float>(float*, int64_t, const float*, int64_t, const LoraWeights&, const int32_t*, int64_t,
                               int64_t);
template void lora_rows<c10::BFloat16>(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const LoraWeights&,
                                       const int32_t*, int64_t, int64_t);

LoraWeights lora_weights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, int64_t K, int64_t N) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 4 && a.size(2) == K,
              "lora a: A transposed, contiguous fp32 [slices, slots, in_features, rank]");
  const int64_t S = a.size(0), L = a.size(1), R = a.size(3);
  TORCH_CHECK(S >= 1 && R >= 16 && R <= MAX_LORA_RANK && R % 16 == 0, "lora a: at least one slice, a rank of 16 to ",
              MAX_LORA_RANK, " in whole 16s (zero-padded)");
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 3 && b.size(0) == L && b.size(1) == R &&
                  b.size(2) == N,
              "lora b: B transposed, contiguous fp32 [slots, rank, out_features]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.device().is_cpu() && offsets.is_contiguous() &&
                  offsets.numel() == S + 1,
              "lora offsets: int64 [slices + 1] on the CPU");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[S] == N, "lora offsets: from 0 to out_features");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(off[s] <= off[s + 1], "lora offsets: non-decreasing");
  return LoraWeights{a.data_ptr<float>(), b.data_ptr<float>(), off, S, L, R, K, N};
}

void check_lora_slots(const at::Tensor& token_slots, int64_t T, int64_t L) {
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.is_contiguous() && token_slots.numel() == T,
              "token_slots: int32 [T]");
  const int32_t* s = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(s[t] >= -1 && s[t] < L, "a LoRA slot outside the adapters' slots");
}

template <typename scalar_t>
static void lora_apply_impl(at::Tensor& out, const at::Tensor& x, const LoraWeights& w, const int32_t* slots,
                            int64_t rows_per_chunk) {
  scalar_t* o = out.data_ptr<scalar_t>();
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const int64_t os = out.stride(0), xs = x.stride(0);
  at::parallel_for(0, x.size(0), rows_per_chunk,
                   [&](int64_t begin, int64_t end) { lora_rows<scalar_t>(o, os, xp, xs, w, slots, begin, end); });
}

// out [T, N] += each row's adapter delta, in place; x [T, K] the linear's input, out's dtype (fp32 or bf16).
// Rows run on the calling thread below min_macs_per_thread multiply-adds a chunk (waking the pool costs more).
void lora_apply(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor offsets, at::Tensor token_slots,
                int64_t min_macs_per_thread) {
  check_rows(out, "out");
  check_rows(x, "x");
  const auto dt = out.scalar_type();
  TORCH_CHECK(x.size(0) == out.size(0) && x.scalar_type() == dt && (dt == at::kFloat || dt == at::kBFloat16),
              "x [T, K] and out [T, N]: one dtype, fp32 or bf16");
  const LoraWeights w = lora_weights(a, b, offsets, x.size(1), out.size(1));
  check_lora_slots(token_slots, x.size(0), w.L);
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  const int64_t row_macs = w.S * w.R * w.K + w.N * w.R;
  const int64_t rows_per_chunk = std::max<int64_t>(1, min_macs_per_thread / std::max<int64_t>(1, row_macs));
  if (dt == at::kFloat)
    lora_apply_impl<float>(out, x, w, slots, rows_per_chunk);
  else
    lora_apply_impl<c10::BFloat16>(out, x, w, slots, rows_per_chunk);
}
