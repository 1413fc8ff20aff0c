// Paged attention by rows: each query row has its own block table row and context length, K/V read in
// place through the block table, one pass with an online softmax per block. With a sliding window a row
// starts at its window's first block and skips the keys before the window: earlier blocks are never read.
#include <type_traits>
#include <vector>

#include "common.h"
#include "ops.h"

// AVX-512 pieces (head sizes that are multiples of 16, fp32 and bf16).
#ifdef __AVX512F__
// Sixteen vectors -> one vector of their sixteen horizontal sums, in a fixed tree: lane i is the sum of
// v[i]'s lanes.
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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// AVX2 pieces (head sizes that are multiples of 8): the same passes in eight lanes.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// Eight vectors -> one vector of their eight horizontal sums, in a fixed tree: lane i is the sum of v[i]'s lanes.
static inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#define HAVE_SIMD_ATTENTION 1
#else
#define HAVE_SIMD_ATTENTION 0
#endif
// Lanes of the SIMD path's vectors: a head size must be a whole number of them.
#ifdef __AVX512F__
constexpr int64_t SIMD_LANES = 16;
#else
constexpr int64_t SIMD_LANES = 8;
#endif

// One query row's state for its task's heads: x = local head * G + group member.
struct RowState {
  float *q, *acc, *sc, *m, *l;
  const char* const* pf = nullptr;  // cache lines to prefetch while this block computes (the next block's)
  int64_t pf_n = 0;
};

// One row, one block: its n tokens' scores, the running max/sum rescaled (online softmax), then their V rows.
// kv_t is what the block's rows hold: the cache's dtype, or fp32 for a bf16 block a tile widened once
// (exactly). The arithmetic is the same either way, so a row's bits do not depend on its tile (tested).
template <typename kv_t, int64_t D_FIXED, bool SIMD>
__attribute__((noinline)) static void row_block(const RowState& s, const kv_t* __restrict__ kb,
                                                const kv_t* __restrict__ vb, int64_t row_stride, int64_t n, int64_t nh,
                                                int64_t G, int64_t D_, int64_t bs) {
  const int64_t D = D_FIXED > 0 ? D_FIXED : D_;
  float* __restrict__ q = s.q;
  float* __restrict__ acc = s.acc;
  float* __restrict__ sc = s.sc;
  if constexpr (SIMD) {
#if HAVE_SIMD_ATTENTION && !defined(__AVX512F__)
    // Eight tokens at a time, as the AVX-512 pass below does sixteen. The query's vectors are held four at a
    // time across the eight tokens (12 of the 16 registers), so that a multiply-add loads only the key: each
    // score still adds its chunks in order.
    constexpr int C = D_FIXED / 8, QH = C < 4 ? C : 4;
    static_assert(C % QH == 0, "head sizes of whole groups of four vectors");
    const int64_t passes = nh * G * ((n + 7) / 8), share = (s.pf_n + passes - 1) / passes;
    int64_t pf_i = 0;
    for (int64_t hh = 0; hh < nh; ++hh) {
      for (int64_t i0 = 0; i0 < n; i0 += 8) {
        const int64_t nc = std::min<int64_t>(8, n - i0);
        const kv_t* __restrict__ k0 = kb + i0 * row_stride + hh * D;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t x = hh * G + g;
          const float* __restrict__ qx = q + x * D;
          __m256 v[8];
          for (const int64_t e = std::min(s.pf_n, pf_i + share); pf_i < e; ++pf_i) __builtin_prefetch(s.pf[pf_i]);
          for (int64_t i = nc; i < 8; ++i) v[i] = _mm256_setzero_ps();
          for (int c0 = 0; c0 < C; c0 += QH) {
            __m256 qc[QH];
            for (int c = 0; c < QH; ++c) qc[c] = _mm256_loadu_ps(qx + 8 * (c0 + c));
            for (int64_t i = 0; i < nc; ++i) {
              const kv_t* __restrict__ k = k0 + i * row_stride + 8 * c0;
              int c = 0;
              if (c0 == 0) v[i] = _mm256_mul_ps(qc[0], load8(k)), c = 1;
              for (; c < QH; ++c) v[i] = _mm256_fmadd_ps(qc[c], load8(k + 8 * c), v[i]);
            }
          }
          alignas(32) float sums[8];
          _mm256_store_ps(sums, sum8(v));
          for (int64_t i = 0; i < nc; ++i) sc[x * bs + i0 + i] = sums[i];
        }
      }
    }
#elif HAVE_SIMD_ATTENTION
    // Sixteen tokens at a time: each score's D products summed chunk by chunk into one vector, then the
    // sixteen vectors reduced together (sum16): no reduction per score.
    constexpr int C = D_FIXED / 16;
    // The prefetches go out a share per score pass: all at once they would stall on the core's few
    // outstanding misses instead of overlapping this block's arithmetic.
    const int64_t passes = nh * G * ((n + 15) / 16), share = (s.pf_n + passes - 1) / passes;
    int64_t pf_i = 0;
    for (int64_t hh = 0; hh < nh; ++hh) {
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int64_t nc = std::min<int64_t>(16, n - i0);
        const kv_t* __restrict__ k0 = kb + i0 * row_stride + hh * D;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t x = hh * G + g;
          __m512 qc[C], v[16];
          for (int c = 0; c < C; ++c) qc[c] = _mm512_loadu_ps(q + x * D + 16 * c);
          for (const int64_t e = std::min(s.pf_n, pf_i + share); pf_i < e; ++pf_i) __builtin_prefetch(s.pf[pf_i]);
          for (int64_t i = 0; i < 16; ++i) {
            if (i >= nc) {
              v[i] = _mm512_setzero_ps();
              continue;
            }
            const kv_t* __restrict__ k = k0 + i * row_stride;
            v[i] = _mm512_mul_ps(qc[0], load16(k));
            for (int c = 1; c < C; ++c) v[i] = _mm512_fmadd_ps(qc[c], load16(k + 16 * c), v[i]);
          }
          _mm512_mask_storeu_ps(sc + x * bs + i0, (__mmask16)((1u << nc) - 1u), sum16(v));
        }
      }
    }
