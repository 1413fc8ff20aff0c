// GGUF weights computed as shipped: a linear keeps the file's 4/5/6/8-bit quants and fp16 scales, repacked
// once into panels of NR outputs, and the GEMM dequantizes them in registers (16 outputs a vector, one
// k-pair at a time), accumulating in fp32; activations stay fp32 or bf16 (llama.cpp's int8 activations: no).
//
// Exactness: every format's weight is a*q + b (b = 0 or a block minimum), with a, b and the product exact in
// fp32 (fp16 or fp16 x 6-bit scales times a <= 6-bit q), so fma(a, q, b) gives gguf.quants.dequantize's
// bits. Each output then sums fma(x[k], w[k], acc) in k order (bf16: vdpbf16ps on the rounded pairs), the
// same instructions as our GEMM (gemm.cpp): the result equals our GEMM over the dequantized weight, bit for
// bit, at any batch size. Chunks of more rows than a fused kernel holds dequantize their panel once into a
// scratch in gemm.cpp's layout and run gemm_range itself on it (the AMX tiles too, where bf16 uses them).
// With AVX2 (fp32 only) the same arithmetic runs in 8-lane vectors, one to three of a panel's six at a time.
//
// Packed layout: panel p (outputs 48p..48p+47) holds the row's blocks in k order, each block a record of
// structure-of-arrays over the 48 lanes: fp16 scales [48], 6-bit scales u8 [groups][48], high quant bits
// u32 [groups][48] (bit k of a group, or bits 2k..2k+1 for Q6_K), quants [k/2][48] (one byte per k-pair:
// low nibble k, high nibble k+1; Q8_0: int8 [k][48]). The record is the same bytes as the file's blocks.
#include "gguf_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "ops.h"

#define INLINE inline __attribute__((always_inline))
#define LAMBDA_INLINE __attribute__((always_inline))

namespace {

constexpr int FUSED_ROWS = 8;  // rows a fused kernel holds (3 accumulators each); more share a dequantized panel

static inline void put_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
static inline uint32_t get_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef __AVX512F__
static INLINE __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static INLINE __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static INLINE __m512i sbytes16(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
// float(nibble - offset) of each lane's low 4 bits by one vpermps (which reads only those bits): the and, the
// offset's subtraction and the conversion in one instruction, the same exact values.
static INLINE __m512 nibble_table(int offset) {
  return _mm512_sub_ps(_mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_ps((float)offset));
}
static INLINE __m512 low_nibbles(__m512i b, __m512 table) { return _mm512_permutexvar_ps(b, table); }

// Weights k and k+1 of 16 lanes from their byte b (low nibble k, high nibble k+1) as floats less OFFSET; with
// HIGH, each weight's fifth bit comes from h (bit 2i weight k, bit 2i+1 weight k+1), which moves on two bits.
template <bool HIGH, int OFFSET>
static INLINE void nibble_pair(__m512i b, __m512i& h, __m512 table, __m512& q0, __m512& q1) {
  if (!HIGH) {
    q0 = low_nibbles(b, table), q1 = low_nibbles(_mm512_srli_epi32(b, 4), table);
    return;
  }
  const __m512i low4 = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
  __m512i lo = _mm512_and_si512(b, low4), hi = _mm512_srli_epi32(b, 4);
  lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(h, 4), bit4));
  hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi32(h, 3), bit4));
  h = _mm512_srli_epi32(h, 2);
  if (OFFSET)
    lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(OFFSET)), hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(OFFSET));
  q0 = _mm512_cvtepi32_ps(lo), q1 = _mm512_cvtepi32_ps(hi);
}
#elif GEMM_F32
// AVX2: the same values eight lanes a vector, the nibbles masked and converted.
static INLINE __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static INLINE __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static INLINE __m256i sbytes8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

template <bool HIGH, int OFFSET>
static INLINE void nibble_pair8(__m256i b, __m256i& h, __m256& q0, __m256& q1) {
  __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(b, 4);
  if (HIGH) {
    const __m256i bit4 = _mm256_set1_epi32(16);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(h, 4), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32(h, 3), bit4));
    h = _mm256_srli_epi32(h, 2);
  }
  if (OFFSET)
    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(OFFSET)), hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(OFFSET));
  q0 = _mm256_cvtepi32_ps(lo), q1 = _mm256_cvtepi32_ps(hi);
}
#endif

// ---- formats: the file's block (repack) and the packed record's dequantization (block) ----
// block(rec, fn) calls fn(k, w0, w1) for k = 0, 2, .., SB - 2 in order, w0/w1 the fp32 weights of k and k+1
// for the 48 lanes (three vectors each); AVX2's lanes<NV>(rec, c, fn) the same for lanes c..c+8NV-1 (NV vectors).

