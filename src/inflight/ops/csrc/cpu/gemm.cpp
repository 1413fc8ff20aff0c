// Our CPU GEMM: weights packed once in panels, each output summing its K products in order k = 0..K-1 into
// one fp32 accumulator however many rows share the call: a row's result is the same bits at any batch size.
// Layout: panels of NR outputs, zero-padded past N. fp32: [P][K][48]; bf16: [P][K/2][48][2], the pairs
// vdpbf16ps (and AMX's tiles) multiply. The micro-kernel holds up to 10 rows x 48 outputs in 30 registers
// (AVX-512); with AVX2, up to 6 rows x 16-48 outputs in 12 of its 16, the panel in one to three passes.
#include "gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops.h"

#ifdef __AVX512F__
constexpr int MR = 10;    // rows per micro-kernel call, at most: 10 x 3 accumulators of the 32 vector registers
constexpr int WHOLE = 8;  // rows of a block where a chunk's rows are whole blocks of it (gemm_range)
#else
constexpr int MR = 6;  // AVX2: 6 rows x 2 vectors, 12 accumulators of the 16 registers
constexpr int WHOLE = MR;
#endif

bool supports_f32() {
#if GEMM_F32
  return true;
#else
  return false;
#endif
}

bool supports_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

template <typename T>
using KernelFn = void (*)(const T*, int64_t, const T*, int64_t, T*, int64_t, const T*, int, const T*, int, int);

// While a task's row blocks compute from their panel, they pull lines [j0, j0 + nl) of each step of the next
// task's panel into L2, so that memory and FMAs overlap (decode's few-row GEMMs were the sum of both; which
// blocks help: gemm_range). Prefetches change no result.
static inline void prefetch_lines(const void* next, int64_t k, int j0, int nl) {
  const char* line = static_cast<const char*>(next) + k * NR * 4 + 64 * j0;  // a step of a panel: 3 lines
  for (int j = 0; j < nl; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T1);
}

#ifdef __AVX512F__
static inline __mmask16 lane_mask(int valid) {
  return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1u);
}

template <int R>
static void kernel_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, const float* bias,
                       int valid, const float* next, int j0, int nl) {
  __m512 acc[R][3];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    if (nl) prefetch_lines(next, k, j0, nl);
    const float* wk = w + k * NR;
    const __m512 b0 = _mm512_loadu_ps(wk), b1 = _mm512_loadu_ps(wk + 16), b2 = _mm512_loadu_ps(wk + 32);
    for (int i = 0; i < R; i++) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(a, b2, acc[i][2]);
    }
  }
  for (int j = 0; j < 3; j++) {
    const __mmask16 m = lane_mask(valid - 16 * j);
    if (!m) break;
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * ldy + 16 * j, m, _mm512_add_ps(acc[i][j], bv));
  }
}

static const KernelFn<float> F32_KERNELS[MR + 1] = {nullptr,       kernel_f32<1>, kernel_f32<2>, kernel_f32<3>,
                                                    kernel_f32<4>, kernel_f32<5>, kernel_f32<6>, kernel_f32<7>,
                                                    kernel_f32<8>, kernel_f32<9>, kernel_f32<10>};