#endif
  } else {
    for (int64_t i = 0; i < s.pf_n; ++i) __builtin_prefetch(s.pf[i]);
    float row[D_FIXED > 0 ? D_FIXED : 512];  // one head's K or V row, widened (D <= 512 is checked)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t hh = 0; hh < nh; ++hh) {
        const kv_t* __restrict__ k = kb + i * row_stride + hh * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_f(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict__ qx = q + (hh * G + g) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qx[d] * row[d];
          sc[(hh * G + g) * bs + i] = dot;
        }
      }
    }
  }
  for (int64_t x = 0; x < nh * G; ++x) {
    float* __restrict__ sx = sc + x * bs;
    float bm = s.m[x];
    for (int64_t i = 0; i < n; ++i) bm = std::max(bm, sx[i]);
    // exp(-inf) = 0 on the first block; exp(0) is 1 exactly, so a block that leaves the max where it was
    // (most of a long prompt's) skips the call and the rescale with the same bits.
    const bool same = bm == s.m[x];
    const float corr = same ? 1.f : std::exp(s.m[x] - bm);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sx[i] = std::exp(sx[i] - bm);
      sum += sx[i];
    }
    s.l[x] = s.l[x] * corr + sum;
    s.m[x] = bm;
    float* __restrict__ ax = acc + x * D;
    if (!same)
      for (int64_t d = 0; d < D; ++d) ax[d] *= corr;
  }
  if constexpr (SIMD) {
#if HAVE_SIMD_ATTENTION && !defined(__AVX512F__)
    // Two heads of a GQA group at a time, four vectors of each (twelve registers with the V loads and the two
    // weights): the heads share each V load, and each accumulator still adds its tokens in order.
    constexpr int C = D_FIXED / 8, QH = C < 4 ? C : 4;
    for (int64_t hh = 0; hh < nh; ++hh) {
      int64_t g = 0;
      for (; g + 1 < G; g += 2) {
        const int64_t x0 = hh * G + g, x1 = x0 + 1;
        for (int c0 = 0; c0 < C; c0 += QH) {
          __m256 a0[QH], a1[QH];
          for (int c = 0; c < QH; ++c) {
            a0[c] = _mm256_loadu_ps(acc + x0 * D + 8 * (c0 + c));
            a1[c] = _mm256_loadu_ps(acc + x1 * D + 8 * (c0 + c));
          }
          for (int64_t i = 0; i < n; ++i) {
            const __m256 p0 = _mm256_set1_ps(sc[x0 * bs + i]), p1 = _mm256_set1_ps(sc[x1 * bs + i]);
            const kv_t* __restrict__ v = vb + i * row_stride + hh * D + 8 * c0;
            for (int c = 0; c < QH; ++c) {
              const __m256 vc = load8(v + 8 * c);
              a0[c] = _mm256_fmadd_ps(p0, vc, a0[c]);
              a1[c] = _mm256_fmadd_ps(p1, vc, a1[c]);
            }
          }
          for (int c = 0; c < QH; ++c) {
            _mm256_storeu_ps(acc + x0 * D + 8 * (c0 + c), a0[c]);
            _mm256_storeu_ps(acc + x1 * D + 8 * (c0 + c), a1[c]);
          }
        }
      }
      for (; g < G; ++g) {
        const int64_t x = hh * G + g;
        __m256 a[C];
        for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + x * D + 8 * c);
        for (int64_t i = 0; i < n; ++i) {
          const __m256 p = _mm256_set1_ps(sc[x * bs + i]);
          const kv_t* __restrict__ v = vb + i * row_stride + hh * D;
          for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(p, load8(v + 8 * c), a[c]);
        }
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + x * D + 8 * c, a[c]);
      }
    }
