"""Serving benchmarks: tritonserver over gRPC streaming vs in-process, the OpenAI port vs direct gRPC."""
