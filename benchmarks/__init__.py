"""Benchmarks by kind, each runnable as `python -m benchmarks.<kind>.<name>`: kernels/ (op micro-benchmarks),
engine/ (offline engine runs), peers/ (HF and vLLM-CPU on the same trace), serving/ (through tritonserver);
common/ holds what they share (traces, run metrics, benchmark models, plots, the report)."""

from inflight import omp

omp.apply()  # before any benchmark imports torch
