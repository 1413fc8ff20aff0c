"""Benchmarks by kind, each runnable as `python -m benchmarks.<kind>.<name>`: kernels/ (op micro-benchmarks),
engine/ (offline engine runs), peers/ (HF and vLLM-CPU on the same trace), serving/ (through tritonserver);
common/ holds what they share (traces, run metrics, benchmark models, plots, the report)."""

import os

# Spinning OpenMP threads collapse when another process takes a core, and shared machines are the norm
# here (docs/PERFORMANCE.md); on a machine of your own run with OMP_WAIT_POLICY=ACTIVE. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
