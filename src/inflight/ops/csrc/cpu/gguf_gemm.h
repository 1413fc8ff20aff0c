// GGUF weight-only GEMM pieces the layer stack shares: the task range over a packed GGUF weight.
#pragma once

#include <cstdint>

// qtype codes (gguf.GGMLQuantizationType) our GGUF kernels compute.
enum GgufType : int64_t {
  GGUF_Q4_0 = 2,
  GGUF_Q4_1 = 3,
  GGUF_Q5_0 = 6,
  GGUF_Q5_1 = 7,
  GGUF_Q8_0 = 8,
  GGUF_Q4_K = 12,
  GGUF_Q5_K = 13,
  GGUF_Q6_K = 14,
};

bool gguf_known(int64_t qtype);
// Weights per block of the file (32, or 256 for the K-quants): K must be a multiple.
int64_t gguf_block_size(int64_t qtype);
// Bytes of a packed [N, K] weight: panels of NR outputs, zero-padded past N.
int64_t gguf_packed_bytes(int64_t qtype, int64_t N, int64_t K);

// Tasks begin..end of gemm_tasks(M, N) ((64-row chunk, panel) pairs as gemm_range's, numbered panel-major) of
// y [M, N] = x [M, K] @ w^T + bias, w a packed GGUF weight. T: float or uint16_t (bf16 bits). Each output's bits equal
// our fp32/bf16 GEMM's over the dequantized (bf16: then rounded) weight, whatever the rows or the split.
template <typename T>
void gguf_gemm_range(const T* x, int64_t ldx, const uint8_t* w, int64_t qtype, int64_t M, int64_t N, int64_t K, T* y,
                     int64_t ldy, const T* bias, int64_t begin, int64_t end);