struct Q8_0F {
  static constexpr int SB = 32, FILE_BYTES = 34, BYTES = 48 * 34;
  static void repack(const uint8_t* src, uint8_t* rec, int j) {
    std::memcpy(rec + 2 * j, src, 2);
    for (int k = 0; k < 32; ++k) rec[96 + k * 48 + j] = src[2 + k];
  }
#ifdef __AVX512F__
  template <class Fn>
  static INLINE void block(const uint8_t* rec, Fn&& fn) {
    __m512 a[3];
    for (int j = 0; j < 3; ++j) a[j] = half16(rec + 32 * j);
    const uint8_t* qs = rec + 96;
    for (int k = 0; k < 32; k += 2) {
      __m512 w0[3], w1[3];
      for (int j = 0; j < 3; ++j) {
        w0[j] = _mm512_mul_ps(a[j], _mm512_cvtepi32_ps(sbytes16(qs + k * 48 + 16 * j)));
        w1[j] = _mm512_mul_ps(a[j], _mm512_cvtepi32_ps(sbytes16(qs + (k + 1) * 48 + 16 * j)));
      }
      fn(k, w0, w1);
    }
  }
#elif GEMM_F32
  template <int NV, class Fn>
  static INLINE void lanes(const uint8_t* rec, int c, Fn&& fn) {
    __m256 a[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) a[j] = half8(rec + 2 * (c + 8 * j));
    const uint8_t* qs = rec + 96 + c;
    for (int k = 0; k < 32; k += 2) {
      __m256 w0[NV], w1[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        w0[j] = _mm256_mul_ps(a[j], _mm256_cvtepi32_ps(sbytes8(qs + k * 48 + 8 * j)));
        w1[j] = _mm256_mul_ps(a[j], _mm256_cvtepi32_ps(sbytes8(qs + (k + 1) * 48 + 8 * j)));
      }
      fn(k, w0, w1);
    }
  }
#endif
};

// Q4_0 (d * (q - 8)), Q4_1 (d * q + m), Q5_0 (d * (q - 16)), Q5_1 (d * q + m): 32-weight blocks.
template <bool HAS_M, bool HIGH, int OFFSET>
struct Q32F {
  static constexpr int SB = 32, FILE_BYTES = 18 + 2 * HAS_M + 4 * HIGH, BYTES = 48 * FILE_BYTES;
  static constexpr int M_OFF = 96, H_OFF = 96 * (1 + HAS_M), Q_OFF = H_OFF + 192 * HIGH;
  static void repack(const uint8_t* src, uint8_t* rec, int j) {
    std::memcpy(rec + 2 * j, src, 2);
    if (HAS_M) std::memcpy(rec + M_OFF + 2 * j, src + 2, 2);
    const uint8_t* qs = src + 2 + 2 * HAS_M + 4 * HIGH;
    if (HIGH) std::memcpy(rec + H_OFF + 4 * j, src + 2 + 2 * HAS_M, 4);  // bit i: weight i's fifth bit
    auto q = [&](int i) { return (qs[i % 16] >> (4 * (i / 16))) & 15; };
    for (int p = 0; p < 16; ++p) rec[Q_OFF + p * 48 + j] = uint8_t(q(2 * p) | (q(2 * p + 1) << 4));
  }
#ifdef __AVX512F__
  template <class Fn>
  static INLINE void block(const uint8_t* rec, Fn&& fn) {
    __m512 a[3], m[3];
    __m512i h[3];
    for (int j = 0; j < 3; ++j) {
      a[j] = half16(rec + 32 * j);
      m[j] = HAS_M ? half16(rec + M_OFF + 32 * j) : _mm512_setzero_ps();
      if (HIGH) h[j] = _mm512_loadu_si512(rec + H_OFF + 64 * j);
    }
    const __m512 table = nibble_table(OFFSET);
    const uint8_t* qs = rec + Q_OFF;
    for (int k = 0; k < 32; k += 2) {
      __m512 w0[3], w1[3];
      for (int j = 0; j < 3; ++j) {
        const __m512i b = bytes16(qs + (k / 2) * 48 + 16 * j);
        __m512 q0, q1;
        nibble_pair<HIGH, OFFSET>(b, h[j], table, q0, q1);
        if (HAS_M) {  // d * q exact: one rounding either way
          w0[j] = _mm512_fmadd_ps(a[j], q0, m[j]);
          w1[j] = _mm512_fmadd_ps(a[j], q1, m[j]);
        } else {
          w0[j] = _mm512_mul_ps(a[j], q0);
          w1[j] = _mm512_mul_ps(a[j], q1);
        }
      }
      fn(k, w0, w1);
    }
  }
#elif GEMM_F32
  template <int NV, class Fn>
  static INLINE void lanes(const uint8_t* rec, int c, Fn&& fn) {
    __m256 a[NV], m[NV];
    __m256i h[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      a[j] = half8(rec + 2 * (c + 8 * j));
      m[j] = HAS_M ? half8(rec + M_OFF + 2 * (c + 8 * j)) : _mm256_setzero_ps();
      h[j] = HIGH ? _mm256_loadu_si256((const __m256i*)(rec + H_OFF + 4 * (c + 8 * j))) : _mm256_setzero_si256();
    }
    const uint8_t* qs = rec + Q_OFF + c;
    for (int k = 0; k < 32; k += 2) {
      __m256 w0[NV], w1[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        __m256 q0, q1;
        nibble_pair8<HIGH, OFFSET>(bytes8(qs + (k / 2) * 48 + 8 * j), h[j], q0, q1);
        if (HAS_M) {
          w0[j] = _mm256_fmadd_ps(a[j], q0, m[j]);
          w1[j] = _mm256_fmadd_ps(a[j], q1, m[j]);
        } else {
          w0[j] = _mm256_mul_ps(a[j], q0);
          w1[j] = _mm256_mul_ps(a[j], q1);
        }
      }
      fn(k, w0, w1);
    }
  }
#endif
};