#elif GEMM_F32
// AVX2: lanes valid.. of a vector masked off (vmaskmovps reads and writes only the others).
static inline __m256i lane_mask8(int valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// R rows x vectors c0..c0+NV-1 of a panel. Each output's sum is the AVX-512 kernel's FMA chain (k in order, then
// + bias or + 0): the same bits on either build, whatever R, NV or the pass.
template <int R, int NV>
static inline void pass_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                            const float* bias, int valid, int c0, const float* next, int j0, int nl) {
  // Every loop over rows or vectors unrolled whole: GCC otherwise keeps the accumulators in memory.
  __m256 acc[R][NV];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NV; j++) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    if (nl) prefetch_lines(next, k, j0, nl);
    const float* wk = w + k * NR + 8 * c0;
    __m256 b[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; j++) {
      b[j] = _mm256_loadu_ps(wk + 8 * j);
      // Pinned in a register where the registers allow (an empty asm): GCC would reload it from L1 for each row.
      if constexpr ((R + 1) * NV < 16) __asm__("" : "+x"(b[j]));
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NV; j++) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV; j++) {
    const int col = 8 * (c0 + j), left = valid - col;
    if (left <= 0) continue;
    const __m256i m = lane_mask8(left);
    const __m256 bv = bias ? _mm256_maskload_ps(bias + col, m) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      const __m256 v = _mm256_add_ps(acc[i][j], bv);
      if (left >= 8)
        _mm256_storeu_ps(y + i * ldy + col, v);
      else
        _mm256_maskstore_ps(y + i * ldy + col, m, v);
    }
  }
}

// R rows x one panel: 1-2 rows take all six vectors at once (six FMA chains a row), 3-4 rows three, 5-6 two;
// the next panel's lines are pulled into L2 during the first pass.
template <int R>
static void kernel_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, const float* bias,
                       int valid, const float* next, int j0, int nl) {
  constexpr int NV = R <= 2 ? 6 : R <= 4 ? 3 : 2;
  for (int c = 0; c < NR / 8 && 8 * c < valid; c += NV)
    pass_f32<R, NV>(x, ldx, w, K, y, ldy, bias, valid, c, next, j0, c == 0 ? nl : 0);
}

static const KernelFn<float> F32_KERNELS[MR + 1] = {nullptr,       kernel_f32<1>, kernel_f32<2>, kernel_f32<3>,
                                                    kernel_f32<4>, kernel_f32<5>, kernel_f32<6>};
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bf16 epilogue of both kernels: lanes j*16.. of the bias (zero without one), bf16 -> fp32 by shifting
// the bits into the top half; then fp32 sum + bias rounded once to bf16 (nearest even) and stored.
static inline __m512 bias16(const uint16_t* bias, int j, __mmask16 m) {
  if (!bias) return _mm512_setzero_ps();
  const __m512i b16 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + 16 * j));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b16, 16));
}
static inline void store_bf16(uint16_t* y, __mmask16 m, __m512 sum, __m512 bv) {
  _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, bv)));
}

template <int R>
static void kernel_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy,
                        const uint16_t* bias, int valid, const uint16_t* next, int j0, int nl) {
  __m512 acc[R][3];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    if (nl) prefetch_lines(next, k / 2, j0, nl);  // a k-pair step is 3 lines too
    const uint16_t* wk = w + k * NR;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(wk), b1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                   b2 = (__m512bh)_mm512_loadu_si512(wk + 64);
    for (int i = 0; i < R; i++) {
      int32_t pair;
      __builtin_memcpy(&pair, x + i * ldx + k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, b2);
    }
  }
  for (int j = 0; j < 3; j++) {
    const __mmask16 m = lane_mask(valid - 16 * j);
    if (!m) break;
    const __m512 bv = bias16(bias, j, m);
    for (int i = 0; i < R; i++) store_bf16(y + i * ldy + 16 * j, m, acc[i][j], bv);
  }
}

