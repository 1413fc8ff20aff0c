// What every CPU op shares: fp32 <-> bf16/fp16 conversions, the dtype dispatch, the parallel grain, checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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
template <typename T>
static inline T from_f(float f) {
  return static_cast<T>(f);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  c10::BFloat16 r;
  r.x = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return r;
}
// The value HF would hold after rounding to the activations' dtype (identity in fp32).
template <typename T>
static inline float round_to(float f) {
  return to_f(from_f<T>(f));
}

#ifdef __AVX512F__
#include <immintrin.h>
// Sixteen bf16 as fp32 lanes: the bits into the top half (exact).
static inline __m512 widen16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
// Sixteen values as fp32 lanes: loaded, or bf16 widened.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) { return widen16(_mm256_loadu_si256((const __m256i*)p)); }
// An argmax kept per lane (the best value of each lane, its index) reduced across lanes: the largest value, the
// first index among equals (torch.argmax's answer).
static inline int64_t argmax_lanes(__m512 best, __m512i idx) {
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, best);
  _mm512_store_epi32(bi, idx);
  int64_t arg = bi[0];
  float m = bv[0];
  for (int l = 1; l < 16; ++l)
    if (bv[l] > m || (bv[l] == m && bi[l] < arg)) m = bv[l], arg = bi[l];
  return arg;
}
#elif defined(__AVX2__)
#include <immintrin.h>
// argmax_lanes over eight lanes (AVX2).
static inline int64_t argmax_lanes8(__m256 best, __m256i idx) {
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256((__m256i*)bi, idx);
  int64_t arg = bi[0];
  float m = bv[0];
  for (int l = 1; l < 8; ++l)
    if (bv[l] > m || (bv[l] == m && bi[l] < arg)) m = bv[l], arg = bi[l];
  return arg;
}
// Lanes whose fp32 bits are NaN, all ones (on the bits: -ffast-math may fold a float x != x test away).
static inline __m256i nan_lanes8(__m256 v) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)),
                            _mm256_set1_epi32(0x7f800000));
}
#endif

#define DISPATCH(TYPE, NAME, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// Rows per parallel chunk: a small op runs on the calling thread, since waking the pool costs more than its work.
static inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

static inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with contiguous rows");
}
