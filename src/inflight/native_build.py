"""Builds this project's C++ CPU ops once per machine with `torch.utils.cpp_extension.load_inline`.

torch caches a build under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`) by name. Sources are
compiled with `-march=native`, so a cache shared across machines (a home directory on NFS, an image built
elsewhere) must not hand one CPU's build to another: the name carries a hash of the source and of the CPU's
instruction-set flags (two checkouts with different sources would otherwise rebuild over each other's copy).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import platform
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_built: dict[str, Any] = {}  # prefix -> module, or None once a build failed (not retried)


def build_name(prefix: str, source: str) -> str:
    key = platform.machine() + source
    try:
        with open("/proc/cpuinfo") as f:
            key += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{prefix}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def build(prefix: str, source: str, functions: list[str], fast_math: bool = False) -> Any:
    """The compiled module, or None if this machine cannot build it (logged once per `prefix`)."""
    with _lock:
        if prefix not in _built:
            _built[prefix] = None
            try:
                from torch.utils.cpp_extension import load_inline

                _built[prefix] = load_inline(
                    name=build_name(prefix, source),
                    cpp_sources=source,
                    functions=functions,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"] + (["-ffast-math"] if fast_math else []),
                    extra_ldflags=["-fopenmp", "-lm"],  # -lm brings libmvec: the vectorized expf
                )
            except Exception as exc:  # no compiler / headers: callers keep their plain-torch path
                logger.warning("C++ CPU ops %s could not be built (%s); using the plain-torch path", prefix, exc)
        return _built[prefix]


_NOT_RECORDED = contextlib.nullcontext()


def record(name: str) -> contextlib.AbstractContextManager:
    """`inflight::name` in an op profile; nothing outside one (a record_function cost ~5% of a demo-model step)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"inflight::{name}")
    return _NOT_RECORDED
