// RMSNorm in HF's order: x * rsqrt(mean(x^2) + eps), rounded to the activations' dtype, then * weight, rounded.
#include "common.h"
#include "ops.h"

template <typename T>
__attribute__((noinline)) void rms_norm_rows(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w,
                                             int64_t H, float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* xr = x + r * xs;
    const T* src = xr;
    float ss = 0.f;
    if (res != nullptr) {  // residual <- x + residual, in the activations' dtype as HF adds
      T* rr = res + r * rs;
      for (int64_t i = 0; i < H; ++i) {
        const T v = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        rr[i] = v;
        const float f = to_f(v);
        ss += f * f;
      }
      src = rr;
    } else {
      for (int64_t i = 0; i < H; ++i) {
        const float f = to_f(xr[i]);
        ss += f * f;
      }
    }
    const float inv = 1.f / std::sqrt(ss / float(H) + eps);
    T* o = out + r * os;
    for (int64_t i = 0; i < H; ++i) o[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(src[i]) * inv));
  }
}

template void rms_norm_rows<float>(float*, int64_t, float*, int64_t, float*, int64_t, const float*, int64_t, float,
                                   int64_t, int64_t);
template void rms_norm_rows<c10::BFloat16>(c10::BFloat16*, int64_t, c10::BFloat16*, int64_t, c10::BFloat16*, int64_t,
                                           const c10::BFloat16*, int64_t, float, int64_t, int64_t);

template <typename T>
static void rms_norm_impl(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w, int64_t rows, int64_t H,
                          float eps) {
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    rms_norm_rows<T>(out, os, x, xs, res, rs, w, H, eps, begin, end);
  });
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [width]");
  TORCH_CHECK(
      out.sizes() == x.sizes() && weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
      "one dtype, out like x");
  DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(), x.stride(0), nullptr, 0,
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), float(eps));
  });
}

// In place: residual <- x + residual; x <- rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual like x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: [width], x's dtype");
  DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.data_ptr<scalar_t>(), x.stride(0),
                            residual.data_ptr<scalar_t>(), residual.stride(0), weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), float(eps));
  });
}
