"""Op micro-benchmarks: Triton kernels (GPU, or tiny shapes in the interpreter), the CPU GEMM and paged attention."""
