"""Per-request sampling parameters, validated at construction (vLLM's field names)."""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from inflight.coerce import field_types, is_scalar, parse_scalar, type_name


class InvalidRequestError(ValueError):
    """A request the user can fix: the message names the field, the value and the allowed range."""


def _fail(name: str, value: Any, allowed: str) -> None:
    raise InvalidRequestError(f"{name}={value!r} is invalid: must be {allowed}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-N logprobs per generated token

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                _fail(
                    name, getattr(self, name), "a list" if name == "stop_token_ids" else "a string or a list of strings"
                )
            setattr(self, name, list(getattr(self, name)))
        self._check_types()
        if self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, ">= 1")
        if not (0 <= self.min_tokens <= self.max_tokens):
            _fail("min_tokens", self.min_tokens, f"in [0, max_tokens={self.max_tokens}]")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, ">= 0 (0 means greedy)")
        if self.top_k < -1:
            _fail("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not (0 < self.top_p <= 1):
            _fail("top_p", self.top_p, "in (0, 1]")
        if not (0 <= self.min_p <= 1):
            _fail("min_p", self.min_p, "in [0, 1]")
        if not (0 < self.repetition_penalty <= 10):
            _fail("repetition_penalty", self.repetition_penalty, "in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                _fail(name, getattr(self, name), "in [-2, 2]")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            _fail("seed", self.seed, "in [0, 2**63)")
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            _fail("logprobs", self.logprobs, f"in [0, {self.MAX_LOGPROBS}]")
        if any(s == "" for s in self.stop):
            _fail("stop", self.stop, "non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "non-negative token ids")

    def _check_types(self) -> None:
        for name, kind in field_types(SamplingParams).items():
            value = getattr(self, name)
            if not is_scalar(kind):  # list[str] / list[int]
                (inner,) = typing.get_args(kind)
                if not all(isinstance(v, inner) and not isinstance(v, bool) for v in value):
                    _fail(name, value, f"a list of {inner.__name__}")
                continue
            if value is None and name in ("seed", "logprobs"):
                continue
            if kind is bool:
                ok = isinstance(value, bool)
            elif kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok:
                _fail(name, value, f"of type {kind.__name__}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from JSON-ish input; numbers may arrive as strings (genai-perf sends `"64"`)."""
        if not isinstance(data, dict):
            raise InvalidRequestError(f"sampling_parameters must be a JSON object, got {type(data).__name__}")
        known = field_types(cls)
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise InvalidRequestError(
                    f"sampling_parameters has unknown key {key!r}; known keys: {', '.join(sorted(known))}"
                )
            kwargs[key] = _coerce(key, known[key], value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"sampling_parameters is not valid JSON: {e}") from None
        return cls.from_dict(data)


def _coerce(name: str, kind: Any, value: Any) -> Any:
    if not isinstance(value, str) or not is_scalar(kind):
        return value  # native JSON, or a single stop string for the list field
    try:
        return parse_scalar(value, kind)
    except ValueError:
        _fail(name, value, f"a {type_name(kind)}")
