"""Issue 27 item 2: `inflight serve` notices the model's backend stub dying, reloads the model, and removes the
shared memory a dead stub leaves in /dev/shm when it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from e2e_util import wait_for

from inflight.launcher.server import free_ports


def _children(pid: int) -> list[tuple[int, str, bool]]:
    """(pid, command name, alive) of the child processes of `pid`, from /proc."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
        if int(ppid) == pid:
            found.append((int(entry), stat[stat.find("(") + 1 : stat.rfind(")")], state != "Z"))
    return found


def _generate(http: int) -> bytes | None:
    body = b'{"text_input": "Hello", "sampling_parameters": "{\\"max_tokens\\": 3}"}'
    request = urllib.request.Request(f"http://localhost:{http}/v2/models/llm/generate", data=body)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.read()
    except OSError:
        return None


def _ready(http: int, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{http}/v2/models/{model}/ready", timeout=10) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_serve_reloads_the_model_when_its_stub_is_killed(demo_model_dir, tmp_path):
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "inflight.launcher.cli", "serve", "--model", demo_model_dir, "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--max-num-seqs", "2", "--num-kv-blocks", "6",
           "--max-model-len", "128", "--openai-port", "0"]  # fmt: skip
    log_path = tmp_path / "serve.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_for(lambda: _generate(http) or proc.poll() is not None, timeout_s=180, interval_s=0.5)
        assert proc.poll() is None, log_path.read_text()
        # The health model comes a moment after the first answer: the kill must find it loaded to unload it.
        assert wait_for(lambda: _ready(http, "llm_health"), timeout_s=60, interval_s=0.5)
        (server,) = [pid for pid, name, _ in _children(proc.pid) if name.startswith("tritonserver")]
        (stub,) = [pid for pid, name, alive in _children(server) if name.startswith("triton_python") and alive
                   and b"llm_0_0" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]  # fmt: skip
        argv = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
        prefixes = [a.rsplit(b"=", 1)[1].decode() for a in argv if a.startswith(b"--backend-config=python,shm-region")]
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_for(lambda: _generate(http), timeout_s=120, interval_s=1.0), log_path.read_text()
        assert time.monotonic() - killed < 120
        assert proc.poll() is None
        text = log_path.read_text()
        assert f"stub (pid {stub}) died" in text and "reloaded in" in text
        # The supervisor unloaded the health model for the reload; the new stub loads it again once it serves.
        assert "successfully unloaded 'llm_health'" in text
        assert wait_for(lambda: _ready(http, "llm_health"), timeout_s=60, interval_s=0.5)
        (prefix,) = prefixes  # this launch's shared-memory regions are its own
        assert list(Path("/dev/shm").glob(prefix + "*"))
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    # The killed stub's region (it could not unlink it) is gone with the server.
    assert not list(Path("/dev/shm").glob(prefix + "*"))
