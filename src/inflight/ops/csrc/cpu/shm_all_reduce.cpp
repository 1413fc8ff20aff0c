// The all-reduce of CPU tensor-parallel ranks through shared memory (shm.h): every rank adds all ranks' values
// in rank order, in fp32, and rounds once, so every rank holds the same bits and reruns give the same answer.
// A tensor larger than a slot goes through in slot-sized chunks, a round each.
#include "common.h"
#include "ops.h"
#include "shm.h"

// out[0, n) = the sum over ranks r = 0, 1, ... of slot r of `round`, added left to right in fp32.
template <typename T>
static void sum_slots(T* out, const shm::Group& g, int64_t round, int64_t n) {
  constexpr int64_t BLOCK = 512;
  float acc[BLOCK];
  for (int64_t b = 0; b < n; b += BLOCK) {
    const int64_t len = std::min(BLOCK, n - b);
    const T* first = reinterpret_cast<const T*>(g.slot(round, 0)) + b;
    for (int64_t i = 0; i < len; ++i) acc[i] = to_f(first[i]);
    for (int64_t r = 1; r < g.size; ++r) {
      const T* part = reinterpret_cast<const T*>(g.slot(round, r)) + b;
      for (int64_t i = 0; i < len; ++i) acc[i] += to_f(part[i]);
    }
    for (int64_t i = 0; i < len; ++i) out[b + i] = from_f<T>(acc[i]);
  }
}

template <typename T>
static void shm_all_reduce_impl(T* x, int64_t n, const shm::Group& g) {
  const int64_t per_slot = g.slot_bytes / int64_t(sizeof(T));
  int64_t round = g.last_round();
  for (int64_t off = 0; off < n; off += per_slot) {
    const int64_t len = std::min(per_slot, n - off);
    ++round;
    std::memcpy(g.slot(round, g.rank), x + off, len * sizeof(T));
    g.meet(round);
    sum_slots(x + off, g, round, len);
  }
}

void shm_all_reduce(at::Tensor x, at::Tensor flags, at::Tensor slots, int64_t rank, double timeout_s) {
  const shm::Group g = shm::group_of(flags, slots, rank, timeout_s);
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), "x: a contiguous CPU tensor");
  if (x.scalar_type() == at::kFloat)
    shm_all_reduce_impl(x.data_ptr<float>(), x.numel(), g);
  else if (x.scalar_type() == at::kBFloat16)
    shm_all_reduce_impl(x.data_ptr<c10::BFloat16>(), x.numel(), g);
  else
    TORCH_CHECK(false, "shm_all_reduce: float32 or bfloat16, not ", x.scalar_type());
}
