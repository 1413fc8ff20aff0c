"""An engine that fails and cannot recover makes the model report not ready (own server: it ends broken)."""

from __future__ import annotations

import shutil
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from e2e_util import ENGINE_ARGS, wait_for
from inflight_client import InferenceError, LLMClient

from inflight.launcher.server import LauncherError, TritonServer, default_model_repository, free_ports

# The real model with one fault in the engine its core process builds: once a request asks for
# max_tokens=13, every engine step raises (the device is "lost"), so the core's recovery fails too.
BREAKABLE_MODEL = textwrap.dedent(
    f"""
    import sys

    sys.path.insert(0, {str(Path(__file__).parent)!r})  # the core process is spawned with this path too

    from inflight.serving.triton_model import TritonPythonModel as _Real


    class TritonPythonModel(_Real):
        engine_class = "faulty_engines:BreakableEngine"
    """
)


def _ready(server) -> int:
    try:
        with urllib.request.urlopen(f"{server.http_url}/v2/models/llm/ready", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture()
def breakable_server(demo_model_dir, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(default_model_repository(), repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "llm" / "1" / "model.py").write_text(BREAKABLE_MODEL)
    srv = TritonServer(
        repo,
        dict(ENGINE_ARGS, model=demo_model_dir),
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        log=tmp_path / "server.log",
    )
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
        yield srv
    except LauncherError:
        raise
    finally:
        srv.stop()


def test_unrecoverable_engine_makes_the_model_not_ready(breakable_server):
    client = LLMClient(breakable_server.grpc_url, timeout_s=60)
    assert client.generate("Hello world", {"temperature": 0, "max_tokens": 4}).text
    assert _ready(breakable_server) == 200 and breakable_server.serving()
    with pytest.raises(InferenceError, match="device lost"):
        client.generate("Hello world", {"max_tokens": 13})
    assert wait_for(lambda: _ready(breakable_server) != 200, timeout_s=30), "the broken model still reports ready"
    assert not breakable_server.serving(), "the broken model's health model is still loaded"


def test_inflight_serve_exits_when_the_model_is_no_longer_ready(demo_model_dir, tmp_path):
    """A model that unloads itself leaves tritonserver up (its server-level readiness may stay true):
    `inflight serve` notices the model is gone, says so, and exits non-zero, so a supervisor restarts it."""
    import os
    import signal
    import subprocess
    import sys

    repo = tmp_path / "repo"
    shutil.copytree(default_model_repository(), repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "llm" / "1" / "model.py").write_text(BREAKABLE_MODEL)
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "inflight.launcher.cli", "serve", "--model", demo_model_dir, "--model-repository",
           str(repo), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--openai-port", "0", "--max-num-seqs", "2", "--num-kv-blocks", "16"]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:

            def ready() -> bool:
                try:
                    return (
                        urllib.request.urlopen(f"http://localhost:{http}/v2/models/llm/ready", timeout=2).status == 200
                    )
                except OSError:
                    return proc.poll() is not None

            assert wait_for(ready, timeout_s=180, interval_s=0.5) and proc.poll() is None
            client = LLMClient(f"localhost:{grpc}", timeout_s=60)
            with pytest.raises(InferenceError, match="device lost"):
                client.generate("Hello world", {"max_tokens": 13})
            code = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0
    assert "no longer ready" in log_path.read_text(errors="replace")