// Q4_K, Q5_K: 256-weight super-blocks of 8 groups of 32, w = (d * sc) * q - (dmin * m), sc and m 6-bit.
template <bool HIGH>
struct QKF {
  static constexpr int SB = 256, FILE_BYTES = HIGH ? 176 : 144, BYTES = 48 * (FILE_BYTES + 4);
  static constexpr int SC_OFF = 192, MN_OFF = 192 + 384, H_OFF = 960, Q_OFF = 960 + 1536 * HIGH;
  static void repack(const uint8_t* src, uint8_t* rec, int j) {
    std::memcpy(rec + 2 * j, src, 2);
    std::memcpy(rec + 96 + 2 * j, src + 2, 2);
    const uint8_t* s = src + 4;  // gguf's Q4_K.get_scale_min
    for (int g = 0; g < 4; ++g) {
      rec[SC_OFF + g * 48 + j] = s[g] & 63;
      rec[SC_OFF + (g + 4) * 48 + j] = (s[8 + g] & 15) | ((s[g] >> 2) & 0x30);
      rec[MN_OFF + g * 48 + j] = s[4 + g] & 63;
      rec[MN_OFF + (g + 4) * 48 + j] = (s[8 + g] >> 4) | ((s[4 + g] >> 2) & 0x30);
    }
    const uint8_t *qh = src + 16, *qs = src + 16 + 32 * HIGH;
    auto q = [&](int w) {
      const int s = w / 32, l = w % 32;
      return ((qs[32 * (s / 2) + l] >> (4 * (s & 1))) & 15) | (HIGH ? ((qh[l] >> s) & 1) << 4 : 0);
    };
    for (int g = 0; g < 8; ++g) {
      if (HIGH) {
        uint32_t bits = 0;
        for (int l = 0; l < 32; ++l) bits |= uint32_t(q(32 * g + l) >> 4) << l;
        put_u32(rec + H_OFF + g * 192 + 4 * j, bits);
      }
      for (int p = 0; p < 16; ++p)
        rec[Q_OFF + (g * 16 + p) * 48 + j] = uint8_t((q(32 * g + 2 * p) & 15) | ((q(32 * g + 2 * p + 1) & 15) << 4));
    }
  }
#ifdef __AVX512F__
  template <class Fn>
  static INLINE void block(const uint8_t* rec, Fn&& fn) {
    __m512 d[3], dmin[3];
    for (int j = 0; j < 3; ++j) d[j] = half16(rec + 32 * j), dmin[j] = half16(rec + 96 + 32 * j);
    const __m512 table = nibble_table(0);
    for (int g = 0; g < 8; ++g) {
      __m512 a[3], m[3];
      __m512i h[3];
      for (int j = 0; j < 3; ++j) {
        a[j] = _mm512_mul_ps(d[j], _mm512_cvtepi32_ps(bytes16(rec + SC_OFF + g * 48 + 16 * j)));
        m[j] = _mm512_mul_ps(dmin[j], _mm512_cvtepi32_ps(bytes16(rec + MN_OFF + g * 48 + 16 * j)));
        if (HIGH) h[j] = _mm512_loadu_si512(rec + H_OFF + g * 192 + 64 * j);
      }
      const uint8_t* qs = rec + Q_OFF + g * 16 * 48;
      for (int k = 0; k < 32; k += 2) {
        __m512 w0[3], w1[3];
        for (int j = 0; j < 3; ++j) {
          const __m512i b = bytes16(qs + (k / 2) * 48 + 16 * j);
          __m512 q0, q1;
          nibble_pair<HIGH, 0>(b, h[j], table, q0, q1);
          // (d * sc) * q is exact (17 x 5 bits): fused with the subtraction, the same single rounding
          w0[j] = _mm512_fmsub_ps(a[j], q0, m[j]);
          w1[j] = _mm512_fmsub_ps(a[j], q1, m[j]);
        }
        fn(32 * g + k, w0, w1);
      }
    }
  }
#elif GEMM_F32
  template <int NV, class Fn>
  static INLINE void lanes(const uint8_t* rec, int c, Fn&& fn) {
    __m256 d[NV], dmin[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) d[j] = half8(rec + 2 * (c + 8 * j)), dmin[j] = half8(rec + 96 + 2 * (c + 8 * j));
    for (int g = 0; g < 8; ++g) {
      __m256 a[NV], m[NV];
      __m256i h[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        const int l = c + 8 * j;
        a[j] = _mm256_mul_ps(d[j], _mm256_cvtepi32_ps(bytes8(rec + SC_OFF + g * 48 + l)));
        m[j] = _mm256_mul_ps(dmin[j], _mm256_cvtepi32_ps(bytes8(rec + MN_OFF + g * 48 + l)));
        h[j] = HIGH ? _mm256_loadu_si256((const __m256i*)(rec + H_OFF + g * 192 + 4 * l)) : _mm256_setzero_si256();
      }
      const uint8_t* qs = rec + Q_OFF + g * 16 * 48 + c;
      for (int k = 0; k < 32; k += 2) {
        __m256 w0[NV], w1[NV];
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) {
          __m256 q0, q1;
          nibble_pair8<HIGH, 0>(bytes8(qs + (k / 2) * 48 + 8 * j), h[j], q0, q1);
          w0[j] = _mm256_fmsub_ps(a[j], q0, m[j]);
          w1[j] = _mm256_fmsub_ps(a[j], q1, m[j]);
        }
        fn(32 * g + k, w0, w1);
      }
    }
  }
