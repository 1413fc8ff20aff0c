// The meeting point of CPU tensor-parallel ranks on one host (shm_all_reduce.cpp, shm_gather.cpp), over a
// shared-memory segment that executor/shm_group.py lays out and maps:
//   flags int64 [size + 1, 8]: row 0 the abort word, row 1 + r the last round rank r published (64 bytes a row);
//   slots uint8 [2, size, slot_bytes]: one slot per rank in each of two banks, even and odd rounds.
// A round: each rank writes its slot of the round's bank, publishes the round, waits for every rank to publish
// it, then reads. A rank reaches round k + 2 (the same bank) only after every rank reached k + 1, so after every
// rank finished reading round k: two banks are enough.
#pragma once

#include <ATen/ATen.h>
#include <sched.h>

#include <chrono>
#include <cstdint>
#include <thread>

namespace shm {

// Spin first (a peer a few microseconds behind), then yield the core, then sleep (a peer descheduled).
constexpr double SPIN_S = 50e-6, YIELD_S = 2e-3;
constexpr int64_t SLEEP_US = 50;

struct Group {
  int64_t* flags;
  uint8_t* slots;
  int64_t rank, size, slot_bytes;
  double timeout_s;

  int64_t* round_word(int64_t r) const { return flags + 8 * (1 + r); }
  uint8_t* slot(int64_t round, int64_t r) const { return slots + ((round & 1) * size + r) * slot_bytes; }
  // The round this rank published last (only this rank writes its word).
  int64_t last_round() const { return __atomic_load_n(round_word(rank), __ATOMIC_RELAXED); }

  void check_not_aborted() const {
    TORCH_CHECK(__atomic_load_n(flags, __ATOMIC_ACQUIRE) == 0,
                "the tensor-parallel group was aborted (a rank is gone)");
  }

  // Publish `round` (this rank's slot is written), then wait until every rank has published it or a later one.
  // Raises if the group is aborted or a rank has not arrived within timeout_s.
  void meet(int64_t round) const {
    check_not_aborted();
    __atomic_store_n(round_word(rank), round, __ATOMIC_RELEASE);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < size; ++r) {
      for (int64_t spins = 0; __atomic_load_n(round_word(r), __ATOMIC_ACQUIRE) < round; ++spins) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        if (spins % 64) continue;  // the clock read costs about one pause
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited < SPIN_S) continue;
        check_not_aborted();
        TORCH_CHECK(waited < timeout_s, "tensor-parallel rank ", r, " did not reach round ", round, " within ",
                    timeout_s, " s (rank ", rank, " waited)");
        if (waited < YIELD_S)
          sched_yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(SLEEP_US));
      }
    }
  }
};

// The checked view of a segment's tensors.
inline Group group_of(const at::Tensor& flags, const at::Tensor& slots, int64_t rank, double timeout_s) {
  TORCH_CHECK(slots.scalar_type() == at::kByte && slots.dim() == 3 && slots.size(0) == 2 && slots.is_contiguous(),
              "slots: uint8 [2, size, slot_bytes], contiguous");
  const int64_t size = slots.size(1), slot_bytes = slots.size(2);
  TORCH_CHECK(flags.scalar_type() == at::kLong && flags.is_contiguous() && flags.dim() == 2 &&
                  flags.size(0) == size + 1 && flags.size(1) == 8,
              "flags: int64 [size + 1, 8], contiguous");
  TORCH_CHECK(rank >= 0 && rank < size, "rank ", rank, " outside a group of ", size);
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0, "slot_bytes: a multiple of 64");
  TORCH_CHECK(timeout_s > 0, "timeout_s > 0");
  return Group{flags.data_ptr<int64_t>(), slots.data_ptr<uint8_t>(), rank, size, slot_bytes, timeout_s};
}

}  // namespace shm
