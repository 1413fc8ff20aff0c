"""Typed fields from text: the one place that reads a dataclass's annotations and parses strings to them.

Engine flags on the command line, config.pbtxt parameters and sampling parameters sent as strings
(genai-perf sends `"max_tokens": "20"`) all arrive as text; each is parsed to its field's type here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


def field_types(cls: type) -> dict[str, Any]:
    """Each dataclass field's type with `None` taken out of optional ones (`int | None` -> int)."""
    return dict(_field_types(cls))  # a copy: the cached one is shared


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # Resolving the annotations (get_type_hints) is slow, and every request builds SamplingParams on the
    # thread that admits requests: once per class is enough.
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
        out[f.name] = tp
    return out


def is_scalar(tp: Any) -> bool:
    return tp in (bool, int, float, str)


def parse_scalar(text: str, tp: Any) -> Any:
    """`text` as a bool, int, float or str; ValueError when it is not one."""
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1"):
            return True
        if low in ("false", "0"):
            return False
        raise ValueError(f"{text!r} is not a bool")
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    return text


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))
