"""The served model as both endpoints see it: its Triton client, its name, its prompt renderer and the limits
its config publishes (read once, on first use)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from inflight.limits import ModelLimits
from inflight.serving.openai.protocol import RequestError
from inflight.serving.openai.renderer import PromptRenderer
from inflight.serving.openai.triton_stream import TritonLLM

log = logging.getLogger(__name__)


class ServedModel:
    """Shared by the endpoints: the Triton client, the served name, and what the model's config and checkpoint
    say (read on first use)."""

    def __init__(self, llm: TritonLLM, served_model_name: str, model_dir: str | Path | None) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.model_dir = Path(model_dir) if model_dir else None
        self.created = int(time.time())
        self._renderer: PromptRenderer | None = None
        self.limits: ModelLimits | None = None  # the model's config's, with the checkpoint's context length
        self.max_prompt_bytes: int | None = None  # the model's bound on prompt text, if known
        self._lock = asyncio.Lock()

    async def renderer(self) -> PromptRenderer:
        if self._renderer is not None:
            return self._renderer
        async with self._lock:
            if self._renderer is None:
                params = await self.llm.parameters()  # raises TritonUnavailable
                configured = ModelLimits.from_parameters(params)
                model_dir = self.model_dir or (Path(params["model"]) if params.get("model") else None)
                # No model: the default one (SmolLM2's GGUF), "demo": the demo checkpoint; the same bytes here.
                renderer = await asyncio.to_thread(PromptRenderer.resolve, model_dir, configured.max_model_len)
                self.limits = ModelLimits.from_parameters(params, renderer.max_model_len)
                self.max_prompt_bytes = self.limits.max_prompt_bytes
                self._renderer = renderer
        return self._renderer

    def check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise RequestError(
                f"model={name!r} does not exist: this server serves {self.served_model_name!r}",
                "model",
                "model_not_found",
            )

    def check_chat_size(self, messages: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        """Bound what the template and the tokenizer will get before either runs: the prompt they make is
        at least as long as the messages' text, and the model refuses prompts over max_prompt_bytes."""
        limit = self.max_prompt_bytes
        if limit is None:
            return
        # Linear, as parsing the body was: every field the template may read counts.
        size = len(json.dumps([messages, extra], ensure_ascii=False).encode("utf-8"))
        if size > limit:
            raise RequestError(
                f"messages are {size} bytes (as JSON, roles and chat_template_kwargs included): the limit is "
                f"max_prompt_bytes={limit}, the model's bound on the prompt they make",
                "messages",
            )

    def check_prompt_size(self, prompt: str) -> None:
        """A completion's prompt against max_prompt_bytes, before it is encoded and sent to the model."""
        limit = self.max_prompt_bytes
        if limit is not None and len(prompt) > limit // 4:  # under limit // 4 characters it cannot be over
            size = len(prompt.encode("utf-8"))
            if size > limit:
                raise RequestError(
                    f"prompt is {size} bytes (UTF-8): the limit is max_prompt_bytes={limit}, the model's bound "
                    "(refused by the API before sending)",
                    "prompt",
                )

    def default_max_tokens(self, num_prompt_tokens: int | None) -> int | None:
        """OpenAI's default: the rest of the context, which is also capped by what the KV cache holds
        (the engine rejects a request that could never fit)."""
        if self.limits is None or num_prompt_tokens is None:
            return None
        return self.limits.max_tokens_after(num_prompt_tokens)
