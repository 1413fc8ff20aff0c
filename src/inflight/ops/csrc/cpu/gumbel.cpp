// Random sampling's Gumbel-max in one pass over each row: the sampler's noise (executor/sampling_noise.py: lowbias32
// of (row key, vocab id), u = x / 2^32 clamped, -log(-log1p(-u))) added to the row divided by its temperature,
// and the argmax, instead of ~20 elementwise torch passes over [rows, vocab]. The vector log1p and log are
// SLEEF's, found in the loaded libtorch_cpu; the noise op and the argmax op share one function, so a token's
// noise is the same bits on either path (a top-k window's or the whole vocabulary's).
#include <dlfcn.h>
#include <immintrin.h>

#include "common.h"
#include "ops.h"

namespace {

constexpr uint32_t C1 = 0x7FEB352Du, C2 = 0x846CA68Bu;
constexpr float U_SCALE = -0x1p-32f, U_LO = -(1.0f - 0x1p-24f), U_HI = -0x1p-33f;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= C1;
  x ^= x >> 15;
  x *= C2;
  x ^= x >> 16;
  return x;
}

// Not inlined: a loop of inlined calls gets vectorized through libmvec's log (-ffast-math, AVX2), which rounds
// otherwise than the scalar log of the loop's tail, and a token's noise would depend on its position.
__attribute__((noinline)) float noise1(uint32_t key, uint32_t hashed) {
  const float f = std::min(std::max(float(mix32(key ^ hashed)) * U_SCALE, U_LO), U_HI);
  return -std::log(-std::log1p(f));
}

#ifdef __AVX512F__
using Vec16Fn = __m512 (*)(__m512);

// Sixteen lanes of f through a scalar function: where libtorch_cpu exports no SLEEF.
template <float (*F)(float)>
__m512 each_lane(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  for (float& x : a) x = F(x);
  return _mm512_load_ps(a);
}
float log1p_f(float x) { return std::log1p(x); }
float log_f(float x) { return std::log(x); }

// SLEEF's vector log1p and log (1.0 ulp), torch's own, looked up once in the loaded libtorch_cpu (in the global
// scope, else through the library itself, which this module links: loaded, whatever its dlopen flags were).
struct Logs {
  Vec16Fn log1p = nullptr, log = nullptr;
  bool sleef = false;
  Logs() {
    for (void* where : {RTLD_DEFAULT, dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)}) {
      if (where == nullptr) continue;
      log1p = reinterpret_cast<Vec16Fn>(dlsym(where, "Sleef_log1pf16_u10"));
      log = reinterpret_cast<Vec16Fn>(dlsym(where, "Sleef_logf16_u10"));
      if ((sleef = log1p != nullptr && log != nullptr)) return;
    }
    log1p = each_lane<log1p_f>, log = each_lane<log_f>;
  }
};
const Logs& logs() {
  static const Logs l;
  return l;
}

inline __m512 noise16(__m512i key, __m512i hashed) {
  __m512i x = _mm512_xor_si512(key, hashed);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(C1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(C2)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  __m512 f = _mm512_mul_ps(_mm512_cvtepu32_ps(x), _mm512_set1_ps(U_SCALE));
  f = _mm512_min_ps(_mm512_max_ps(f, _mm512_set1_ps(U_LO)), _mm512_set1_ps(U_HI));
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const Logs& l = logs();
  return _mm512_xor_ps(l.log(_mm512_xor_ps(l.log1p(f), sign)), sign);
}
#elif defined(__AVX2__)
using Vec8Fn = __m256 (*)(__m256);

// Eight lanes of f through a scalar function: where libtorch_cpu exports no SLEEF.
template <float (*F)(float)>
__m256 each_lane(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  for (float& x : a) x = F(x);
  return _mm256_load_ps(a);
}
float log1p_f(float x) { return std::log1p(x); }
float log_f(float x) { return std::log(x); }

// SLEEF's eight-lane log1p and log (1.0 ulp), found as the AVX-512 build finds its sixteen-lane ones.
struct Logs {
  Vec8Fn log1p = nullptr, log = nullptr;
  bool sleef = false;
  Logs() {
    for (void* where : {RTLD_DEFAULT, dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)}) {
      if (where == nullptr) continue;
      log1p = reinterpret_cast<Vec8Fn>(dlsym(where, "Sleef_log1pf8_u10"));
      log = reinterpret_cast<Vec8Fn>(dlsym(where, "Sleef_logf8_u10"));
      if ((sleef = log1p != nullptr && log != nullptr)) return;
    }
    log1p = each_lane<log1p_f>, log = each_lane<log_f>;
  }
};
const Logs& logs() {
  static const Logs l;
  return l;
}

