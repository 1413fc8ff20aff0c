"""Per-request sampling parameters, validated at construction (vLLM's field names)."""

from __future__ import annotations

import functools
import json
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from inflight.coerce import field_types, is_scalar, parse_scalar, type_name
from inflight.errors import ErrorKind, InvalidRequestError


def _fail(name: str, value: Any, allowed: str) -> None:
    raise InvalidRequestError(f"{name}={value!r} is invalid: must be {allowed}", name.partition(".")[0])


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint in vLLM's shape: exactly one of json / regex / choice / grammar / json_object /
    structural_tag.

    `key` is the canonical form of the constraint: equal constraints compile once (the grammar cache key).
    """

    json: dict[str, Any] | bool | str | None = None  # a JSON schema (object, or its JSON text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF), root rule `root`
    json_object: bool | None = None  # any JSON object
    # xgrammar's structural tag (an object, or its JSON text): e.g. free text until a trigger, then tagged JSON
    structural_tag: dict[str, Any] | None = None
    # vLLM's option: JSON without free whitespace between tokens (compact, and far shorter for small models).
    disable_any_whitespace: bool = False

    CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    @classmethod
    def from_value(cls, value: Any, field_name: str = "structured_outputs") -> StructuredOutputsParams:
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            _fail(field_name, value, f"an object with one of the keys {', '.join(cls.CONSTRAINTS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(
                f"{field_name} has unknown key(s) {unknown}; known keys: {', '.join(sorted(known))}", field_name
            )
        given = [k for k in cls.CONSTRAINTS if value.get(k) is not None]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{field_name} must give exactly one constraint of {', '.join(cls.CONSTRAINTS)}; got "
                f"{len(given)}{': ' + ', '.join(given) if given else ''}",
                field_name,
            )
        (kind,) = given
        spec = value[kind]
        name = f"{field_name}.{kind}" if field_name == "structured_outputs" else field_name
        kwargs: dict[str, Any] = {}
        if kind in ("json", "structural_tag"):
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{name} is not valid JSON: {e}", field_name) from None
            if kind == "json" and not isinstance(spec, (dict, bool)):
                _fail(name, spec, "a JSON schema (an object, or its JSON text)")
            if kind == "structural_tag" and not isinstance(spec, dict):
                _fail(name, spec, "a structural tag (an object, or its JSON text)")
        elif kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
                _fail(name, spec, "a non-empty list of strings")
            spec = tuple(spec)
        elif kind == "json_object":
            if spec is not True:
                _fail(name, spec, "true")
        elif not isinstance(spec, str) or not spec:
            _fail(name, spec, "a non-empty string")
        kwargs[kind] = spec
        opt = value.get("disable_any_whitespace", False)
        if isinstance(opt, str) and opt.strip().lower() in ("true", "false"):
            opt = opt.strip().lower() == "true"
        if not isinstance(opt, bool):
            _fail(f"{field_name}.disable_any_whitespace", opt, "a bool")
        return cls(**kwargs, disable_any_whitespace=opt)

    @property
    def kind(self) -> str:
        return next(k for k in self.CONSTRAINTS if getattr(self, k) is not None)

    @functools.cached_property
    def key(self) -> tuple[str, str, bool]:  # the schema's canonical text: serialized once
        kind = self.kind
        spec = getattr(self, kind)
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, ensure_ascii=False)
        return kind, text, self.disable_any_whitespace


# The older top-level spellings (Triton's OpenAI frontend and older vLLM clients send these).
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
}
_STRUCTURED_FIELDS = frozenset(_GUIDED_FIELDS) | {"structured_outputs"}


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
    logprobs: int | None = None  # top-N logprobs per generated token (at most the engine's max_logprobs)
    # Output constraint, as an object ({"json": schema} | {"regex": ...} | {"choice": [...]} |
    # {"grammar": EBNF} | {"json_object": true}); normalized to StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    include_stop_str_in_output: bool = False  # keep the stop string / stop token's text that ended the output
    skip_special_tokens: bool = True
    # False: token ids only, no text (a client that detokenizes itself, such as Dynamo's frontend); stop strings
    # are matched on the text, so they need it.
    detokenize: bool = True
    # Accepted for vLLM compatibility; the `tokenizers` decoder decides the spacing of special tokens.
    spaces_between_special_tokens: bool = True
    # token id -> a value added to its logit before sampling, in [-100, 100] (OpenAI's; JSON keys may be strings)
    logit_bias: dict[int, float] | None = None
    n: int = 1  # sequences per request: only 1 (send n requests for n samples)
    best_of: int | None = None

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
        self._resolve_structured_outputs()
        self._resolve_logit_bias()
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
        if self.logprobs is not None and self.logprobs < 0:
            _fail("logprobs", self.logprobs, ">= 0")
        if self.n != 1:
            _fail("n", self.n, "1: one sequence per request (parallel sampling is not implemented; send n requests)")
        if self.best_of is not None and self.best_of != 1:
            _fail("best_of", self.best_of, "1 or null: one sequence per request (send best_of requests)")
        if any(s == "" for s in self.stop):
            _fail("stop", self.stop, "non-empty strings")
        if self.stop and not self.detokenize:
            _fail("stop", self.stop, "empty when detokenize is false (stop strings are matched on the text)")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "non-negative token ids")

    def _resolve_structured_outputs(self) -> None:
        """Fold the guided_* spellings into `structured_outputs`; more than one constraint is an error."""
        guided = {name: getattr(self, name) for name in _GUIDED_FIELDS if getattr(self, name) is not None}
        given = (["structured_outputs"] if self.structured_outputs is not None else []) + list(guided)
        if len(given) > 1:
            raise InvalidRequestError(
                f"{' and '.join(given)} are both set: a request takes one output constraint "
                "(structured_outputs, or one of the older guided_* keys)",
                given[0],
            )
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        elif guided:
            ((name, value),) = guided.items()
            self.structured_outputs = StructuredOutputsParams.from_value({_GUIDED_FIELDS[name]: value}, name)
            setattr(self, name, None)  # one home for the constraint: dataclasses.replace() stays valid

    def _resolve_logit_bias(self) -> None:
        """logit_bias as {int id: float}: ids may come as JSON's string keys; biases in [-100, 100]."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", self.logit_bias, "an object mapping token ids to biases")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                token = -1
            if isinstance(key, bool) or token < 0 or (isinstance(key, float) and not key.is_integer()):
                _fail("logit_bias", key, "keyed by non-negative token ids")
            if isinstance(value, str):
                value = _coerce("logit_bias", float, value)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias[{key}]={value!r} is invalid: must be a number in [-100, 100]",
                                          "logit_bias")  # fmt: skip
            bias[token] = float(value)
        self.logit_bias = bias or None

    def _check_types(self) -> None:
        for name, kind in field_types(SamplingParams).items():
            if name in _STRUCTURED_FIELDS or name == "logit_bias":  # shapes checked by their _resolve_*
                continue
            value = getattr(self, name)
            if not is_scalar(kind):  # list[str] / list[int]
                (inner,) = typing.get_args(kind)
                if not all(isinstance(v, inner) and not isinstance(v, bool) for v in value):
                    _fail(name, value, f"a list of {inner.__name__}")
                continue
            if value is None and name in ("seed", "logprobs", "best_of"):
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
            raise InvalidRequestError(
                f"sampling_parameters must be a JSON object, got {type(data).__name__}", "sampling_parameters"
            )
        known = field_types(cls)
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise InvalidRequestError(
                    f"sampling_parameters has unknown key {key!r}; known keys: {', '.join(sorted(known))}", key
                )
            kwargs[key] = _coerce(key, known[key], value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str, max_bytes: int = 256 << 10, max_depth: int = 64) -> SamplingParams:
        """Parse a JSON object, bounded in size (checked before parsing) and nesting."""
        return cls.from_dict(parse_json(text, max_bytes, max_depth))