static const KernelFn<uint16_t> BF16_KERNELS[MR + 1] = {nullptr,        kernel_bf16<1>, kernel_bf16<2>, kernel_bf16<3>,
                                                        kernel_bf16<4>, kernel_bf16<5>, kernel_bf16<6>, kernel_bf16<7>,
                                                        kernel_bf16<8>, kernel_bf16<9>, kernel_bf16<10>};
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// Linux (5.16+) hands a process the AMX tile state only on request; without it the first tile instruction
// faults. Asked once per process (the permission covers every thread); refused means the AVX512-BF16 path.
static bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2: C, rows x 16 fp32 (a 48-output panel); 3: A, rows x 32 bf16 of x; 4-6: B, 16 k-pairs x 16
// outputs, read straight from the panel layout ([K/2][48][2]: a 192-byte stride between k-pairs).
static void amx_configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
  for (int t = 4; t < 7; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// rows (1-16, as configured) of x times one panel, K a multiple of 32. Each row's dot products run through
// the same tile instructions in the same K order whatever the other rows: a row's bits do not depend on
// the batch. The epilogue is kernel_bf16's: fp32 sum + bias, rounded once.
static void kernel_amx(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y, int64_t ldy,
                       const uint16_t* bias, int valid, int rows) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < K; k += 32) {
    const uint16_t* wk = w + k * NR;
    _tile_loadd(3, x + k, ldx * 2);
    _tile_loadd(4, wk, NR * 4);
    _tile_loadd(5, wk + 32, NR * 4);
    _tile_loadd(6, wk + 64, NR * 4);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  alignas(64) float c[16][NR];
  _tile_stored(0, &c[0][0], NR * 4);
  _tile_stored(1, &c[0][16], NR * 4);
  _tile_stored(2, &c[0][32], NR * 4);
  for (int j = 0; j < 3; j++) {
    const __mmask16 m = lane_mask(valid - 16 * j);
    if (!m) break;
    const __m512 bv = bias16(bias, j, m);
    for (int i = 0; i < rows; i++) store_bf16(y + i * ldy + 16 * j, m, _mm512_load_ps(&c[i][16 * j]), bv);
  }
}

// gemm_range's tasks on the tiles: 16 rows a call; the tile rows are reconfigured only for a short tail.
static void gemm_range_amx(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                           uint16_t* y, int64_t ldy, const uint16_t* bias, int64_t begin, int64_t end) {
  const int64_t P = (N + NR - 1) / NR, panel_elems = K * NR;
  int configured = 0;
  for (int64_t t = begin; t < end; t++) {
    const int64_t c = t / P, p = t % P, m1 = std::min(M, (c + 1) * MC);
    const int valid = (int)std::min<int64_t>(NR, N - p * NR);
    for (int64_t m = c * MC; m < m1; m += 16) {
      const int rows = (int)std::min<int64_t>(16, m1 - m);
      if (rows != configured) amx_configure(configured = rows);
      kernel_amx(x + m * ldx, ldx, w + p * panel_elems, K, y + m * ldy + p * NR, ldy, bias ? bias + p * NR : nullptr,
                 valid, rows);
    }
  }
  if (configured) _tile_release();
}
#else
#define HAVE_AMX 0
#endif

// Whether bf16 GEMMs with this K run on AMX tiles (this build and this process); they must for every row
// count alike, so the choice depends on K and the machine only.
bool amx_for(int64_t K) {
#if HAVE_AMX
  return K % 32 == 0 && amx_permitted();
#else
  (void)K;
  return false;
#endif
}

#if GEMM_F32
static const KernelFn<float>* kernels_for(const float*) { return F32_KERNELS; }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
static const KernelFn<uint16_t>* kernels_for(const uint16_t*) { return BF16_KERNELS; }
#endif

// Shared by `linear` (one parallel region a call) and the layer stack (one a step); noinline so both run the
// same machine code.
template <typename T>
__attribute__((noinline)) void gemm_range(const T* x, int64_t ldx, const T* w, int64_t M, int64_t N, int64_t K, T* y,
                                          int64_t ldy, const T* bias, int64_t begin, int64_t end) {
#if HAVE_AMX
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (amx_for(K)) return gemm_range_amx(x, ldx, w, M, N, K, y, ldy, bias, begin, end);
  }
