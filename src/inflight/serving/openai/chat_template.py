"""A checkpoint's chat template, rendered the way HF `apply_chat_template` renders it.

Same environment as transformers: jinja2's ImmutableSandboxedEnvironment (templates from the Hub are
untrusted code), `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson` that does not
escape HTML, `raise_exception`, `strftime_now`, the `{% generation %}` tag, and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, or the template rejected it)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str = "") -> None:
        self.source = source
        self.special_tokens = special_tokens
        self.origin = origin
        try:
            self._template = compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template of {origin} does not compile: {e}") from None

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ChatTemplate:
        """HF's lookup order: chat_template.jinja, then tokenizer_config.json's `chat_template`
        (a string, or a list of named templates of which "default" is used)."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(), tokens, str(jinja_file))
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            raise ChatTemplateError(
                f"the checkpoint at {model_dir} has no chat template (no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json): use /v1/completions with a prompt you format yourself"
            )
        return cls(source, tokens, str(config_path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> ChatTemplate:
        """A GGUF file's `tokenizer.chat_template`, its special tokens named by `tokenizer.ggml.*_token_id`."""
        from inflight.model_source import gguf_metadata

        meta = gguf_metadata(path)
        source = meta.chat_template()
        if not source:
            raise ChatTemplateError(
                f"the GGUF file {path} has no chat template (no 'tokenizer.chat_template' in its metadata): use "
                "/v1/completions with a prompt you format yourself"
            )
        return cls(source, meta.special_tokens(), f"{path} (tokenizer.chat_template)")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}  # HF passes both, maybe None
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a sandbox violation
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template could not render the messages: {e!r}") from None