#endif
};

// Q6_K: 256-weight super-blocks of 16 groups of 16, w = (d * sc) * (q - 32), sc int8, q 6-bit.
struct Q6KF {
  static constexpr int SB = 256, FILE_BYTES = 210, BYTES = 48 * 210;
  static constexpr int SC_OFF = 96, H_OFF = 96 + 768, Q_OFF = 96 + 768 + 3072;
  static void repack(const uint8_t* src, uint8_t* rec, int j) {
    const uint8_t *ql = src, *qh = src + 128, *sc = src + 192;
    std::memcpy(rec + 2 * j, src + 208, 2);
    auto q = [&](int w) {
      const int h = w / 128, r = w % 128;
      return ((ql[h * 64 + r % 64] >> (4 * (r / 64))) & 15) | (((qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3) << 4);
    };
    for (int g = 0; g < 16; ++g) {
      rec[SC_OFF + g * 48 + j] = sc[g];
      uint32_t bits = 0;
      for (int l = 0; l < 16; ++l) bits |= uint32_t(q(16 * g + l) >> 4) << (2 * l);
      put_u32(rec + H_OFF + g * 192 + 4 * j, bits);
    }
    for (int p = 0; p < 128; ++p) rec[Q_OFF + p * 48 + j] = uint8_t((q(2 * p) & 15) | ((q(2 * p + 1) & 15) << 4));
  }
#ifdef __AVX512F__
  template <class Fn>
  static INLINE void block(const uint8_t* rec, Fn&& fn) {
    __m512 d[3];
    for (int j = 0; j < 3; ++j) d[j] = half16(rec + 32 * j);
    const __m512i low4 = _mm512_set1_epi32(15), bits45 = _mm512_set1_epi32(0x30), off = _mm512_set1_epi32(32);
    for (int g = 0; g < 16; ++g) {
      __m512 a[3];
      __m512i h[3];
      for (int j = 0; j < 3; ++j) {
        a[j] = _mm512_mul_ps(d[j], _mm512_cvtepi32_ps(sbytes16(rec + SC_OFF + g * 48 + 16 * j)));
        h[j] = _mm512_loadu_si512(rec + H_OFF + g * 192 + 64 * j);
      }
      const uint8_t* qs = rec + Q_OFF + g * 8 * 48;
      for (int k = 0; k < 16; k += 2) {
        __m512 w0[3], w1[3];
        for (int j = 0; j < 3; ++j) {
          const __m512i b = bytes16(qs + (k / 2) * 48 + 16 * j);
          __m512i lo = _mm512_or_si512(_mm512_and_si512(b, low4), _mm512_and_si512(_mm512_slli_epi32(h[j], 4), bits45));
          __m512i hi = _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_and_si512(_mm512_slli_epi32(h[j], 2), bits45));
          h[j] = _mm512_srli_epi32(h[j], 4);
          w0[j] = _mm512_mul_ps(a[j], _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)));
          w1[j] = _mm512_mul_ps(a[j], _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)));
        }
        fn(16 * g + k, w0, w1);
      }
    }
  }
#elif GEMM_F32
  template <int NV, class Fn>
  static INLINE void lanes(const uint8_t* rec, int c, Fn&& fn) {
    __m256 d[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) d[j] = half8(rec + 2 * (c + 8 * j));
    const __m256i low4 = _mm256_set1_epi32(15), bits45 = _mm256_set1_epi32(0x30), off = _mm256_set1_epi32(32);
    for (int g = 0; g < 16; ++g) {
      __m256 a[NV];
      __m256i h[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        const int l = c + 8 * j;
        a[j] = _mm256_mul_ps(d[j], _mm256_cvtepi32_ps(sbytes8(rec + SC_OFF + g * 48 + l)));
        h[j] = _mm256_loadu_si256((const __m256i*)(rec + H_OFF + g * 192 + 4 * l));
      }
      const uint8_t* qs = rec + Q_OFF + g * 8 * 48 + c;
      for (int k = 0; k < 16; k += 2) {
        __m256 w0[NV], w1[NV];
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) {
          const __m256i b = bytes8(qs + (k / 2) * 48 + 8 * j);
          const __m256i lo =
              _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi32(h[j], 4), bits45));
          const __m256i hi =
              _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_and_si256(_mm256_slli_epi32(h[j], 2), bits45));
          h[j] = _mm256_srli_epi32(h[j], 4);
          w0[j] = _mm256_mul_ps(a[j], _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, off)));
          w1[j] = _mm256_mul_ps(a[j], _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, off)));
        }
        fn(16 * g + k, w0, w1);
      }
    }
  }
