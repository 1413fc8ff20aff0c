// RMSNorm in HF's order: x * rsqrt(mean(x^2) + eps), rounded to the activations' dtype, then * weight, rounded.
#include <type_traits>

#include "common.h"
#include "ops.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_NORM 1
static inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // nearest even, as from_f
// bf16 rows 16 lanes at a time: the generic loop's residual add rounds each element (a branch for NaN), which
// kept it scalar, and its sum of squares was one dependent FMA an element. Here the squares sum in four 16-lane
// accumulators (chunk c into c % 4), added pairwise, then across lanes: the same order for every row.
static void rms_norm_rows_bf16(c10::BFloat16* out, int64_t os, c10::BFloat16* x, int64_t xs, c10::BFloat16* res,
                               int64_t rs, const c10::BFloat16* w, int64_t H, float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    c10::BFloat16* src = x + r * xs;
    c10::BFloat16* rr = res != nullptr ? res + r * rs : nullptr;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < H; i += 16) {
      __m512 f = load16(src + i);
      if (rr != nullptr) {  // residual <- x + residual, rounded to bf16 as HF adds
        const __m256i v = round16(_mm512_add_ps(f, load16(rr + i)));
        _mm256_storeu_si256((__m256i*)(rr + i), v);
        f = widen16(v);
      }
      acc[(i / 16) % 4] = _mm512_fmadd_ps(f, f, acc[(i / 16) % 4]);
    }
    if (rr != nullptr) src = rr;
    const float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / float(H) + eps));
    c10::BFloat16* o = out + r * os;
    for (int64_t i = 0; i < H; i += 16) {
      const __m512 normed = widen16(round16(_mm512_mul_ps(load16(src + i), inv)));
      _mm256_storeu_si256((__m256i*)(o + i), round16(_mm512_mul_ps(load16(w + i), normed)));
    }
  }
}
#else
#define HAVE_BF16_NORM 0
#endif

template <typename T>
__attribute__((noinline)) void rms_norm_rows(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w,
                                             int64_t H, float eps, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if HAVE_BF16_NORM
    if (H % 16 == 0) return rms_norm_rows_bf16(out, os, x, xs, res, rs, w, H, eps, begin, end);
#endif
  }
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

template void rms_norm_rows<float>(float*, int64_t, float*, int64_t, float*, int64_t, const float*, int64_t, float,
                                   int64_t, int64_t);
template void rms_norm_rows<c10::BFloat16>(c10::BFloat16*, int64_t, c10::BFloat16*, int64_t, c10::BFloat16*, int64_t,
                                           const c10::BFloat16*, int64_t, float, int64_t, int64_t);

template <typename T>
static void rms_norm_impl(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w, int64_t rows, int64_t H,
                          float eps) {
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    rms_norm_rows<T>(out, os, x, xs, res, rs, w, H, eps, begin, end);
  });
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [width]");
  TORCH_CHECK(
      out.sizes() == x.sizes() && weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
      "one dtype, out like x");
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
