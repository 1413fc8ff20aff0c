"""The one table from a checkpoint's HF `architectures` to the class that runs it.

Torch-free strings, imported only when a model is built: ModelConfig names the supported architectures
without loading every family's module.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> (module, class)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("inflight.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("inflight.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("inflight.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("inflight.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("inflight.models.moe", "MoEForCausalLM"),
    "OlmoeForCausalLM": ("inflight.models.moe", "MoEForCausalLM"),
    "Qwen2MoeForCausalLM": ("inflight.models.moe", "MoEForCausalLM"),
    "Qwen3MoeForCausalLM": ("inflight.models.moe", "MoEForCausalLM"),
    "Gemma3ForCausalLM": ("inflight.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODELS)


def model_class(architecture: str) -> Any:
    """The class for a supported architecture (ModelConfig has already refused any other)."""
    module, name = MODELS[architecture]
    return getattr(importlib.import_module(module), name)
