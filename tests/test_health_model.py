"""The readiness companion (inflight.serving.health) against a stand-in for Triton's model loading API."""

from __future__ import annotations

import json
import threading
import time

import pytest

from inflight.serving.health import HealthModel, health_model_name


class FakeTriton:
    """pb_utils' is_model_ready / load_model / unload_model over a dict of loaded models."""

    def __init__(self) -> None:
        self.ready = threading.Event()  # the front's own model is READY
        self.loaded: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.load_error: str | None = None

    def is_model_ready(self, name: str) -> bool:
        return self.ready.is_set()

    def load_model(self, name: str, config: str = "", files: dict | None = None) -> None:
        self.calls.append(("load", name))
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


def test_loaded_once_its_own_model_is_ready_with_its_files(triton):
    health = HealthModel(triton, "llm", "llm_health", poll_s=0.01)
    health.serving()
    time.sleep(0.05)
    assert triton.calls == []  # the server is still starting: the loading API must wait
    triton.ready.set()
    assert _until(lambda: "llm_health" in triton.loaded)
    loaded = triton.loaded["llm_health"]
    assert loaded["config"]["backend"] == "python" and loaded["config"]["output"][0]["name"] == "ready"
    compile(loaded["files"]["file:1/model.py"], "model.py", "exec")
    health.stop()


def test_unavailable_returns_once_it_is_unloaded_and_serving_loads_it_again(triton):
    triton.ready.set()
    health = HealthModel(triton, "llm", "llm_health", poll_s=0.01)
    health.serving()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert health.unavailable(wait_s=5.0)
    assert "llm_health" not in triton.loaded
    health.serving()
    assert _until(lambda: "llm_health" in triton.loaded)
    assert triton.calls == [("load", "llm_health"), ("unload", "llm_health"), ("load", "llm_health")]
    health.stop()


def test_a_core_that_dies_before_the_server_runs_never_loads_it(triton):
    health = HealthModel(triton, "llm", "llm_health", poll_s=0.01)
    health.serving()
    assert health.unavailable(wait_s=5.0)
    triton.ready.set()
    time.sleep(0.05)
    assert ("load", "llm_health") not in triton.calls
    health.stop()


def test_a_failed_load_is_not_retried_and_does_not_block(triton, caplog):
    triton.ready.set()
    triton.load_error = "explicit model load / unload is not allowed if polling is enabled"
    health = HealthModel(triton, "llm", "llm_health", poll_s=0.01)
    health.serving()
    assert _until(lambda: triton.calls)
    assert health.unavailable(wait_s=0.0) or _until(lambda: health.unavailable(wait_s=0.0))
    health.serving()
    time.sleep(0.05)
    assert triton.calls == [("load", "llm_health")]
    assert "could not load 'llm_health'" in caplog.text
    health.stop()


def test_names():
    assert health_model_name("llm", None) == "llm_health"
    assert health_model_name("llm", " ") == "llm_health"
    assert health_model_name("llm", "probe") == "probe"
    assert health_model_name("llm", "none") is None
