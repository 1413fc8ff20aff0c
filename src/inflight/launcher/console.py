"""The launcher's one way to tell its user something: a line on stderr, marked as ours."""

from __future__ import annotations

import sys


def say(message: str, who: str = "inflight") -> None:
    print(f"{who}: {message}", file=sys.stderr, flush=True)