#endif
  const KernelFn<T>* kernels = kernels_for(x);
  const int64_t P = (N + NR - 1) / NR, panel_elems = K * NR;
  for (int64_t t = begin; t < end; t++) {
    const int64_t c = t / P, p = t % P, m0 = c * MC, m1 = std::min(M, (c + 1) * MC);
    const int valid = (int)std::min<int64_t>(NR, N - p * NR);
    // Blocks of 8 rows where the rows are whole 8s (a 10-row block's values outnumber the registers); otherwise
    // the fewest blocks, the rows shared evenly (9 rows: one block, not 8 + 1; 17: 9 + 8): a block of a row or
    // two is bound by its FMA chains' latency and cost a pass over the panel as slow as a full one. (AVX2:
    // blocks of up to 6 rows, shared evenly.)
    // The next task's panel is pulled into L2 while this one computes, 3 lines a step in all: with one or two
    // row blocks by each of them, with more by blocks 1-3 (block 0 reads its own panel, fetched the same way).
    const int64_t n = m1 - m0, blocks = n % WHOLE == 0 ? n / WHOLE : (n + MR - 1) / MR, first = blocks <= 2 ? 0 : 1;
    const int64_t helpers = blocks <= 2 ? blocks : std::min<int64_t>(blocks - 1, 3);
    const T* next = t + 1 < end ? w + ((t + 1) % P) * panel_elems : nullptr;
    for (int64_t m = m0, b = 0; b < blocks; ++b) {
      const int rows = (int)((n * (b + 1) + blocks - 1) / blocks - (n * b + blocks - 1) / blocks);
      int j0 = 0, nl = 0;
      if (next != nullptr && b >= first && b < first + helpers) {
        j0 = (int)(3 * (b - first) / helpers);
        nl = (int)(3 * (b - first + 1) / helpers) - j0;
      }
      kernels[rows](x + m * ldx, ldx, w + p * panel_elems, K, y + m * ldy + p * NR, ldy, bias ? bias + p * NR : nullptr,
                    valid, next, j0, nl);
      m += rows;
    }
  }
}

#if GEMM_F32
template void gemm_range<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t,
                                const float*, int64_t, int64_t);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
template void gemm_range<uint16_t>(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*,
                                   int64_t, const uint16_t*, int64_t, int64_t);
#endif

template <typename T>
static void run(const T* x, int64_t ldx, const T* w, int64_t M, int64_t N, int64_t K, T* y, int64_t ldy, const T* bias,
                int64_t min_macs_per_thread) {
  // A sleeping OpenMP pool costs tens of microseconds to wake: small calls stay on the calling thread.
  const int64_t task_macs = std::min(M, MC) * NR * K;
  const int64_t grain = std::max<int64_t>(1, min_macs_per_thread / std::max<int64_t>(1, task_macs));
  at::parallel_for(0, gemm_tasks(M, N), grain,
                   [&](int64_t begin, int64_t end) { gemm_range<T>(x, ldx, w, M, N, K, y, ldy, bias, begin, end); });
}

void linear(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias,
            int64_t min_macs_per_thread) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "x [M, K] and out [M, N] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M && packed.is_contiguous() && packed.numel() == ((N + NR - 1) / NR) * NR * K,
              "the packed weight does not match x and out");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "one dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(), "bias [N]");
  if (M == 0) return;
  if (x.scalar_type() == at::kFloat) {
#if GEMM_F32
    run<float>(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), M, N, K, out.data_ptr<float>(),
               out.stride(0), bias.has_value() ? bias->data_ptr<float>() : nullptr, min_macs_per_thread);
    return;
#endif
  } else if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    TORCH_CHECK(K % 2 == 0, "bf16 needs an even K");
    run<uint16_t>((const uint16_t*)x.data_ptr(), x.stride(0), (const uint16_t*)packed.data_ptr(), M, N, K,
                  (uint16_t*)out.data_ptr(), out.stride(0),
                  bias.has_value() ? (const uint16_t*)bias->data_ptr() : nullptr, min_macs_per_thread);
    return;
#endif
  }
  TORCH_CHECK(false, "this build has no kernel for ", x.scalar_type());
}
