// The gather of CPU tensor-parallel ranks' tensors to rank 0 through shared memory (shm.h), in slot-sized
// chunks, a round each. Every rank waits for every other in each round, rank 0 included, so that no rank
// writes a bank rank 0 has not finished reading.
#include "common.h"
#include "ops.h"
#include "shm.h"

void shm_gather(std::optional<at::Tensor> out, at::Tensor x, at::Tensor flags, at::Tensor slots, int64_t rank,
                double timeout_s) {
  const shm::Group g = shm::group_of(flags, slots, rank, timeout_s);
  TORCH_CHECK(x.is_cpu() && x.is_contiguous(), "x: a contiguous CPU tensor");
  const int64_t n = x.nbytes();
  uint8_t* dst = nullptr;
  if (rank == 0) {
    TORCH_CHECK(out.has_value() && out->is_contiguous() && out->scalar_type() == x.scalar_type() &&
                    out->numel() == g.size * x.numel(),
                "out: rank 0's contiguous [size, *x.shape] of x's dtype");
    dst = static_cast<uint8_t*>(out->data_ptr());
  }
  const uint8_t* src = static_cast<const uint8_t*>(x.data_ptr());
  int64_t round = g.last_round();
  for (int64_t off = 0; off < n; off += g.slot_bytes) {
    const int64_t len = std::min(g.slot_bytes, n - off);
    ++round;
    std::memcpy(g.slot(round, g.rank), src + off, len);
    g.meet(round);
    if (dst)
      for (int64_t r = 0; r < g.size; ++r) std::memcpy(dst + r * n + off, g.slot(round, r), len);
  }
}
