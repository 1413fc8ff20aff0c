// Greedy sampling's argmax over each row of fp32 logits, vectorized (torch's CPU argmax scans a row one element
// at a time). The same answer as torch.argmax: the first maximum, or the first NaN where a row has one.
#include <immintrin.h>

#include "common.h"
#include "ops.h"

// NaN tested on the bits: -ffast-math may fold a float x != x test away.
static inline bool nan_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x7fffffffu) > 0x7f800000u;
}

static int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t arg = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (nan_bits(x[i])) return i;
    if (x[i] > x[arg]) arg = i;
  }
  return arg;
}

static int64_t argmax_row(const float* x, int64_t n) {
#ifdef __AVX512F__
  const int64_t whole = n / 16 * 16;
  if (whole == 0) return argmax_scalar(x, n);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i step = _mm512_set1_epi32(16);
  __m512 best = _mm512_loadu_ps(x);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), cur = idx;
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(best), abs_mask), inf_bits);
  for (int64_t i = 16; i < whole; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    cur = _mm512_add_epi32(cur, step);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, v);
    idx = _mm512_mask_mov_epi32(idx, gt, cur);
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
  }
  if (nan) return argmax_scalar(x, n);  // rare: the first NaN's index
  int64_t arg = argmax_lanes(best, idx);
  float m = x[arg];
  for (int64_t i = whole; i < n; ++i) {  // the tail comes after every index above
    if (nan_bits(x[i])) return i;
    if (x[i] > m) m = x[i], arg = i;
  }
  return arg;
#elif defined(__AVX2__)
  const int64_t whole = n / 8 * 8;  // the same scan in eight lanes
  if (whole == 0) return argmax_scalar(x, n);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 best = _mm256_loadu_ps(x);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = idx;
  __m256i nan = nan_lanes8(best);
  for (int64_t i = 8; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    cur = _mm256_add_epi32(cur, step);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm256_blendv_ps(best, v, gt);
    idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(cur), gt));
    nan = _mm256_or_si256(nan, nan_lanes8(v));
  }
  if (!_mm256_testz_si256(nan, nan)) return argmax_scalar(x, n);  // rare: the first NaN's index
  int64_t arg = argmax_lanes8(best, idx);
  float m = x[arg];
  for (int64_t i = whole; i < n; ++i) {  // the tail comes after every index above
    if (nan_bits(x[i])) return i;
    if (x[i] > m) m = x[i], arg = i;
  }
  return arg;
#else
  return argmax_scalar(x, n);
#endif
}

void argmax_rows(at::Tensor out, at::Tensor logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.size(1) > 0, "logits: float32 [rows, vocab > 0]");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "logits: a row under 2^31 elements");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == logits.size(0),
              "out: int64 [rows]");
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1), ld = logits.stride(0);
  at::parallel_for(0, logits.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * ld, n);
  });
}
