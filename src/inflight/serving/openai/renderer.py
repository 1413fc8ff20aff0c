"""The front's prompt renderer: the served model's chat template, its tokenizer (to count a chat prompt's
tokens for the default max_tokens) and max_model_len, read from an HF directory or a GGUF file's metadata
(inflight.model_source). Never the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from inflight.model_source import ModelSourceError, find_gguf, gguf_metadata, resolve_model
from inflight.serving.openai.chat_template import ChatTemplate, ChatTemplateError


@dataclass
class PromptRenderer:
    """Renders chat prompts with the served model's template and counts their tokens with its tokenizer."""

    model_dir: Path
    max_model_len: int | None
    template: ChatTemplate | None
    template_error: str | None  # why there is no template
    tokenizer: Tokenizer | None

    @classmethod
    def resolve(cls, spec: str | Path | None, max_model_len: int | None = None) -> PromptRenderer:
        """`spec` as the model takes it: None = the default model, "demo", or a path."""
        try:
            model_dir = resolve_model(spec)
        except ModelSourceError as e:
            return cls(Path(str(spec or "")), max_model_len, None, str(e), None)
        return cls.load(model_dir, max_model_len)

    @classmethod
    def load(cls, model_dir: str | Path, max_model_len: int | None = None) -> PromptRenderer:
        """`max_model_len`: the engine's setting, if any; capped by the checkpoint's, as the engine does."""
        model_dir = Path(model_dir)
        if not model_dir.exists():  # e.g. the Triton model's `model` path, on another host
            error = f"the checkpoint {model_dir} is not on this machine: start the API with --model DIR|FILE.gguf"
            return cls(model_dir, max_model_len, None, error, None)
        try:
            gguf_file = find_gguf(model_dir)
            if gguf_file is not None:
                return cls._load_gguf(gguf_file, max_model_len)
        except ModelSourceError as e:
            return cls(model_dir, max_model_len, None, str(e), None)
        try:
            template, error = ChatTemplate.from_checkpoint(model_dir), None
        except ChatTemplateError as e:
            template, error = None, str(e)
        tokenizer_file = model_dir / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.is_file() else None
        config_file = model_dir / "config.json"
        native = json.loads(config_file.read_text()).get("max_position_embeddings") if config_file.is_file() else None
        limits = [n for n in (max_model_len, native) if n]
        return cls(model_dir, min(limits) if limits else None, template, error, tokenizer)

    @classmethod
    def _load_gguf(cls, path: Path, max_model_len: int | None) -> PromptRenderer:
        meta = gguf_metadata(path)
        try:
            template, error = ChatTemplate.from_gguf(path), None
        except ChatTemplateError as e:
            template, error = None, str(e)
        native = meta.get(f"{meta.architecture}.context_length")
        limits = [n for n in (max_model_len, native) if n]
        return cls(path, min(limits) if limits else None, template, error, meta.tokenizer())

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        if self.template is None:
            raise ChatTemplateError(self.template_error or f"no chat template for {self.model_dir}")
        prompt = self.template.render(messages, add_generation_prompt, **kwargs)
        # The model tokenizes text_input with special tokens, as HF does with add_special_tokens=True; HF's
        # apply_chat_template does not. Where the tokenizer adds BOS itself, the template's own would double it.
        bos = self.template.special_tokens.get("bos_token")
        if bos and prompt.startswith(bos) and self._tokenizer_adds_bos:
            prompt = prompt[len(bos) :]
        return prompt

    @cached_property
    def _tokenizer_adds_bos(self) -> bool:
        bos = self.template.special_tokens.get("bos_token") if self.template else None
        if self.tokenizer is None or bos is None:
            return False
        bos_id = self.tokenizer.token_to_id(bos)
        ids = self.tokenizer.encode("a").ids
        return bos_id is not None and bool(ids) and ids[0] == bos_id

    def num_tokens(self, prompt: str) -> int | None:
        return len(self.tokenizer.encode(prompt).ids) if self.tokenizer is not None else None
