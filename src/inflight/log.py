"""The `inflight` loggers' one handler, for processes that start no logging of their own (Triton's stub, the
engine core process): timestamped lines on stderr, which tritonserver's log collects."""

from __future__ import annotations

import logging
import sys


def setup(tag: str = "") -> None:
    """INFO and up from `inflight.*` to stderr, once per process; `tag` marks the process in each line."""
    logger = logging.getLogger("inflight")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(name)s{tag} %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
