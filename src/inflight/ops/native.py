"""The one build of the C++ CPU ops (`csrc/cpu/*.cpp`), with one flag set, through `torch.utils.cpp_extension.load`.

torch caches a build under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`) by name. The sources
are compiled with `-march=native`, so a cache shared across machines (a home directory on NFS, an image built
elsewhere) must not hand one CPU's build to another: the name carries a hash of the sources, the flags,
torch's version and path, the sources' place, and the CPU's instruction-set flags.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc" / "cpu"
# -ffast-math for the ops' elementwise loops; the GEMM is intrinsics and gives the same bits with or without it.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
LDFLAGS = ("-fopenmp", "-lm")  # -lm brings libmvec: the vectorized expf


def build_name(csrc: Path = CSRC) -> str:
    # torch's own path too: environments with their own torch build against their own headers, and one
    # shared name would make them rebuild over each other's copy at every start.
    key = hashlib.sha1((platform.machine() + torch.__version__ + str(Path(torch.__file__).parent)).encode())
    # The sources' place too: torch's build file names them, so two trees sharing one build rebuild at each switch.
    key.update(str(csrc.resolve()).encode())
    for path in sorted(csrc.iterdir()):
        key.update(path.name.encode() + path.read_bytes())
    key.update(" ".join(CFLAGS + LDFLAGS).encode())
    try:
        with open("/proc/cpuinfo") as f:
            key.update(next((line for line in f if line.startswith("flags")), "").encode())
    except OSError:
        pass
    return f"inflight_cpu_{key.hexdigest()[:10]}"


def build_directory(csrc: Path = CSRC) -> Path:
    """Where `csrc`'s build lives: torch's layout (`<TORCH_EXTENSIONS_DIR>/py311_cpu/<name>`)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / build_name(csrc)


def build(csrc: Path = CSRC) -> Any:
    """The module built from `csrc`'s .cpp files (another tree's, for an A/B); raises if it cannot be built.

    torch guards a build with a `lock` file that a builder killed mid-build never removes, and every later
    start would wait on it forever. So builders take a kernel lock beside it instead (released when its holder
    dies, however it dies), and whoever holds that one removes torch's stale file."""
    from torch.utils.cpp_extension import load as load_extension

    directory = build_directory(csrc)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        return load_extension(
            name=directory.name,
            sources=[str(p) for p in sorted(csrc.glob("*.cpp"))],
            extra_cflags=list(CFLAGS),  # copies: torch appends its own flags to these lists
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(csrc)],
            build_directory=str(directory),
        )


_lock = threading.Lock()


def load() -> Any:
    """This package's module, or None if this machine cannot build it (logged once; callers keep plain torch)."""
    with _lock:
        return _load()


@functools.cache
def _load() -> Any:
    try:
        return build()
    except Exception as exc:  # no compiler / headers
        logger.warning("C++ CPU ops could not be built (%s); using the plain-torch path", exc)
        return None


_NOT_RECORDED = contextlib.nullcontext()


def record(name: str) -> contextlib.AbstractContextManager:
    """`inflight::name` in an op profile; nothing outside one (a record_function is not free on a small step)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(f"inflight::{name}")
    return _NOT_RECORDED
