// SiLU(gate) * up over the fused [T, 2I] projection; HF rounds silu's output, then the product.
#include "common.h"
#include "ops.h"

template <typename T>
__attribute__((noinline)) void silu_and_mul_rows(T* op, int64_t os, const T* xp, int64_t xs, int64_t I, int64_t begin,
                                                 int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const T* g = xp + t * xs;
    const T* u = g + I;
    T* o = op + t * os;
    for (int64_t i = 0; i < I; ++i) {
      const float a = to_f(g[i]);
      o[i] = from_f<T>(round_to<T>(a / (1.f + std::exp(-a))) * to_f(u[i]));
    }
  }
}

template void silu_and_mul_rows<float>(float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t);
template void silu_and_mul_rows<c10::BFloat16>(c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t, int64_t,
                                               int64_t);

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "x: [T, 2I], out: [T, I]");
  const int64_t T_ = x.size(0), I = out.size(1);
  DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, T_, grain(I), [&](int64_t begin, int64_t end) {
      silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(), x.stride(0), I,
                                  begin, end);
    });
  });
}
