"""The served model as both endpoints see it: its Triton client, its name, its prompt renderer and the limits
its config and metrics publish (read once, on first use)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from inflight.serving.openai.protocol import RequestError
from inflight.serving.openai.renderer import PromptRenderer
from inflight.serving.openai.triton_stream import TritonLLM
from inflight.serving.prometheus_text import matching, scrape

log = logging.getLogger(__name__)


def kv_capacity(metrics_url: str, model: str) -> int | None:
    """The model's `inflight_kv_cache_capacity_tokens` from Triton's Prometheus endpoint."""
    try:
        samples = scrape(metrics_url)
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s): the default max_tokens is not capped by the KV cache", metrics_url, e)
        return None
    found = matching(samples, "inflight_kv_cache_capacity_tokens", model=model)
    if not found:
        log.warning("%s has no inflight_kv_cache_capacity_tokens for model %r", metrics_url, model)
        return None
    return int(found[0])


class ServedModel:
    """Shared by the endpoints: the Triton client, the served name, and what the model's config, checkpoint
    and metrics say (read on first use)."""

    def __init__(
        self, llm: TritonLLM, served_model_name: str, model_dir: str | Path | None, metrics_url: str | None = None
    ) -> None:
        self.llm = llm
        self.served_model_name = served_model_name
        self.model_dir = Path(model_dir) if model_dir else None
        self.metrics_url = metrics_url
        self.created = int(time.time())
        self._renderer: PromptRenderer | None = None
        self.kv_capacity: int | None = None  # tokens; the model's metrics say, if reachable
        self.max_prompt_bytes: int | None = None  # the model's bound on prompt text (its config), if known
        self._lock = asyncio.Lock()

    async def renderer(self) -> PromptRenderer:
        if self._renderer is not None:
            return self._renderer
        async with self._lock:
            if self._renderer is None:
                params = await self.llm.parameters()  # raises TritonUnavailable
                max_len = params.get("max_model_len", "")
                max_bytes = params.get("max_prompt_bytes", "")
                model_dir = self.model_dir or (Path(params["model"]) if params.get("model") else None)
                if self.metrics_url:
                    self.kv_capacity = await asyncio.to_thread(kv_capacity, self.metrics_url, self.llm.model)
                # No model: the default one (SmolLM2's GGUF), "demo": the demo checkpoint; the same bytes here.
                renderer = await asyncio.to_thread(
                    PromptRenderer.resolve, model_dir, int(max_len) if max_len.strip().isdigit() else None
                )
                if max_bytes.strip().isdigit():
                    self.max_prompt_bytes = int(max_bytes)
                elif renderer.max_model_len:  # the engine's default
                    self.max_prompt_bytes = 16 * renderer.max_model_len
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

    def default_max_tokens(self, renderer: PromptRenderer, num_prompt_tokens: int | None) -> int | None:
        """OpenAI's default: the rest of the context, which is also capped by what the KV cache holds
        (the engine rejects a request that could never fit)."""
        limits = [n for n in (renderer.max_model_len, self.kv_capacity) if n]
        if not limits or num_prompt_tokens is None or num_prompt_tokens >= min(limits):
            return None
        return min(limits) - num_prompt_tokens