#endif
};

template <class F>
static int64_t panel_bytes(int64_t K) {
  return (K / F::SB) * F::BYTES;
}

template <class F>
static void repack_rows(const uint8_t* raw, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out) {
  const int64_t P = (N + NR - 1) / NR, blocks = K / F::SB;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = out + p * blocks * F::BYTES;
      std::memset(panel, 0, blocks * F::BYTES);  // lanes past N: zero scales, zero weights
      for (int j = 0; j < NR && p * NR + j < N; ++j) {
        const uint8_t* row = raw + (p * NR + j) * row_bytes;
        for (int64_t b = 0; b < blocks; ++b) F::repack(row + b * F::FILE_BYTES, panel + b * F::BYTES, j);
      }
    }
  });
}

// While a block of one panel computes, the same block of the next task's panel is pulled into L2 (the
// weights stream from memory; a dequantized panel computes too fast for the hardware prefetcher to keep up).
static inline void prefetch_block(const uint8_t* next, int64_t b, int64_t bytes) {
  if (next == nullptr) return;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)next + b * bytes + o, _MM_HINT_T1);
}

#ifdef __AVX512F__
static inline __mmask16 lane_mask(int valid) {
  return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1u);
}

// R rows x one panel, dequantizing in registers: kernel_f32's FMAs in its order, weights made on the fly.
template <class F, int R>
static void fused_f32(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, float* y, int64_t ldy,
                      const float* bias, int valid, const uint8_t* next) {
  __m512 acc[R][3];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / F::SB; ++b) {
    const float* xb = x + b * F::SB;
    F::block(panel + b * F::BYTES, [&](int k, const __m512* w0, const __m512* w1) LAMBDA_INLINE {
      for (int i = 0; i < R; i++) {
        const __m512 a0 = _mm512_set1_ps(xb[i * ldx + k]), a1 = _mm512_set1_ps(xb[i * ldx + k + 1]);
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_fmadd_ps(a1, w1[j], _mm512_fmadd_ps(a0, w0[j], acc[i][j]));
      }
    });
  }
  for (int j = 0; j < 3; j++) {
    const __mmask16 m = lane_mask(valid - 16 * j);
    if (!m) break;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, m, _mm512_add_ps(acc[i][j], bv));
  }
}

template <class F>
static void dequant_panel(const uint8_t* panel, int64_t K, float* w, const uint8_t* next) {
  for (int64_t b = 0; b < K / F::SB; ++b) {
    prefetch_block(next, b, F::BYTES);
    float* wb = w + b * F::SB * NR;
    F::block(panel + b * F::BYTES, [&](int k, const __m512* w0, const __m512* w1) LAMBDA_INLINE {
      for (int j = 0; j < 3; j++) {
        _mm512_storeu_ps(wb + k * NR + 16 * j, w0[j]);
        _mm512_storeu_ps(wb + (k + 1) * NR + 16 * j, w1[j]);
      }
    });
  }
}
#elif GEMM_F32
static inline __m256i lane_mask8(int valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// FMA chains in flight per row count: a row's sum is one dependent chain per vector (k, then k + 1), so a few rows
// take several vectors of outputs at once, to hide the FMAs' latency.
static constexpr int vectors_for(int rows) { return rows == 1 ? 3 : rows <= 4 ? 2 : 1; }

// R rows x one panel, NV vectors of outputs at a time, dequantizing in registers: the AVX-512 kernel's FMAs in its
// order for each output (then + bias or + 0), so the same bits as kernel_f32 over the dequantized panel.
template <class F, int R>
static void fused_f32(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, float* y, int64_t ldy,
                      const float* bias, int valid, const uint8_t*) {
  constexpr int NV = vectors_for(R);
  for (int c = 0; c < valid; c += 8 * NV) {
    __m256 acc[R][NV];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
      for (int j = 0; j < NV; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / F::SB; ++b) {
      const float* xb = x + b * F::SB;
      F::template lanes<NV>(panel + b * F::BYTES, c, [&](int k, const __m256* w0, const __m256* w1) LAMBDA_INLINE {
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
          const __m256 a0 = _mm256_broadcast_ss(xb + i * ldx + k), a1 = _mm256_broadcast_ss(xb + i * ldx + k + 1);
#pragma GCC unroll 8
          for (int j = 0; j < NV; j++) acc[i][j] = _mm256_fmadd_ps(a1, w1[j], _mm256_fmadd_ps(a0, w0[j], acc[i][j]));
        }
      });
    }
#pragma GCC unroll 8
    for (int j = 0; j < NV; j++) {
      const int left = valid - c - 8 * j;
      if (left <= 0) continue;
      const __m256i m = lane_mask8(left);
      const __m256 bv = bias ? _mm256_maskload_ps(bias + c + 8 * j, m) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int i = 0; i < R; i++) {
        const __m256 v = _mm256_add_ps(acc[i][j], bv);
        if (left >= 8)
          _mm256_storeu_ps(y + i * ldy + c + 8 * j, v);
        else
          _mm256_maskstore_ps(y + i * ldy + c + 8 * j, m, v);
      }
    }
  }
}