def parse_json(text: str, max_bytes: int = 256 << 10, max_depth: int = 64) -> Any:
    """sampling_parameters' JSON text, bounded in size (checked before parsing) and nesting."""
    size = len(text.encode("utf-8")) if len(text) * 4 > max_bytes else len(text)
    if size > max_bytes:
        raise InvalidRequestError(
            f"sampling_parameters is {size} bytes: the limit is max_sampling_parameters_bytes={max_bytes}",
            "sampling_parameters",
            ErrorKind.LIMIT,
        )
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"sampling_parameters is not valid JSON: {e}", "sampling_parameters") from None
    except RecursionError:
        data, depth = None, max_depth + 1
    else:
        depth = json_depth(data, max_depth + 1)
    if depth > max_depth:
        raise InvalidRequestError(
            f"sampling_parameters nests more than {max_depth} levels deep: the limit is max_json_depth={max_depth}",
            "sampling_parameters",
            ErrorKind.LIMIT,
        )
    return data


def json_depth(value: Any, cap: int) -> int:
    """Nesting depth of parsed JSON (a scalar is 0, `{}` is 1), counting no further than `cap`."""
    depth, level = 0, [value]
    while depth < cap:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _coerce(name: str, kind: Any, value: Any) -> Any:
    if name == "guided_json_object" and isinstance(value, str):
        kind = bool
    elif name in _STRUCTURED_FIELDS:
        return value  # a schema may be sent as its JSON text: StructuredOutputsParams reads it
    if not isinstance(value, str) or not is_scalar(kind):
        return value  # native JSON, or a single stop string for the list field
    try:
        return parse_scalar(value, kind)
    except ValueError:
        _fail(name, value, f"a {type_name(kind)}")
