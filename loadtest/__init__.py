"""Load tests and offline benchmarks: the batching benchmark, HF baselines, serving overhead, Locust."""

# OpenMP's wait policy is left to libgomp's default (spin briefly at a barrier, then sleep): on a quiet
# machine it is 1.5-2x faster per decode step than OMP_WAIT_POLICY=PASSIVE, whose threads sleep after every
# op and pay a wake-up at the next (docs/PERFORMANCE.md). On a machine shared with other work, run with
# OMP_WAIT_POLICY=PASSIVE: spinning threads that lose their core collapse instead.
