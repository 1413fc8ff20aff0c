"""The readiness companion (inflight.serving.health) against a stand-in for Triton's model loading API."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from inflight.serving.health import HealthModel, health_model_name, server_ready_url


class FakeTriton:
    """pb_utils' load_model / unload_model over a dict of loaded models; a load may be held at a gate."""

    def __init__(self) -> None:
        self.loaded: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.load_error: str | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.starting = 0  # loads refused as the server's start-up refuses them

    def is_model_ready(self, name: str) -> bool:  # a stub's call while the server unloads can crash it: never asked
        self.calls.append(("is_model_ready", name))
        return True

    def load_model(self, name: str, config: str = "", files: dict | None = None) -> None:
        self.calls.append(("load", name))
        self.gate.wait()
        if self.starting:
            self.starting -= 1
            raise RuntimeError("Failed to process the request for model 'llm_0_0', message: Server not ready")
        if self.load_error:
            raise RuntimeError(self.load_error)
        self.loaded[name] = {"config": json.loads(config), "files": files}

    def unload_model(self, name: str) -> None:
        self.calls.append(("unload", name))
        if self.loaded.pop(name, None) is None:
            raise RuntimeError("Model to be unloaded has not been served")


def _until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture()
def triton():
    return FakeTriton()


def companion(triton: FakeTriton, started: threading.Event | None = None) -> HealthModel:
    return HealthModel(triton, "llm", "llm_health", server_started=(started or _STARTED).is_set)


_STARTED = threading.Event()
_STARTED.set()


def test_loaded_once_its_own_model_has_initialized_with_its_files(triton):
    health = companion(triton)
    health.serving()
    time.sleep(0.05)
    assert triton.calls == []  # the server is still starting: the loading API must wait, and nothing is asked
    health.initialized()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert triton.calls == [("load", "llm_health")]
    loaded = triton.loaded["llm_health"]
    assert loaded["config"]["backend"] == "python" and loaded["config"]["output"][0]["name"] == "ready"
    compile(loaded["files"]["file:1/model.py"], "model.py", "exec")
    health.stop()


def test_unavailable_returns_once_it_is_unloaded_and_serving_loads_it_again(triton):
    health = companion(triton)
    health.initialized()
    health.serving()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert health.unavailable(wait_s=5.0)
    assert "llm_health" not in triton.loaded
    health.serving()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert triton.calls == [("load", "llm_health"), ("unload", "llm_health"), ("load", "llm_health")]
    health.stop()


def test_a_core_that_dies_before_the_server_runs_never_loads_it(triton):
    health = companion(triton)
    health.serving()
    assert health.unavailable(wait_s=5.0)
    health.initialized()
    time.sleep(0.05)
    assert ("load", "llm_health") not in triton.calls
    health.stop()


def test_a_failed_load_is_not_retried_and_does_not_block(triton, caplog):
    triton.load_error = "explicit model load / unload is not allowed if polling is enabled"
    health = companion(triton)
    health.initialized()
    health.serving()
    assert _until(lambda: triton.calls)
    assert health.unavailable(wait_s=0.0) or _until(lambda: health.unavailable(wait_s=0.0))
    health.serving()
    time.sleep(0.05)
    assert triton.calls == [("load", "llm_health")]
    assert "could not load 'llm_health'" in caplog.text
    health.stop()


def test_stop_waits_for_a_load_in_flight_and_unloads_what_came_up_after_it(triton):
    """Nothing of ours may call into the server once the model finalizes, and a companion loaded after the
    server began to unload every model would keep the server from exiting: stop() waits for the call in flight
    and unloads what it loaded."""
    triton.gate.clear()
    health = companion(triton)
    health.initialized()
    health.serving()
    assert _until(lambda: triton.calls == [("load", "llm_health")])  # held inside the load
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(health.stop(wait_s=5.0)))
    stopper.start()
    time.sleep(0.05)
    assert not stopped  # still inside the server's call
    triton.gate.set()
    stopper.join(5.0)
    assert stopped == [True]
    assert triton.calls == [("load", "llm_health"), ("unload", "llm_health")] and not triton.loaded


def test_a_load_refused_while_the_server_starts_is_tried_again(triton):
    triton.starting = 3
    health = companion(triton)
    health.initialized()
    health.serving()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert triton.calls == [("load", "llm_health")] * 4
    health.stop()


def test_a_core_that_dies_while_the_server_starts_gives_the_load_up_until_it_serves_again(triton):
    triton.starting = 10**6
    health = companion(triton)
    health.initialized()
    health.serving()
    assert _until(lambda: len(triton.calls) >= 2)
    assert health.unavailable(wait_s=5.0)
    triton.starting = 0
    health.serving()
    assert _until(lambda: "llm_health" in triton.loaded)
    health.stop()


def test_waits_for_the_server_to_start_asking_it_over_http_not_through_the_stub(triton):
    started = threading.Event()
    health = companion(triton, started)
    health.initialized()
    health.serving()
    time.sleep(0.5)
    assert triton.calls == []  # no call into the server while it starts: a failing one can crash the stub
    started.set()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert triton.calls == [("load", "llm_health")]
    health.stop()


def test_the_servers_readiness_url_comes_from_its_command_line(tmp_path, monkeypatch):
    fake = {"123": ["tritonserver", "--model-repository=/m", "--http-port=8123"], "124": ["tritonserver"],
            "125": ["tritonserver", "--http-port", "9000"], "126": ["tritonserver", "--allow-http=false"],
            "127": ["tritonserver", "--http-address=10.0.0.5", "--http-port=81"]}  # fmt: skip
    real_open = open

    def fake_open(path, *args, **kwargs):
        pid = str(path).split("/")[2] if str(path).startswith("/proc/") else None
        if pid in fake:
            return io.BytesIO("\0".join(fake[pid]).encode() + b"\0")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert server_ready_url(123) == "http://127.0.0.1:8123/v2/health/ready"
    assert server_ready_url(124) == "http://127.0.0.1:8000/v2/health/ready"
    assert server_ready_url(125) == "http://127.0.0.1:9000/v2/health/ready"
    assert server_ready_url(126) is None
    assert server_ready_url(127) == "http://10.0.0.5:81/v2/health/ready"


def test_names():
    assert health_model_name("llm", None) == "llm_health"
    assert health_model_name("llm", " ") == "llm_health"
    assert health_model_name("llm", "probe") == "probe"
    assert health_model_name("llm", "none") is None
