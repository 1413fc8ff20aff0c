"""Load tests and offline benchmarks: the batching benchmark, HF baselines, serving overhead, Locust."""

import os

# OpenMP threads that spin at barriers collapse when another process shares the cores (a decode step
# 10-60x slower, measured); PASSIVE threads sleep after every op and pay a wake-up at the next, which on
# a quiet machine makes a decode step 1.5-2x slower than libgomp's default spin-then-sleep
# (docs/PERFORMANCE.md). Shared machines are the norm here, so PASSIVE is the default; on a machine of
# your own, run with OMP_WAIT_POLICY=ACTIVE or GOMP_SPINCOUNT=10000. Only effective when set before
# torch loads, which is the case for `python -m loadtest.<tool>`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
