"""The OpenMP thread policy of every process this project starts: decided here, once.

OpenMP threads that spin at barriers collapse when another process (Triton's threads, a client, a second
engine) takes a core, and this project runs on small shared machines; sleeping threads cost a wake-up per
parallel region instead (docs/PERFORMANCE.md, "Threads and OpenMP policy"). So PASSIVE is the default,
and an OMP_WAIT_POLICY or GOMP_SPINCOUNT the user set is kept. The policy is read when torch starts its
OpenMP pool: call `apply()` before torch is imported, or `environment()` for a child process.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

WAIT_POLICY = "PASSIVE"


def environment(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`env` with the project's wait policy, unless it already chooses one (for a child process)."""
    if "GOMP_SPINCOUNT" not in env:
        env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return env


def apply() -> None:
    """This process's policy; effective only before torch (and its OpenMP pool) is loaded."""
    environment(os.environ)


def threads_sleep(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether OpenMP threads sleep between parallel regions (each region then pays a wake-up)."""
    env = os.environ if env is None else env
    return env.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
