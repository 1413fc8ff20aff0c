// Multi-LoRA on a linear's output (vLLM's punica shrink and expand, in one pass a row): for every row with an
// adapter slot, per output slice s, t = A[s, slot] x (R fp32 dot products over K), then for the slice's outputs
// out[n] = out[n] + B[slot, n] . t, summed in fp32 and rounded once to out's dtype. Each dot sums in one fixed
// order (16 lanes, then a fixed tree across them) that no row's address or neighbours change, so a row's bits do
// not depend on its batch, the thread count, or whether the per-op path or the layer stack ran it.
#include "common.h"
#include "ops.h"

// The vectors pass only between this file's inline functions: no calling convention to keep across builds.
#pragma GCC diagnostic ignored "-Wpsabi"

// Sixteen fp32 lanes as GCC vector extensions: one zmm register where the build has AVX-512 (as the other ops),
// two ymm with AVX2, plain code elsewhere; the same lanes and sums on each, so one source is tested everywhere.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline f32x16 lanes(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline f32x16 lanes(const c10::BFloat16* p) {  // the bits into the top half (exact)
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}
// o[i] = round(o[i] + d[i]) for sixteen outputs: fp32, or bf16 rounded to nearest even as from_f (NaN kept NaN).
static inline void add_store(float* o, const f32x16& d) {
  const f32x16 v = lanes(o) + d;
  std::memcpy(o, &v, sizeof v);
}
static inline void add_store(c10::BFloat16* o, const f32x16& d) {
  const f32x16 f = lanes(o) + d;
  u32x16 u;
  std::memcpy(&u, &f, sizeof u);
  const u32x16 nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32x16 nan = (u32x16)((i32x16)((u & 0x7fffffffu) > 0x7f800000u));  // all ones where NaN
  const u16x16 h = __builtin_convertvector((nan & 0x7fc0u) | (~nan & nearest), u16x16);
  std::memcpy(o, &h, sizeof h);
}

// The first n (< 16) values, zero past them; eight (a rank-8 adapter's B rows) in one load.
template <typename T>
static inline f32x16 partial(const T* p, int64_t n) {
  f32x16 v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = to_f(p[i]);
  return v;
}
static inline f32x16 partial(const float* p, int64_t n) {
  if (n == 8) {
    f32x8 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_shufflevector(h, f32x8{}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  f32x16 v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}
// Across lanes by halves (lane i + lane i+8, then +4, +2, +1): one tree for every dot.
static inline float sum(const f32x16& v) {
  const f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// sum(c[i]) for i < 16 as the lanes of one vector, by the same tree (lane k + k+8, then +4, +2, +1) on sixteen
// vectors at once: two shuffles and an add a step instead of a reduction an output.
static inline f32x16 sum16(const f32x16* c) {
  f32x16 w[8], x[4], y[2];
  for (int j = 0; j < 8; ++j)
    w[j] =
        __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(c[2 * j], c[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    x[j] = __builtin_shufflevector(w[2 * j], w[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * j], w[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    y[j] = __builtin_shufflevector(x[2 * j], x[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * j], x[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// t[r] = A[r] . x for r < R (A's rows K apart), four ranks at a time sharing x's loads; lane j sums k = j mod 16
// in order, the last K % 16 values last. A rank's sum is the same sequence whichever group it falls in.
template <typename T>
static void shrink(float* t, const float* a, const T* x, int64_t R, int64_t K) {
  const int64_t kv = K & ~int64_t(15), rem = K - kv;
  const f32x16 xt = partial(x + kv, rem);  // read once a row: every rank's tail uses it
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    const float *a0 = a + r * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
    f32x16 c0 = {}, c1 = {}, c2 = {}, c3 = {};
    for (int64_t k = 0; k < kv; k += 16) {
      const f32x16 xv = lanes(x + k);
      c0 += lanes(a0 + k) * xv;
      c1 += lanes(a1 + k) * xv;
      c2 += lanes(a2 + k) * xv;
      c3 += lanes(a3 + k) * xv;
    }
    if (rem) {
      c0 += partial(a0 + kv, rem) * xt;
      c1 += partial(a1 + kv, rem) * xt;
      c2 += partial(a2 + kv, rem) * xt;
      c3 += partial(a3 + kv, rem) * xt;
    }
    t[r] = sum(c0), t[r + 1] = sum(c1), t[r + 2] = sum(c2), t[r + 3] = sum(c3);
  }
  for (; r < R; ++r) {
    const float* ar = a + r * K;
    f32x16 c = {};
    for (int64_t k = 0; k < kv; k += 16) c += lanes(ar + k) * lanes(x + k);
    if (rem) c += partial(ar + kv, rem) * xt;
    t[r] = sum(c);
  }
}

// out[n] = round(out[n] + B[n] . t) for n in lo..hi (B's rows R apart), the dot in the same lane order; sixteen
// outputs at a time reduced together, the rest one by one, each output by the same tree.
template <typename T>
static void expand(T* out, const float* b, const float* t, int64_t R, int64_t lo, int64_t hi) {
  const int64_t rv = R & ~int64_t(15), rem = R - rv;
  const f32x16 tt = partial(t + rv, rem);
  const auto lanes_of = [&](int64_t n) {
    const float* bn = b + n * R;
    f32x16 c = {};
    for (int64_t j = 0; j < rv; j += 16) c += lanes(bn + j) * lanes(t + j);
    if (rem) c += partial(bn + rv, rem) * tt;
    return c;
  };
  int64_t n = lo;
  for (; n + 16 <= hi; n += 16) {
    f32x16 c[16];
    for (int i = 0; i < 16; ++i) c[i] = lanes_of(n + i);
    add_store(out + n, sum16(c));
  }
  for (; n < hi; ++n) out[n] = from_f<T>(to_f(out[n]) + sum(lanes_of(n)));
}

template <typename T>
__attribute__((noinline)) void lora_rows(T* out, int64_t os, const T* x, int64_t xs, const LoraWeights& w,
                                         const int32_t* slots, int64_t begin, int64_t end) {
  float t[MAX_LORA_RANK];
  const int64_t R = w.R;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t slot = slots[row];
    if (slot < 0) continue;
    const T* xr = x + row * xs;
    T* o = out + row * os;
    const float* b = w.b + slot * w.N * R;
    for (int64_t s = 0; s < w.S; ++s) {
      shrink<T>(t, w.a + (s * w.L + slot) * R * w.K, xr, R, w.K);
      expand<T>(o, b, t, R, w.offsets[s], w.offsets[s + 1]);
    }
  }
}

template void lora_rows<float>(float*, int64_t, const float*, int64_t, const LoraWeights&, const int32_t*, int64_t,
                               int64_t);
template void lora_rows<c10::BFloat16>(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const LoraWeights&,
                                       const int32_t*, int64_t, int64_t);

LoraWeights lora_weights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, int64_t K, int64_t N) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 4 && a.size(3) == K,
              "lora a: contiguous fp32 [slices, slots, rank, in_features]");
  const int64_t S = a.size(0), L = a.size(1), R = a.size(2);
  TORCH_CHECK(S >= 1 && R >= 1 && R <= MAX_LORA_RANK, "lora a: at least one slice, a rank of 1 to ", MAX_LORA_RANK);
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 3 && b.size(0) == L && b.size(1) == N &&
                  b.size(2) == R,
              "lora b: contiguous fp32 [slots, out_features, rank]");
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
