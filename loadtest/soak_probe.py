"""The soak's sampler: each process's memory, open files and threads (from /proc), the engine's gauges (from
Triton's metrics port) and the server's /dev/shm regions, at one moment.

The processes are found from the launcher down: `inflight serve` -> tritonserver -> the model's Python-backend
stub -> the engine core (a multiprocessing spawn child of the stub); the OpenAI front is its own process.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import psutil

from inflight.serving.prometheus_text import sample as metric
from inflight.serving.prometheus_text import scrape

MODEL = "llm"
ROLES = ("launcher", "tritonserver", "stub", "core", "openai")
PROC_FIELDS = ("rss_mb", "fds", "threads")
# Engine gauges and counters read back from the metrics port: the summary's name -> (metric, labels).
METRICS = {
    "kv_blocks_used": ("inflight_kv_blocks", {"state": "used"}),
    "kv_blocks_cached": ("inflight_kv_blocks", {"state": "cached"}),
    "requests_running": ("inflight_requests", {"state": "running"}),
    "requests_waiting": ("inflight_requests", {"state": "waiting"}),
    "grammar_cache_bytes": ("inflight_grammar_cache_bytes", {}),
    "core_pid": ("inflight_engine_core_pid", {}),
    "core_starts": ("inflight_engine_core_starts_total", {}),
    "preemptions": ("inflight_preemptions_total", {}),
    "prefix_cache_hits": ("inflight_prefix_cache_hits_total", {}),
    "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total", {}),
}
SHM_DIR = Path("/dev/shm")
SHM_PREFIX_FLAG = "shm-region-prefix-name="


def proc_stats(pid: int) -> dict[str, Any] | None:
    """RSS (VmRSS and its anonymous part), open fds and threads of a live process; None if gone or a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
        return None

    def kib(name: str) -> float:
        return int(fields.get(name, "0 kB").split()[0]) / 1024

    return {
        "pid": pid,
        "rss_mb": round(kib("VmRSS"), 2),
        "rss_anon_mb": round(kib("RssAnon"), 2),
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _serves(p: psutil.Process, model: str) -> bool:
    """A Python-backend stub of `model`: its command line names the instance, `<model>_<group>_<index>` (other
    models have stubs too, e.g. the readiness companion `llm_health`)."""
    try:
        return p.name().startswith("triton_python") and any(re.fullmatch(rf"{model}_\d+_\d+", a) for a in p.cmdline())
    except psutil.Error:
        return False


def server_pids(launcher_pid: int, core_pid: int | None = None) -> dict[str, int]:
    """{role: pid} of the launcher's process tree; a role missing is not running now (e.g. a core restarting).
    `core_pid` (the metrics' word) picks the core when a dying one is still around."""
    pids = {"launcher": launcher_pid}
    triton = next((p for p in _children(launcher_pid) if _alive(p) and p.name() == "tritonserver"), None)
    if triton is None:
        return pids
    pids["tritonserver"] = triton.pid
    stub = next((p for p in _children(triton.pid) if _alive(p) and _serves(p, MODEL)), None)
    if stub is None:
        return pids
    pids["stub"] = stub.pid
    cores = [p.pid for p in _children(stub.pid) if _alive(p) and "spawn_main" in _cmdline(p)]
    cores = [p for p in cores if "resource_tracker" not in _cmdline(psutil.Process(p))] if cores else []
    if cores:
        pids["core"] = core_pid if core_pid in cores else cores[-1]
    return pids


def shm_prefix(tritonserver_pid: int) -> str | None:
    """The Python backend's per-launch region prefix, from tritonserver's command line (launcher/server.py)."""
    try:
        args = psutil.Process(tritonserver_pid).cmdline()
    except psutil.Error:
        return None
    return next((a.split(SHM_PREFIX_FLAG, 1)[1] for a in args if SHM_PREFIX_FLAG in a), None)


def shm_bytes(prefix: str) -> int:
    """Bytes the server's /dev/shm regions occupy (allocated pages, not their sparse size)."""
    total = 0
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            total += path.stat().st_blocks * 512
        except OSError:
            continue
    return total


def engine_metrics(metrics_url: str) -> dict[str, float | None]:
    try:
        samples = scrape(metrics_url, timeout_s=5.0)
    except OSError:
        return dict.fromkeys(METRICS)
    return {key: metric(samples, name, **labels) for key, (name, labels) in METRICS.items()}


class Probe:
    """One sample of everything: `sample()`; `front_pid` is read each time (the front is restarted)."""

    def __init__(self, launcher_pid: int, front_pid, metrics_url: str) -> None:
        self.launcher_pid = launcher_pid
        self.front_pid = front_pid
        self.metrics_url = metrics_url
        self.prefix: str | None = None

    def sample(self) -> dict[str, Any]:
        engine = engine_metrics(self.metrics_url)
        core = engine.get("core_pid")
        pids = server_pids(self.launcher_pid, int(core) if core else None)
        front = self.front_pid()
        if front is not None:
            pids["openai"] = front
        procs = {role: proc_stats(pid) for role, pid in pids.items()}
        if self.prefix is None and "tritonserver" in pids:
            self.prefix = shm_prefix(pids["tritonserver"])
        shm = shm_bytes(self.prefix) if self.prefix else None
        return {"procs": {role: procs.get(role) for role in ROLES}, "engine": engine, "shm_bytes": shm}

    def quick(self) -> dict[str, float | None]:
        """The engine's gauges only (polled while the traffic pauses, to see how long draining takes)."""
        return engine_metrics(self.metrics_url)