inline __m256i lane_mask8(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::min<int64_t>(valid, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 noise8(__m256i key, __m256i hashed) {
  __m256i x = _mm256_xor_si256(key, hashed);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(C1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(C2)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  // float(x) of a uint32 (AVX2 converts signed lanes only): both 16-bit halves exact, one rounding of their sum;
  // scaling by powers of two is exact, so any order -ffast-math picks gives noise1's value.
  const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 16)), _mm256_set1_ps(65536.0f));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)));
  __m256 f = _mm256_mul_ps(_mm256_add_ps(hi, lo), _mm256_set1_ps(U_SCALE));
  f = _mm256_min_ps(_mm256_max_ps(f, _mm256_set1_ps(U_LO)), _mm256_set1_ps(U_HI));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const Logs& l = logs();
  return _mm256_xor_ps(l.log(_mm256_xor_ps(l.log1p(f), sign)), sign);
}

// a / b, correctly rounded: vdivps itself (-ffast-math may turn a written division into a reciprocal's product).
inline __m256 divide8(__m256 a, __m256 b) {
  __m256 r;
  asm("vdivps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}
#endif

// x / t, correctly rounded as torch divides: -ffast-math may otherwise turn it into x * (1 / t).
__attribute__((noinline, optimize("no-fast-math"))) float divide(float x, float t) { return x / t; }

// Noise for n ids of one row (hashed: the ids' lowbias32 hashes, a uint32 each).
void noise_row(float* out, uint32_t key, const int32_t* hashed, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512i k = _mm512_set1_epi32(int32_t(key));
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, noise16(k, _mm512_loadu_si512(hashed + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, m, noise16(k, _mm512_maskz_loadu_epi32(m, hashed + i)));
    return;
  }
#elif defined(__AVX2__)
  const __m256i k = _mm256_set1_epi32(int32_t(key));
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, noise8(k, _mm256_loadu_si256((const __m256i*)(hashed + i))));
  if (i < n) {  // the tail through the same vector function: a token's noise does not depend on its place
    const __m256i m = lane_mask8(n - i);
    _mm256_maskstore_ps(out + i, m, noise8(k, _mm256_maskload_epi32(hashed + i, m)));
    return;
  }
#endif
  for (; i < n; ++i) out[i] = noise1(key, uint32_t(hashed[i]));
}

// argmax(x / t + noise) of one row, where x / t >= floor (others never win): torch.argmax's answer on those
// scores, the first maximum, or the first NaN. Scalar, through the noise of noise_row: the path for NaN rows.
int64_t argmax_row_scalar(const float* x, float t, uint32_t key, const int32_t* hashed, int64_t n, float floor) {
  constexpr int64_t CHUNK = 1024;
  float buf[CHUNK];
  int64_t arg = -1;
  float best = 0.0f;
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t len = std::min(CHUNK, n - c);
    noise_row(buf, key, hashed + c, len);
    for (int64_t i = 0; i < len; ++i) {
      const float v = divide(x[c + i], t);
      uint32_t u;  // NaN tested on the bits, before any compare (-ffast-math assumes no NaN); noise is finite
      std::memcpy(&u, &v, 4);
      if ((u & 0x7fffffffu) > 0x7f800000u) return c + i;
      const float s = v < floor ? -INFINITY : v + buf[i];
      if (arg < 0 || s > best) best = s, arg = c + i;
    }
  }
  return arg;
}

int64_t argmax_row(const float* x, float t, uint32_t key, const int32_t* hashed, int64_t n, float floor) {
#ifdef __AVX512F__
  const __m512i k = _mm512_set1_epi32(int32_t(key)), abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000), step = _mm512_set1_epi32(16);
  const __m512 fl = _mm512_set1_ps(floor), ninf = _mm512_set1_ps(-INFINITY), temp = _mm512_set1_ps(t);
  __mmask16 nan = 0;
  auto score = [&](int64_t i) {  // past the row's end, and below the floor: -inf
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    // the division rounds as torch's does (an explicit rounding mode: never a reciprocal under -ffast-math)
    const __m512 v =
        _mm512_div_round_ps(_mm512_maskz_loadu_ps(m, x + i), temp, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // NaN on the bits (a NaN row goes the scalar way); the noise is finite, so only x can make one
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
    const __m512 s = _mm512_add_ps(v, noise16(k, _mm512_maskz_loadu_epi32(m, hashed + i)));
    return _mm512_mask_blend_ps(m & ~_mm512_cmp_ps_mask(v, fl, _CMP_LT_OQ), ninf, s);
  };
  // Lane l holds the best of elements l, l + 16, ...: the first maximum per lane, then across lanes.
  __m512 best = score(0);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), cur = idx;
  for (int64_t i = 16; i < n; i += 16) {
    const __m512 v = score(i);
    cur = _mm512_add_epi32(cur, step);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    idx = _mm512_mask_mov_epi32(idx, gt, cur);
  }
  if (nan) return argmax_row_scalar(x, t, key, hashed, n, floor);
  return argmax_lanes(best, idx);  // lanes past a short row hold -inf at indices past it: they never win
