"""What the benchmarks share: seeded traces, run metrics, benchmark models, the engine replay, plots, the report."""
