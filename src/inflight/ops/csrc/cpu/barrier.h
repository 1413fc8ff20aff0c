// Where the threads of one parallel region meet between ops. A waiter spins first (its peer is mid-op,
// microseconds away) for up to SPIN_TICKS of the time-stamp counter, then sleeps on a futex until the last one
// arrives: with the cores shared, a waiter that kept spinning or yielding took the core its peer needed.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <atomic>
#include <climits>
#include <cstdint>

struct SpinBarrier {
  static constexpr uint64_t SPIN_TICKS = 1u << 17;
  std::atomic<int> arrived{0};
  std::atomic<int> phase{0};
  std::atomic<int> sleepers{0};
  void wait(int n) {
    if (n == 1) return;
    const int ph = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_seq_cst);
      // seq_cst on both sides: either a sleeper is counted here, or it sees the new phase before sleeping
      if (sleepers.load(std::memory_order_seq_cst) > 0)
        syscall(SYS_futex, reinterpret_cast<int*>(&phase), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
      return;
    }
    const uint64_t start = __rdtsc();
    while (phase.load(std::memory_order_acquire) == ph) {
      if (__rdtsc() - start < SPIN_TICKS) {
        _mm_pause();
        continue;
      }
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      while (phase.load(std::memory_order_seq_cst) == ph)  // the kernel sleeps only if it is still ph
        syscall(SYS_futex, reinterpret_cast<int*>(&phase), FUTEX_WAIT_PRIVATE, ph, nullptr, nullptr, 0);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
};