#elif defined(__AVX2__)
  const __m256i k = _mm256_set1_epi32(int32_t(key)), step = _mm256_set1_epi32(8);
  const __m256 fl = _mm256_set1_ps(floor), ninf = _mm256_set1_ps(-INFINITY), temp = _mm256_set1_ps(t);
  __m256i nan = _mm256_setzero_si256();
  auto score = [&](int64_t i) {  // the AVX-512 path's, in eight lanes
    const __m256i m = lane_mask8(n - i);
    const __m256 v = divide8(_mm256_maskload_ps(x + i, m), temp);
    nan = _mm256_or_si256(nan, nan_lanes8(v));  // lanes past the row hold 0 / t: never NaN
    const __m256 s = _mm256_add_ps(v, noise8(k, _mm256_maskload_epi32(hashed + i, m)));
    const __m256 keep = _mm256_andnot_ps(_mm256_cmp_ps(v, fl, _CMP_LT_OQ), _mm256_castsi256_ps(m));
    return _mm256_blendv_ps(ninf, s, keep);
  };
  __m256 best = score(0);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = idx;
  for (int64_t i = 8; i < n; i += 8) {
    const __m256 v = score(i);
    cur = _mm256_add_epi32(cur, step);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(cur), gt));
  }
  if (!_mm256_testz_si256(nan, nan)) return argmax_row_scalar(x, t, key, hashed, n, floor);
  return argmax_lanes8(best, idx);
#else
  return argmax_row_scalar(x, t, key, hashed, n, floor);
#endif
}

void check_keys(const at::Tensor& keys, int64_t rows) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.numel() == rows, "keys: int64 [rows]");
}

}  // namespace

bool gumbel_vector_logs() {
#if defined(__AVX512F__) || defined(__AVX2__)
  return logs().sleef;
#else
  return false;
#endif
}

void gumbel_noise(at::Tensor out, at::Tensor keys, at::Tensor hashed) {
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out: float32");
  check_keys(keys, out.size(0));
  TORCH_CHECK(hashed.scalar_type() == at::kInt && hashed.stride(-1) == 1, "hashed: int32, rows contiguous");
  TORCH_CHECK(hashed.size(-1) == out.size(1) && (hashed.dim() == 1 || hashed.sizes() == out.sizes()),
              "hashed: [width] or out's [rows, width]");
  const int64_t n = out.size(1), hs = hashed.dim() == 1 ? 0 : hashed.stride(0);
  float* o = out.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int32_t* h = hashed.data_ptr<int32_t>();
  at::parallel_for(0, out.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) noise_row(o + r * out.stride(0), uint32_t(k[r]), h + r * hs, n);
  });
}

void gumbel_argmax(at::Tensor out, at::Tensor logits, at::Tensor temperature, at::Tensor keys, at::Tensor hashed,
                   std::optional<at::Tensor> floor) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.size(1) > 0, "logits: float32 [rows, vocab > 0]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == rows,
              "temperature: float32 [rows]");
  check_keys(keys, rows);
  TORCH_CHECK(hashed.scalar_type() == at::kInt && hashed.is_contiguous() && hashed.dim() == 1 && hashed.numel() == n,
              "hashed: int32 [vocab]");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows, "out: int64 [rows]");
  const float* fl = nullptr;
  if (floor.has_value()) {
    TORCH_CHECK(floor->scalar_type() == at::kFloat && floor->is_contiguous() && floor->numel() == rows,
                "floor: float32 [rows]");
    fl = floor->data_ptr<float>();
  }
  const float* x = logits.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int32_t* h = hashed.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = argmax_row(x + r * logits.stride(0), temp[r], uint32_t(k[r]), h, n, fl ? fl[r] : -INFINITY);
  });
}
