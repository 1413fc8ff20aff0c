// The one place every CPU op is registered. torch::wrap_pybind_function turns c10 errors into Python ones
// and keeps the GIL during the call, on purpose: tests/kernels/test_native_gil.py says why and checks it.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("fused_add_rms_norm", torch::wrap_pybind_function(fused_add_rms_norm), "fused_add_rms_norm");
  m.def("rope", torch::wrap_pybind_function(rope), "rope");
  m.def("write_kv", torch::wrap_pybind_function(write_kv), "write_kv");
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul), "silu_and_mul");
  m.def("paged_attention", torch::wrap_pybind_function(paged_attention), "paged_attention", py::arg("out"),
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0);
  m.def("linear", torch::wrap_pybind_function(linear), "linear");
  m.def("gguf_pack", torch::wrap_pybind_function(gguf_pack), "gguf_pack");
  m.def("gguf_linear", torch::wrap_pybind_function(gguf_linear), "gguf_linear");
  m.def("gguf_embedding_rows", torch::wrap_pybind_function(gguf_embedding_rows), "gguf_embedding_rows");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("gumbel_noise", torch::wrap_pybind_function(gumbel_noise), "gumbel_noise");
  m.def("gumbel_argmax", torch::wrap_pybind_function(gumbel_argmax), "gumbel_argmax");
  m.def("gumbel_vector_logs", torch::wrap_pybind_function(gumbel_vector_logs), "gumbel_vector_logs");
  m.def("supports_f32", torch::wrap_pybind_function(supports_f32), "supports_f32");
  m.def("supports_bf16", torch::wrap_pybind_function(supports_bf16), "supports_bf16");
  m.def("amx_for", torch::wrap_pybind_function(amx_for), "amx_for");
  m.def("lora_apply", torch::wrap_pybind_function(lora_apply), "lora_apply");
  m.def("moe_pack", torch::wrap_pybind_function(moe_pack), "moe_pack");
  m.def("fused_moe", torch::wrap_pybind_function(fused_moe), "fused_moe");
  m.def("moe_route", torch::wrap_pybind_function(moe_route), "moe_route");
  m.def("llama_forward", torch::wrap_pybind_function(llama_forward), "llama_forward");
  // The collectives release the GIL while they wait for other ranks: the rank's watch threads must run.
  m.def("shm_all_reduce", torch::wrap_pybind_function_no_gil(shm_all_reduce), "shm_all_reduce");
  m.def("shm_gather", torch::wrap_pybind_function_no_gil(shm_gather), "shm_gather");
}
