"""The served model as both endpoints see it: its Triton client, its name, its prompt renderer and the limits
its config publishes (read once, on first use), and its LoRA adapters: each is served as a model of its own
name (vLLM's rule), listed by the Triton model itself (`lora_admin` {"action": "list"}) and cached briefly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from inflight.limits import ModelLimits
from inflight.serving.openai.protocol import RequestError
from inflight.serving.openai.renderer import PromptRenderer
from inflight.serving.openai.tool_parsers import ToolParser
from inflight.serving.openai.triton_stream import ModelError, TritonLLM

log = logging.getLogger(__name__)

# How long a listing of the adapters is trusted; a name not in it is looked up again at once.
ADAPTER_LIST_TTL_S = 2.0


class ServedModel:
    """Shared by the endpoints: the Triton client, the served name, and what the model's config and checkpoint
    say (read on first use)."""

    def __init__(
        self,
        llm: TritonLLM,
        served_model_name: str,
        model_dir: str | Path | None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.llm = llm
        self.tool_parser = tool_parser  # how the model writes a tool call (`tool_choice: auto`); None: no auto
        self.served_model_name = served_model_name
        self.model_dir = Path(model_dir) if model_dir else None
        self.created = int(time.time())
        self._renderer: PromptRenderer | None = None
        self.limits: ModelLimits | None = None  # the model's config's, with the checkpoint's context length
        self.max_prompt_bytes: int | None = None  # the model's bound on prompt text, if known
        self._lock = asyncio.Lock()
        self.root: str | None = str(self.model_dir) if self.model_dir else None  # the checkpoint served
        # LoRA adapters the model serves: name -> its directory where known (None: loaded elsewhere)
        self._adapters: dict[str, str | None] | None = None
        self._listed_at = 0.0
        self._list_lock = asyncio.Lock()
        self._paths: dict[str, str] = {}  # directories of the adapters loaded through this front
        self._preparing: asyncio.Task | None = None

    def prepared(self) -> bool:
        """Whether the tokenizer and chat template are loaded, so that a request need not wait for them; if
        not, their load starts now (in the background; one that fails, e.g. Triton not up yet, is retried at
        the next call)."""
        if self._renderer is not None:
            return True
        if self._preparing is None or self._preparing.done():
            self._preparing = asyncio.create_task(self._prepare())
        return False

    async def _prepare(self) -> None:
        with contextlib.suppress(Exception):  # logged where a request meets it; the next probe tries again
            await self.renderer()

    async def renderer(self) -> PromptRenderer:
        if self._renderer is not None:
            return self._renderer
        async with self._lock:
            if self._renderer is None:
                params = await self.llm.parameters()  # raises TritonUnavailable
                configured = ModelLimits.from_parameters(params)
                model_dir = self.model_dir or (Path(params["model"]) if params.get("model") else None)
                self.root = self.root or (str(model_dir) if model_dir else None)
                # No model: the default one (SmolLM2's GGUF), "demo": the demo checkpoint; the same bytes here.
                renderer = await asyncio.to_thread(PromptRenderer.resolve, model_dir, configured.max_model_len)
                self.limits = ModelLimits.from_parameters(params, renderer.max_model_len)
                self.max_prompt_bytes = self.limits.max_prompt_bytes
                self._renderer = renderer
        return self._renderer

    async def adapters(self, max_age_s: float = ADAPTER_LIST_TTL_S) -> dict[str, str | None]:
        """The LoRA adapters the model serves now: name -> directory (None where this front does not know it).
        Raises TritonUnavailable; a model without LoRA admin serves none."""
        if self._adapters is not None and time.monotonic() - self._listed_at < max_age_s:
            return self._adapters
        asked = time.monotonic()
        async with self._list_lock:
            if self._adapters is not None and self._listed_at >= asked:  # listed while this one waited
                return self._adapters
            try:
                answer = await self.llm.lora_admin({"action": "list"})
            except ModelError as e:
                log.warning("the model lists no LoRA adapters: %s", e.message)
                answer = {}
            names = answer.get("lora_names") or []
            known = answer.get("lora_modules") if isinstance(answer.get("lora_modules"), dict) else {}
            self._adapters = {str(n): known.get(n) or self._paths.get(n) for n in names}
            self._listed_at = time.monotonic()
            return self._adapters

    def forget_adapters(self) -> None:
        """The next look-up lists the adapters again (after a load or unload, or a request naming a gone one)."""
        self._adapters = None

    def adapter_loaded(self, name: str, path: str | None) -> None:
        if path is None:
            self._paths.pop(name, None)
        else:
            self._paths[name] = path
        self.forget_adapters()

    async def resolve_model(self, name: str) -> str | None:
        """vLLM's rule for `model`: the served name is the base model (None), an adapter's name is that adapter
        (its name); anything else is a 404 naming what exists."""
        if name == self.served_model_name:
            return None
        adapters = await self.adapters()
        if name not in adapters:
            adapters = await self.adapters(max_age_s=0)  # loaded elsewhere since the last listing?
        if name in adapters:
            return name
        served = ", ".join(repr(n) for n in [self.served_model_name, *sorted(adapters)])
        raise RequestError(
            f"model={name!r} does not exist: this server serves {served}", "model", "model_not_found", 404
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
