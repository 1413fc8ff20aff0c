"""inflight: in-flight batching over a paged KV cache, served from NVIDIA Triton Inference Server."""

from inflight.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "InvalidRequestError"]


def __getattr__(name: str):
    # LLM pulls in torch models and tokenizers; keep `import inflight` light for the Triton stub.
    if name == "LLM":
        from inflight.llm import LLM

        return LLM
    raise AttributeError(name)
