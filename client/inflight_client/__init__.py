"""gRPC streaming client for the inflight server (Triton's `llm` model, vLLM-backend request format)."""

from inflight_client.stream import Completion, Delta, InferenceError, LLMClient, TextStream, make_inputs

__all__ = ["Completion", "Delta", "InferenceError", "LLMClient", "TextStream", "make_inputs"]
