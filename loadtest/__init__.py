"""Load tests and offline benchmarks: the batching benchmark, HF baselines, serving overhead, Locust."""

import os

# OpenMP threads that spin at barriers collapse (10-40x slower, measured) when another process shares
# the cores; passive waiting costs little alone and keeps figures meaningful on a shared machine. Only
# effective when set before torch loads, which is the case for `python -m loadtest.<tool>`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
