"""An OpenAI-compatible HTTP API in front of Triton: a thin client of the `llm` model's gRPC stream.

    inflight serve --openai-port 9000            # next to tritonserver
    inflight openai --triton-url host:8001       # in front of any running Triton

It never imports the engine: requests become the model's vLLM-backend request format (`text_input`,
`sampling_parameters`, the `return_*` flags) on Triton's gRPC stream, so Triton's batching, metrics and
cancellation apply unchanged.
"""

from inflight.serving.openai.app import create_app
from inflight.serving.openai.server import OpenAIServer

__all__ = ["OpenAIServer", "create_app"]