template <class F>
static void dequant_panel(const uint8_t* panel, int64_t K, float* w, const uint8_t* next) {
  for (int64_t b = 0; b < K / F::SB; ++b) {
    prefetch_block(next, b, F::BYTES);
    float* wb = w + b * F::SB * NR;
    for (int c = 0; c < NR; c += 16)
      F::template lanes<2>(panel + b * F::BYTES, c, [&](int k, const __m256* w0, const __m256* w1) LAMBDA_INLINE {
        for (int j = 0; j < 2; j++) {
          _mm256_storeu_ps(wb + k * NR + c + 8 * j, w0[j]);
          _mm256_storeu_ps(wb + (k + 1) * NR + c + 8 * j, w1[j]);
        }
      });
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The dequantized k, k+1 weights rounded to bf16 (nearest even, as Tensor.to) and interleaved into the
// (k, k+1) pairs of gemm.cpp's bf16 panels.
static INLINE __m512bh bf16_pairs(__m512 w0, __m512 w1) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}

template <class F, int R>
static void fused_bf16(const uint16_t* x, int64_t ldx, const uint8_t* panel, int64_t K, uint16_t* y, int64_t ldy,
                       const uint16_t* bias, int valid, const uint8_t* next) {
  __m512 acc[R][3];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / F::SB; ++b) {
    const uint16_t* xb = x + b * F::SB;
    F::block(panel + b * F::BYTES, [&](int k, const __m512* w0, const __m512* w1) LAMBDA_INLINE {
      __m512bh bw[3];
      for (int j = 0; j < 3; j++) bw[j] = bf16_pairs(w0[j], w1[j]);
      for (int i = 0; i < R; i++) {
        int32_t pair;
        __builtin_memcpy(&pair, xb + i * ldx + k, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, bw[j]);
      }
    });
  }
  // kernel_bf16's epilogue: fp32 sum + bias (bf16 widened), rounded once to bf16
  for (int j = 0; j < 3; j++) {
    const __mmask16 m = lane_mask(valid - 16 * j);
    if (!m) break;
    __m512 bv = _mm512_setzero_ps();
    if (bias) {
      const __m512i b16 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + 16 * j));
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(b16, 16));
    }
    for (int i = 0; i < R; i++)
      _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], bv)));
  }
}

template <class F>
static void dequant_panel(const uint8_t* panel, int64_t K, uint16_t* w, const uint8_t* next) {
  for (int64_t b = 0; b < K / F::SB; ++b) {
    prefetch_block(next, b, F::BYTES);
    uint16_t* wb = w + b * F::SB * NR;
    F::block(panel + b * F::BYTES, [&](int k, const __m512* w0, const __m512* w1) LAMBDA_INLINE {
      for (int j = 0; j < 3; j++) _mm512_storeu_si512(wb + k * NR + 32 * j, (__m512i)bf16_pairs(w0[j], w1[j]));
    });
  }
}
#endif

template <typename T>
using FusedFn = void (*)(const T*, int64_t, const uint8_t*, int64_t, T*, int64_t, const T*, int, const uint8_t*);

#if GEMM_F32
template <class F>
static FusedFn<float> fused_for(const float*, int rows) {
  static const FusedFn<float> table[FUSED_ROWS + 1] = {nullptr,         fused_f32<F, 1>, fused_f32<F, 2>,
                                                       fused_f32<F, 3>, fused_f32<F, 4>, fused_f32<F, 5>,
                                                       fused_f32<F, 6>, fused_f32<F, 7>, fused_f32<F, 8>};
  return table[rows];
}
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <class F>
static FusedFn<uint16_t> fused_for(const uint16_t*, int rows) {
  static const FusedFn<uint16_t> table[FUSED_ROWS + 1] = {nullptr,          fused_bf16<F, 1>, fused_bf16<F, 2>,
                                                          fused_bf16<F, 3>, fused_bf16<F, 4>, fused_bf16<F, 5>,
                                                          fused_bf16<F, 6>, fused_bf16<F, 7>, fused_bf16<F, 8>};
  return table[rows];
}
#endif

