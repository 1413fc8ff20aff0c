// The Mixture-of-Experts router in one pass a row: the logits x · Wᵀ (fp32 sums, rounded to the activations' dtype
// as HF's linear rounds them), softmax in fp32, the top-k (largest first, ties to the lower expert, as torch.topk),
// renormalised to sum 1 where the config says. A row's answer depends on nothing but the row.
#include <vector>

#include "common.h"
#include "ops.h"

constexpr int LANES = 16;  // partial sums a dot product keeps (two AVX2 vectors, one AVX-512)

// Not inlined: every row runs the same machine code (the exp's vector and scalar forms may differ).
template <typename T>
__attribute__((noinline)) static void route_row(const T* x, const T* w, int64_t E, int64_t H, int64_t k,
                                                bool renormalize, float* xf, float* probs, float* weights,
                                                int32_t* ids) {
  for (int64_t h = 0; h < H; ++h) xf[h] = to_f(x[h]);
  const int64_t whole = H / LANES * LANES;
  for (int64_t e = 0; e < E; ++e) {
    const T* we = w + e * H;
    float acc[LANES] = {};
    for (int64_t h = 0; h < whole; h += LANES)
      for (int l = 0; l < LANES; ++l) acc[l] += xf[h + l] * to_f(we[h + l]);
    for (int64_t h = whole; h < H; ++h) acc[h - whole] += xf[h] * to_f(we[h]);
    for (int width = LANES / 2; width > 0; width /= 2)  // a fixed tree
      for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
    probs[e] = round_to<T>(acc[0]);
  }
  float m = probs[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, probs[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) {
    probs[e] = std::exp(probs[e] - m);
    sum += probs[e];
  }
  for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) {  // k passes of a first-maximum scan; a taken expert is marked below any prob
    int64_t best = 0;
    for (int64_t e = 1; e < E; ++e)
      if (probs[e] > probs[best]) best = e;
    weights[j] = probs[best];
    ids[j] = (int32_t)best;
    total += probs[best];
    probs[best] = -1.f;
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
}

template <typename T>
void moe_route_rows(const T* x, int64_t xs, const T* w, int64_t E, int64_t H, int64_t k, bool renormalize,
                    float* weights, int32_t* ids, float* scratch, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t)
    route_row<T>(x + t * xs, w, E, H, k, renormalize, scratch, scratch + H, weights + t * k, ids + t * k);
}
template void moe_route_rows<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t, bool, float*,
                                    int32_t*, float*, int64_t, int64_t);
template void moe_route_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t,
                                            int64_t, bool, float*, int32_t*, float*, int64_t, int64_t);

// topk_weights fp32 [T, k] and topk_ids int32 [T, k] of x [T, H] (rows contiguous) under the router weight [E, H]
// in x's dtype. Rows are split across threads only past min_macs_per_thread multiply-adds a thread.
void moe_route(at::Tensor topk_weights, at::Tensor topk_ids, at::Tensor x, at::Tensor weight, bool renormalize,
               int64_t min_macs_per_thread) {
  check_rows(x, "x");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "moe_route: fp32 or bf16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == dt && weight.size(1) == x.size(1),
              "weight: [E, H] contiguous, in x's dtype");
  const int64_t T_ = x.size(0), H = x.size(1), E = weight.size(0), k = topk_ids.size(-1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.is_contiguous() && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == T_ && k >= 1 && k <= E,
              "topk_ids: int32 [T, k], 1 <= k <= E");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights: fp32 [T, k]");
  const int64_t grain = std::max<int64_t>(1, min_macs_per_thread / std::max<int64_t>(1, E * H));
  float* wo = topk_weights.data_ptr<float>();
  int32_t* io = topk_ids.data_ptr<int32_t>();
  const int64_t xs = x.stride(0);
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, T_, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(H + E);
      moe_route_rows<T>(xp, xs, wp, E, H, k, renormalize, wo, io, scratch.data(), begin, end);
    });
  };
  if (dt == at::kFloat)
    run(float());
  else
    run(c10::BFloat16());
}
