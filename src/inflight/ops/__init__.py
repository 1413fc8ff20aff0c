"""Every kernel's one home: the C++ CPU ops (`native`, `cpu`), the Triton-language kernels (`triton`) and the
torch oracles they are tested against (`reference`)."""
