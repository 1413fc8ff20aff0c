// Our GEMM's pieces the layer stack shares: the packed layout's sizes and the task range.
#pragma once

#include <cstdint>

// Builds with our fp32 GEMM: AVX-512 (a panel is three 16-lane vectors) or AVX2 with FMA (six 8-lane vectors; and
// F16C for GGUF's scales, which every CPU with those two has).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define GEMM_F32 1
#else
#define GEMM_F32 0
#endif

constexpr int NR = 48;      // outputs per panel
constexpr int64_t MC = 64;  // rows per task: a chunk of x stays in L2 while the panels stream past it

// Tasks are (64-row chunk, panel) pairs, t = chunk * panels + panel.
static inline int64_t gemm_tasks(int64_t M, int64_t N) { return ((M + MC - 1) / MC) * ((N + NR - 1) / NR); }

// Elements of a packed [N, K] weight: panels of NR outputs, zero-padded past N.
static inline int64_t panel_elems(int64_t N, int64_t K) { return ((N + NR - 1) / NR) * NR * K; }

// Tasks begin..end of y [M, N] = x [M, K] @ w^T + bias, w packed. T: float (GEMM_F32) or uint16_t, bf16 bits
// (AVX512-BF16, or AMX tiles where amx_for(K)). Every output sums K in order, whatever the tasks' split.
template <typename T>
void gemm_range(const T* x, int64_t ldx, const T* w, int64_t M, int64_t N, int64_t K, T* y, int64_t ldy, const T* bias,
                int64_t begin, int64_t end);
