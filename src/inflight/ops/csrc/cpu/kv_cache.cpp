// KV write: this step's k/v rows [T, Hkv, D] (heads contiguous) to their flat cache slots.
#include "common.h"
#include "ops.h"

__attribute__((noinline)) void write_kv_rows(char* kc, char* vc, const char* kp, int64_t ks, const char* vp, int64_t vs,
                                             const int64_t* slots, int64_t row_bytes, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    std::memcpy(kc + slots[t] * row_bytes, kp + t * ks, row_bytes);
    std::memcpy(vc + slots[t] * row_bytes, vp + t * vs, row_bytes);
  }
}

void check_slots(const int64_t* slots, int64_t n, int64_t num_slots) {
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of the cache");
}

void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "key, value: [T, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == key.scalar_type() &&
                  v_cache.scalar_type() == key.scalar_type() && value.scalar_type() == key.scalar_type(),
              "contiguous caches of the activations' dtype");
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == key.size(1) * key.size(2), "cache rows: Hkv * D");
  TORCH_CHECK(
      slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == key.size(0),
      "slot_mapping: int64 [T]");
  const int64_t T_ = key.size(0), width = key.size(1) * key.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = key.element_size();
  check_slots(slots, T_, k_cache.size(0) * k_cache.size(1));
  at::parallel_for(0, T_, 4 * grain(width), [&](int64_t begin, int64_t end) {
    write_kv_rows(static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()),
                  static_cast<const char*>(key.data_ptr()), key.stride(0) * elem,
                  static_cast<const char*>(value.data_ptr()), value.stride(0) * elem, slots, width * elem, begin, end);
  });
}
