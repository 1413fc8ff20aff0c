"""The Triton-language GPU kernels (run on a CPU only under TRITON_INTERPRET=1, in fp32/fp16); their torch
oracles are in `inflight.ops.reference`. Attention, norms, RoPE and KV write serve the attention backend;
`gguf_gemm` computes linears and embeddings on a GGUF file's quantized blocks."""