#elif HAVE_SIMD_ATTENTION
    // Each head's accumulator stays in registers across the block's V rows. Two heads of a GQA group at a
    // time share each V row's loads, and give 2C independent FMA chains instead of C (one head's C chains,
    // each a dependent FMA per token, waited on the FMA's latency). Every accumulator still adds its tokens
    // in order: the same bits as one head at a time.
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
          const kv_t* __restrict__ v = vb + i * row_stride + hh * D;
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
          const kv_t* __restrict__ v = vb + i * row_stride + hh * D;
          for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), a[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + x * D + 16 * c, a[c]);
      }
    }
#endif
  } else {
    float row[D_FIXED > 0 ? D_FIXED : 512];
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t hh = 0; hh < nh; ++hh) {
        const kv_t* __restrict__ v = vb + i * row_stride + hh * D;
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

// A task is (tile, range of KV heads). A tile is one row, or up to MAX_TILE_ROWS consecutive rows of one
// sequence (a prompt chunk's): each block's K/V rows for the task's heads are read (and, in bf16, widened)
// once for all of the tile's rows, in address order, and every row then runs row_block on them with its
// own length. The GQA group rides along: each K/V row serves every query head that shares it. Nothing here
// throws.
template <typename scalar_t, int64_t D_FIXED>
__attribute__((noinline)) void attention_tasks(const AttentionArgs<scalar_t>& a, int64_t begin, int64_t end) {
  // The SIMD path: AVX-512 or AVX2, fp32 or bf16, a head size of whole vectors.
  constexpr bool SIMD = HAVE_SIMD_ATTENTION && D_FIXED > 0 && D_FIXED % SIMD_LANES == 0 &&
                        (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);
  constexpr bool WIDEN = SIMD && !std::is_same_v<scalar_t, float>;  // bf16 blocks into fp32 scratch
  using kv_t = std::conditional_t<SIMD, float, scalar_t>;
  const int64_t D = D_FIXED > 0 ? D_FIXED : a.D;
  const int64_t bs = a.bs, Hkv = a.Hkv;
  const int64_t G = a.Hq / Hkv;
  const scalar_t* __restrict__ q_ptr = a.query;
  const scalar_t* __restrict__ k_ptr = a.k_cache;
  const scalar_t* __restrict__ v_ptr = a.v_cache;
  scalar_t* __restrict__ o_ptr = a.out;
  const int32_t* lens = a.lens;
  const int64_t q_stride = a.q_stride, o_stride = a.o_stride, table_stride = a.table_stride;
  const int64_t row_stride = Hkv * D;  // between consecutive tokens inside a block
  const float fscale = a.scale;
  const int64_t splits = a.splits;
  // A row of length n sees keys first_key(n)..n - 1: its sliding window's, or its whole context.
  const auto first_key = [&](int64_t n) { return a.window > 0 ? std::max<int64_t>(0, n - a.window) : int64_t(0); };
  const int64_t per = (Hkv + splits - 1) / splits;
  int64_t R = 1;  // the largest tile among these tasks
  for (int64_t task = begin; task < end; ++task) R = std::max(R, a.tiles[task / splits + 1] - a.tiles[task / splits]);
  const int64_t X = per * G;
  // Per-thread scratch, grown once and reused (no zeroing: every value is written before it is read), its
  // arrays on 64-byte lines so that no vector load or store straddles two.
  thread_local std::vector<float> scratch;
  const auto lines = [](int64_t n) { return (n + 15) / 16 * 16; };
  const int64_t w = WIDEN ? lines(bs * per * D) : 0;
  const size_t need = size_t(2 * w + 2 * lines(R * X * D) + lines(R * X * bs) + 2 * lines(R * X) + 16);
  if (scratch.size() < need) scratch.resize(need);
  float* const kw = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  float* const vw = kw + w;
  float* const qv = vw + w;
  float* const accv = qv + lines(R * X * D);
  float* const sv = accv + lines(R * X * D);
  float* const mv = sv + lines(R * X * bs);
  float* const lv = mv + lines(R * X);
  // The next block's K and V lines for our heads, queued for row_block to ask for while it computes.
  thread_local std::vector<const char*> pf;
  const int64_t row_lines = (per * D * int64_t(sizeof(scalar_t)) + 63) / 64;
  if (pf.size() < size_t(2 * bs * row_lines)) pf.resize(2 * bs * row_lines);
  // Queues a block's first n rows for heads [hs, hs + nhs); returns how many lines.
  const auto queue_block = [&](int64_t block, int64_t hs, int64_t nhs, int64_t n) {
    const int64_t base = (block * bs * Hkv + hs) * D, bytes = nhs * D * int64_t(sizeof(scalar_t));
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < bytes; o += 64) {
        pf[m++] = (const char*)(k_ptr + base + i * row_stride) + o;
        pf[m++] = (const char*)(v_ptr + base + i * row_stride) + o;
      }
    return m;
  };
  for (int64_t task = begin; task < end; ++task) {
    const int64_t tile = task / splits, h0 = (task % splits) * per;
    const int64_t nh = std::min(Hkv, h0 + per) - h0;
    if (nh <= 0) continue;
    const int64_t r0 = a.tiles[tile], nr = a.tiles[tile + 1] - r0;
    const int32_t* table = a.tables + (r0 + nr - 1) * table_stride;  // the last row's: every row's blocks
    // L: the tile's longest context; lo: the first key any of its rows sees (its window's, or 0).
    int64_t L = 0, lo = INT64_MAX;
    for (int64_t r = 0; r < nr; ++r) {
      L = std::max<int64_t>(L, lens[r0 + r]);
      lo = std::min(lo, first_key(lens[r0 + r]));
      for (int64_t x = 0; x < nh * G; ++x) {
        float* qx = qv + (r * X + x) * D;
        float* ax = accv + (r * X + x) * D;
        for (int64_t d = 0; d < D; ++d) {
          qx[d] = to_f(q_ptr[(r0 + r) * q_stride + (h0 * G + x) * D + d]) * fscale;
          ax[d] = 0.f;
        }
        mv[r * X + x] = -INFINITY;
        lv[r * X + x] = 0.f;
      }
    }
    for (int64_t t0 = lo / bs * bs; t0 < L; t0 += bs) {
      const int64_t base = (int64_t(table[t0 / bs]) * bs * Hkv + h0) * D;
      const scalar_t* __restrict__ kb = k_ptr + base;
      const scalar_t* __restrict__ vb = v_ptr + base;
      const int64_t n = std::min(bs, L - t0);
      // The next block sits elsewhere in the cache: its rows (our heads) are fetched while this one
      // computes; the last block fetches the next task's first.
      int64_t pf_n = 0;
      if (t0 + bs < L) {
        pf_n = queue_block(table[t0 / bs + 1], h0, nh, bs);
      } else if (task + 1 < end) {
        const int64_t h1 = ((task + 1) % splits) * per, next = (task + 1) / splits;
        const int64_t r1 = a.tiles[next + 1] - 1, t1 = first_key(lens[a.tiles[next]]) / bs * bs;
        pf_n = queue_block(a.tables[r1 * table_stride + t1 / bs], h1, std::min(Hkv, h1 + per) - h1,
                           std::min<int64_t>(bs, lens[r1] - t1));
      }
      if (nr == 1) {  // a lone row (decode) reads the cache in place, bf16 widened as it reads: no scratch pass
        const int64_t skip = std::max<int64_t>(0, lo - t0), nt = std::min<int64_t>(n, lens[r0] - t0);
        const RowState s{qv, accv, sv, mv, lv, pf.data(), pf_n};
        row_block<scalar_t, D_FIXED, SIMD>(s, kb + skip * row_stride, vb + skip * row_stride, row_stride, nt - skip, nh,
                                           G, D, bs);
        continue;
      }
      const kv_t* kr;
      const kv_t* vr;
      int64_t stride;
      if constexpr (WIDEN) {
#if HAVE_SIMD_ATTENTION && defined(__AVX512F__)
        for (int64_t i = std::max<int64_t>(0, lo - t0); i < n; ++i)
          for (int64_t e = 0; e < nh * D; e += 16) {
            _mm512_storeu_ps(kw + i * nh * D + e, load16(kb + i * row_stride + e));
            _mm512_storeu_ps(vw + i * nh * D + e, load16(vb + i * row_stride + e));
          }
#elif HAVE_SIMD_ATTENTION
        for (int64_t i = std::max<int64_t>(0, lo - t0); i < n; ++i)
          for (int64_t e = 0; e < nh * D; e += 8) {
            _mm256_storeu_ps(kw + i * nh * D + e, load8(kb + i * row_stride + e));
            _mm256_storeu_ps(vw + i * nh * D + e, load8(vb + i * row_stride + e));
          }
#endif
        kr = kw, vr = vw, stride = nh * D;
      } else {
        kr = reinterpret_cast<const kv_t*>(kb), vr = reinterpret_cast<const kv_t*>(vb), stride = row_stride;
      }
      for (int64_t r = 0; r < nr; ++r) {  // the tile's rows share the prefetches
        // This row's keys in the block: skip..nr_tokens - 1 (none when the block is outside its window).
        const int64_t skip = std::max<int64_t>(0, first_key(lens[r0 + r]) - t0);
        const int64_t nr_tokens = std::min<int64_t>(n, lens[r0 + r] - t0);
        const int64_t p0 = pf_n * r / nr, p1 = pf_n * (r + 1) / nr;
        if (nr_tokens <= skip) {
          for (int64_t i = p0; i < p1; ++i) __builtin_prefetch(pf[i]);
          continue;
        }
        const RowState s{qv + r * X * D, accv + r * X * D, sv + r * X * bs, mv + r * X,
                         lv + r * X,     pf.data() + p0,   p1 - p0};
        row_block<kv_t, D_FIXED, SIMD>(s, kr + skip * stride, vr + skip * stride, stride, nr_tokens - skip, nh, G, D,
                                       bs);
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t x = 0; x < nh * G; ++x) {
        const float inv = 1.f / lv[r * X + x];
        const float* ax = accv + (r * X + x) * D;
        for (int64_t d = 0; d < D; ++d)
          o_ptr[(r0 + r) * o_stride + (h0 * G + x) * D + d] = from_f<scalar_t>(ax[d] * inv);
      }
  }
}

// Rows r and r+1 share a tile when they are consecutive positions of one sequence: lengths L and L+1, and
// row r's blocks the same as row r+1's table lists (prompt rows of a chunk; prefix-shared rows too, which
// read the same blocks either way).
std::vector<int64_t> attention_tiles(const int32_t* tables, int64_t table_stride, const int32_t* lens, int64_t B,
                                     int64_t bs) {
  std::vector<int64_t> starts;
  starts.reserve(B + 1);
  for (int64_t r = 0; r < B; ++r) {
    const bool joins =
        r > 0 && r - starts.back() < MAX_TILE_ROWS && lens[r] == lens[r - 1] + 1 &&
        std::equal(tables + (r - 1) * table_stride, tables + (r - 1) * table_stride + (lens[r - 1] + bs - 1) / bs,
                   tables + r * table_stride);
    if (!joins) starts.push_back(r);
  }
  starts.push_back(B);
  return starts;
}

template <typename scalar_t>
void attention_tasks_any(const AttentionArgs<scalar_t>& a, int64_t begin, int64_t end) {
  if (a.D == 64)
    attention_tasks<scalar_t, 64>(a, begin, end);
  else if (a.D == 128)
    attention_tasks<scalar_t, 128>(a, begin, end);
  else if (a.D == 32)
    attention_tasks<scalar_t, 32>(a, begin, end);
  else
    attention_tasks<scalar_t, 0>(a, begin, end);
}

template void attention_tasks_any<float>(const AttentionArgs<float>&, int64_t, int64_t);
template void attention_tasks_any<c10::BFloat16>(const AttentionArgs<c10::BFloat16>&, int64_t, int64_t);

void paged_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [B, Hq, D], heads contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2), "out: like query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(), "one dtype");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(query.size(2) <= 512, "head size <= 512");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables: int32, rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.size(0) == query.size(0),
              "seq_lens: int32 [B]");
  TORCH_CHECK(window >= 0, "window: >= 0 (0: no sliding window)");
  DISPATCH(query.scalar_type(), "paged_attention", [&] {
    const int64_t B = query.size(0), Hkv = k_cache.size(2);
    const std::vector<int64_t> tiles = attention_tiles(block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                                                       seq_lens.data_ptr<int32_t>(), B, k_cache.size(1));
    const int64_t num_tiles = (int64_t)tiles.size() - 1;
    const AttentionArgs<scalar_t> a{out.data_ptr<scalar_t>(),
                                    out.stride(0),
                                    query.data_ptr<scalar_t>(),
                                    query.stride(0),
                                    k_cache.data_ptr<scalar_t>(),
                                    v_cache.data_ptr<scalar_t>(),
                                    k_cache.size(1),
                                    Hkv,
                                    query.size(1),
                                    query.size(2),
                                    block_tables.data_ptr<int32_t>(),
                                    block_tables.stride(0),
                                    seq_lens.data_ptr<int32_t>(),
                                    tiles.data(),
                                    num_tiles,
                                    static_cast<float>(scale),
                                    attention_splits(Hkv, num_tiles, at::get_num_threads()),
                                    window};
    at::parallel_for(0, num_tiles * a.splits, 1,
                     [&](int64_t begin, int64_t end) { attention_tasks_any(a, begin, end); });
  });
}
