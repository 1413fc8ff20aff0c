// RoPE (HF rotate-half), in place on q [T, Hq, D] and k [T, Hkv, D]; heads contiguous inside a row.
#include "common.h"
#include "ops.h"

template <typename T>
static inline void rope_heads(T* base, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
      // HF rounds each product to the activations' dtype, then the sum: the same points here.
      x[i] = from_f<T>(round_to<T>(x1 * c[i]) - round_to<T>(x2 * s[i]));
      x[i + half] = from_f<T>(round_to<T>(x2 * c[i]) + round_to<T>(x1 * s[i]));
    }
  }
}

template <typename T>
__attribute__((noinline)) void rope_rows(T* q, int64_t qs, int64_t Hq, T* k, int64_t ks, int64_t Hkv, int64_t D,
                                         const int64_t* pos, const float* cp, const float* sp, int64_t begin,
                                         int64_t end) {
  const int64_t half = D / 2;
  float cbuf[256], sbuf[256];  // D <= 512, checked by the callers
  for (int64_t t = begin; t < end; ++t) {
    const int64_t p = pos[t];
    // HF casts cos/sin to the activations' dtype before multiplying.
    for (int64_t i = 0; i < half; ++i) {
      cbuf[i] = round_to<T>(cp[p * half + i]);
      sbuf[i] = round_to<T>(sp[p * half + i]);
    }
    rope_heads(q + t * qs, Hq, D, cbuf, sbuf);
    rope_heads(k + t * ks, Hkv, D, cbuf, sbuf);
  }
}

template void rope_rows<float>(float*, int64_t, int64_t, float*, int64_t, int64_t, int64_t, const int64_t*,
                               const float*, const float*, int64_t, int64_t);
template void rope_rows<c10::BFloat16>(c10::BFloat16*, int64_t, int64_t, c10::BFloat16*, int64_t, int64_t, int64_t,
                                       const int64_t*, const float*, const float*, int64_t, int64_t);

void check_positions(const int64_t* pos, int64_t n, int64_t max_pos) {
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of the RoPE table");
}

void rope(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2) && q.size(2) == k.size(2) && q.size(2) % 2 == 0 && q.size(2) <= 512,
              "q, k: [T, H, D], heads contiguous, D even and <= 512");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "positions: int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.size(1) == q.size(2) / 2,
              "cos, sin: float32 [max_pos, D/2]");
  const int64_t T_ = q.size(0), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  check_positions(pos, T_, cos.size(0));
  DISPATCH(q.scalar_type(), "rope", [&] {
    TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k: one dtype");
    at::parallel_for(0, T_, grain((q.size(1) + k.size(1)) * D), [&](int64_t begin, int64_t end) {
      rope_rows<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.size(1), k.data_ptr<scalar_t>(), k.stride(0),
                          k.size(1), D, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), begin, end);
    });
  });
}