template <class F, typename T>
static void range_impl(const T* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N, int64_t K, T* y, int64_t ldy,
                       const T* bias, int64_t begin, int64_t end) {
  const int64_t P = (N + NR - 1) / NR, C = (M + MC - 1) / MC, pb = panel_bytes<F>(K);
  // Where bf16 GEMMs of this K run on AMX tiles, every chunk goes through the scratch: the tiles' bits.
  const bool scratch_only = std::is_same_v<T, uint16_t> && amx_for(K);
  thread_local std::vector<T> scratch;
  int64_t in_scratch = -1;  // the panel the scratch holds (this call's: a freed weight's address may come back)
  for (int64_t t = begin; t < end; t++) {
    // Task t is gemm_range's (chunk, panel) pair, numbered panel-major: a thread's run of tasks is a few
    // panels over every chunk, so a prompt's panel is dequantized once a call, not once per 64 rows.
    const int64_t p = t / C, c = t % C, m0 = c * MC, n = std::min(M, (c + 1) * MC) - m0;
    const int valid = (int)std::min<int64_t>(NR, N - p * NR);
    const uint8_t* panel = w + p * pb;
    const T* b = bias ? bias + p * NR : nullptr;
    const uint8_t* next = t + 1 < end && (t + 1) / C != p ? w + ((t + 1) / C) * pb : nullptr;
    if (n <= FUSED_ROWS && !scratch_only && in_scratch != p) {
      fused_for<F>(x, (int)n)(x + m0 * ldx, ldx, panel, K, y + m0 * ldy + p * NR, ldy, b, valid, nullptr);
      continue;
    }
    if (in_scratch != p) {
      if ((int64_t)scratch.size() < NR * K) scratch.resize(NR * K);
      dequant_panel<F>(panel, K, scratch.data(), next);
      in_scratch = p;
    }
    gemm_range<T>(x + m0 * ldx, ldx, scratch.data(), n, valid, K, y + m0 * ldy + p * NR, ldy, b, 0, 1);
  }
}

template <typename T, typename Body>
static void dispatch(int64_t qtype, Body&& body) {
  switch (qtype) {
    case GGUF_Q8_0:
      return body(Q8_0F{});
    case GGUF_Q4_0:
      return body(Q32F<false, false, 8>{});
    case GGUF_Q4_1:
      return body(Q32F<true, false, 0>{});
    case GGUF_Q5_0:
      return body(Q32F<false, true, 16>{});
    case GGUF_Q5_1:
      return body(Q32F<true, true, 0>{});
    case GGUF_Q4_K:
      return body(QKF<false>{});
    case GGUF_Q5_K:
      return body(QKF<true>{});
    case GGUF_Q6_K:
      return body(Q6KF{});
    default:
      TORCH_CHECK(false, "no GGUF kernel for qtype ", qtype);
  }
}

}  // namespace

bool gguf_known(int64_t qtype) {
  switch (qtype) {
    case GGUF_Q8_0:
    case GGUF_Q4_0:
    case GGUF_Q4_1:
    case GGUF_Q5_0:
    case GGUF_Q5_1:
    case GGUF_Q4_K:
    case GGUF_Q5_K:
    case GGUF_Q6_K:
      return true;
    default:
      return false;
  }
}

int64_t gguf_block_size(int64_t qtype) {
  int64_t sb = 0;
  dispatch<void>(qtype, [&](auto f) { sb = decltype(f)::SB; });
  return sb;
}

int64_t gguf_packed_bytes(int64_t qtype, int64_t N, int64_t K) {
  int64_t bytes = 0;
  dispatch<void>(qtype, [&](auto f) { bytes = ((N + NR - 1) / NR) * panel_bytes<decltype(f)>(K); });
  return bytes;
}

template <typename T>
__attribute__((noinline)) void gguf_gemm_range(const T* x, int64_t ldx, const uint8_t* w, int64_t qtype, int64_t M,
                                               int64_t N, int64_t K, T* y, int64_t ldy, const T* bias, int64_t begin,
                                               int64_t end) {
  dispatch<T>(qtype, [&](auto f) { range_impl<decltype(f), T>(x, ldx, w, M, N, K, y, ldy, bias, begin, end); });
}

#if GEMM_F32
template void gguf_gemm_range<float>(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*,
                                     int64_t, const float*, int64_t, int64_t);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
template void gguf_gemm_range<uint16_t>(const uint16_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                                        uint16_t*, int64_t, const uint16_t*, int64_t, int64_t);
#endif

static void check_qtype(int64_t qtype, int64_t K) {
  TORCH_CHECK(gguf_known(qtype), "no GGUF kernel for qtype ", qtype);
  TORCH_CHECK(K > 0 && K % gguf_block_size(qtype) == 0, "K must be whole blocks of ", gguf_block_size(qtype));
}

at::Tensor gguf_pack(at::Tensor raw, int64_t qtype, int64_t N, int64_t K) {
  check_qtype(qtype, K);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.size(0) == N,
              "raw: contiguous uint8 [N, row bytes]");
  at::Tensor out = at::empty({gguf_packed_bytes(qtype, N, K)}, raw.options());
  dispatch<void>(qtype, [&](auto f) {
    using F = decltype(f);
    TORCH_CHECK(raw.size(1) == (K / F::SB) * F::FILE_BYTES, "raw rows hold ", (K / F::SB) * F::FILE_BYTES, " bytes");
    repack_rows<F>(raw.data_ptr<uint8_t>(), raw.size(1), N, K, out.data_ptr<uint8_t>());
  });
  return out;
}

