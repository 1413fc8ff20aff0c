"""What a failed request carries from the engine to every front: a `kind` and the request `field` at fault.

The kind decides the answer (Triton INVALID_ARG / UNAVAILABLE / INTERNAL, OpenAI 400 with `param` / 503 /
500); the field names the request's input. Both travel as values end to end; across Triton, whose error
carries only a message, they ride in a tag at the message's start (`tag_message` / `read_tagged`).
No dependencies: the engine, the Triton model, the OpenAI front and the Dynamo worker all import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorKind(str, enum.Enum):
    INVALID = "invalid"  # the request is wrong
    LIMIT = "limit"  # the request is over a bound of the server (max_model_len, KV capacity, max_* settings)
    UNAVAILABLE = "unavailable"  # shutting down, restarting, or the engine is broken
    INTERNAL = "internal"  # the engine failed
    CANCELLED = "cancelled"  # the client went away (never sent back to it)

    @property
    def is_users(self) -> bool:
        """The user can fix the request (a 400)."""
        return self in (ErrorKind.INVALID, ErrorKind.LIMIT)


class InvalidRequestError(ValueError):
    """A request the user can fix: the message names the value and the allowed range, `field` the request
    field (top-level: `max_tokens`, `structured_outputs`, `prompt`), `kind` INVALID or LIMIT."""

    def __init__(self, message: str, field: str | None = None, kind: ErrorKind | str = ErrorKind.INVALID) -> None:
        super().__init__(message)
        self.field = field
        self.kind = ErrorKind(kind)


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank died, or the ranks fell out of step): no
    request's fault, nothing to retry in this process (vLLM's name)."""


@dataclass(frozen=True)
class TaggedError:
    kind: ErrorKind
    field: str | None
    message: str


_TRITON_REQUEST_ID = "[request id: "  # Triton's own prefix on a request's error message


def tag_message(kind: ErrorKind, field: str | None, message: str) -> str:
    """`[limit max_tokens] max_tokens=9000 is too large: ...`: a human reads the message, a front the tag."""
    return f"[{kind.value}{' ' + field if field else ''}] {message}"


def read_tagged(text: str) -> TaggedError | None:
    """The kind, field and message of a tagged message; None for an untagged one (Triton's own errors)."""
    if text.startswith(_TRITON_REQUEST_ID):
        text = text.partition("] ")[2]
    if not text.startswith("["):
        return None
    tag, sep, message = text[1:].partition("] ")
    kind, _, field = tag.partition(" ")
    if not sep or kind not in _KINDS:
        return None
    return TaggedError(ErrorKind(kind), field or None, message)


_KINDS = frozenset(k.value for k in ErrorKind)