void gguf_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N, int64_t K,
                 std::optional<at::Tensor> bias, int64_t min_macs_per_thread) {
  check_qtype(qtype, K);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "x [M, K] and out [M, N] with contiguous rows");
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == K && out.size(0) == M && out.size(1) == N, "x [M, K] and out [M, N]");
  TORCH_CHECK(
      packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == gguf_packed_bytes(qtype, N, K),
      "the packed weight does not match qtype, N and K");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "one dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(), "bias [N]");
  if (M == 0) return;
  // A sleeping OpenMP pool costs tens of microseconds to wake: small calls stay on the calling thread. A few
  // rows cost more than their multiply-adds (the dequantization): counted as 8.
  const int64_t task_macs = std::max<int64_t>(8, std::min(M, MC)) * NR * K;
  const int64_t grain = std::max<int64_t>(1, min_macs_per_thread / task_macs);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
#if GEMM_F32
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    const float* xp = x.data_ptr<float>();
    float* yp = out.data_ptr<float>();
    at::parallel_for(0, gemm_tasks(M, N), grain, [&](int64_t begin, int64_t end) {
      gguf_gemm_range<float>(xp, x.stride(0), w, qtype, M, N, K, yp, out.stride(0), b, begin, end);
    });
    return;
#endif
  } else if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const uint16_t* b = bias.has_value() ? (const uint16_t*)bias->data_ptr() : nullptr;
    const uint16_t* xp = (const uint16_t*)x.data_ptr();
    uint16_t* yp = (uint16_t*)out.data_ptr();
    at::parallel_for(0, gemm_tasks(M, N), grain, [&](int64_t begin, int64_t end) {
      gguf_gemm_range<uint16_t>(xp, x.stride(0), w, qtype, M, N, K, yp, out.stride(0), b, begin, end);
    });
    return;
#endif
  }
  TORCH_CHECK(false, "this build has no GGUF kernel for ", x.scalar_type());
}

// out [T, K] <- rows ids of the packed [N, K] weight, dequantized (the GEMM's own fp32 weights; bf16: rounded
// to nearest even, as Tensor.to rounds them).
void gguf_embedding_rows(at::Tensor out, at::Tensor ids, at::Tensor packed, int64_t qtype, int64_t N, int64_t K) {
  check_qtype(qtype, K);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: int64 [T]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == ids.size(0) && out.size(1) == K, "out: [T, K]");
  TORCH_CHECK(
      packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == gguf_packed_bytes(qtype, N, K),
      "the packed weight does not match qtype, N and K");
  const int64_t T = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < N, "a token id outside the vocabulary");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
#ifdef __AVX512F__
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t row_stride = out.stride(0) * out.element_size();
  dispatch<void>(qtype, [&](auto f) {
    using F = decltype(f);
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / K), [&](int64_t t0, int64_t t1) {
      alignas(64) float row[2][NR];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = id[t] / NR, lane = id[t] % NR;
        const uint8_t* panel = w + p * panel_bytes<F>(K);
        float* of = reinterpret_cast<float*>(base + t * row_stride);
        c10::BFloat16* ob = reinterpret_cast<c10::BFloat16*>(base + t * row_stride);
        for (int64_t b = 0; b < K / F::SB; ++b) {
          F::block(panel + b * F::BYTES, [&](int k, const __m512* w0, const __m512* w1) LAMBDA_INLINE {
            for (int j = 0; j < 3; j++)
              _mm512_store_ps(row[0] + 16 * j, w0[j]), _mm512_store_ps(row[1] + 16 * j, w1[j]);
            const int64_t kk = b * F::SB + k;
            if (bf16) {
              ob[kk] = from_f<c10::BFloat16>(row[0][lane]), ob[kk + 1] = from_f<c10::BFloat16>(row[1][lane]);
            } else {
              of[kk] = row[0][lane], of[kk + 1] = row[1][lane];
            }
          });
        }
      }
    });
  });
  return;
#elif GEMM_F32
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t row_stride = out.stride(0) * out.element_size();
  dispatch<void>(qtype, [&](auto f) {
    using F = decltype(f);
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / K), [&](int64_t t0, int64_t t1) {
      alignas(32) float row[2][8];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = id[t] / NR, lane = id[t] % NR % 8;
        const int c = (int)(id[t] % NR - lane);  // the row's slice of its panel
        const uint8_t* panel = w + p * panel_bytes<F>(K);
        float* of = reinterpret_cast<float*>(base + t * row_stride);
        c10::BFloat16* ob = reinterpret_cast<c10::BFloat16*>(base + t * row_stride);
        for (int64_t b = 0; b < K / F::SB; ++b) {
          F::template lanes<1>(panel + b * F::BYTES, c, [&](int k, const __m256* w0, const __m256* w1) LAMBDA_INLINE {
            _mm256_store_ps(row[0], w0[0]), _mm256_store_ps(row[1], w1[0]);
            const int64_t kk = b * F::SB + k;
            if (bf16) {
              ob[kk] = from_f<c10::BFloat16>(row[0][lane]), ob[kk + 1] = from_f<c10::BFloat16>(row[1][lane]);
            } else {
              of[kk] = row[0][lane], of[kk + 1] = row[1][lane];
            }
          });
        }
      }
    });
  });
  return;
#endif
  TORCH_CHECK(false, "this build has no GGUF kernel");
}
