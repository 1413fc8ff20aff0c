"""The engine core process killed mid-stream through a real tritonserver (own server: it restarts a core):
every stream ends with an error at once, none hangs, and the model serves again once the core is back."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from e2e_util import ENGINE_ARGS, metric, scrape, settled, wait_for
from inflight_client import InferenceError, LLMClient

from inflight.launcher.server import LauncherError, TritonServer


@pytest.fixture(scope="module")
def core_server(demo_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("core_death") / "server.log"
    srv = TritonServer(
        parameters=dict(ENGINE_ARGS, model=demo_model_dir), http_port=0, grpc_port=0, metrics_port=0, log=log
    )
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
        yield srv
    except LauncherError:
        raise
    finally:
        assert srv.stop() == 0, f"tritonserver did not stop cleanly; log: {log}"


def _core_pid(server) -> int:
    return int(metric(scrape(server.metrics_url), "inflight_engine_core_pid"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killing_the_core_fails_every_stream_at_once_then_serves_again(core_server):
    client = LLMClient(core_server.grpc_url, timeout_s=60)
    assert client.generate("Hello world", {"temperature": 0, "max_tokens": 4}).text
    pid = wait_for(lambda: _core_pid(core_server))
    streams = [
        client.stream(f"Story number {i}:", {"temperature": 0, "max_tokens": 480, "ignore_eos": True}) for i in range(4)
    ]
    for stream in streams:
        next(stream)  # every stream is running
    ended: list[tuple[float, Exception | None]] = []

    def drain(stream):
        try:
            for _ in stream:
                pass
            ended.append((time.monotonic(), None))
        except Exception as e:
            ended.append((time.monotonic(), e))

    threads = [threading.Thread(target=drain, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=10)
    assert len(ended) == len(streams), "a stream hung after the engine process died"
    latest = max(at for at, _ in ended) - killed
    for _, error in ended:
        assert isinstance(error, InferenceError), f"a stream ended without an error: {error!r}"
        assert "the engine process died (was killed by signal SIGKILL); restarting" in str(error)
    # The front fails them when it sees the core die (the message says so), not after a stream timeout; the
    # joins above bound it generously for a loaded machine.

    def served():
        try:
            return client.generate("Hello world", {"temperature": 0, "max_tokens": 4}).text
        except InferenceError as e:
            assert "restarting" in str(e) or "unavailable" in str(e).lower(), e
            return None

    assert wait_for(served, timeout_s=120, interval_s=0.2), "not served again after the core's restart"
    back = time.monotonic() - killed
    print(f"\nstreams failed {latest:.3f} s after the kill; served again after {back:.1f} s")
    assert not _alive(pid)
    samples = settled(core_server)
    assert metric(samples, "inflight_engine_core_pid") != pid
    assert metric(samples, "inflight_engine_core_starts_total") == 2
    assert metric(samples, "inflight_kv_blocks", state="used") == 0
    assert metric(samples, "inflight_kv_blocks", state="free") == ENGINE_ARGS["num_kv_blocks"]
    assert metric(samples, "inflight_requests", state="running") == 0


def test_the_core_exits_when_the_stub_dies(demo_model_dir, tmp_path):
    srv = TritonServer(
        parameters=dict(ENGINE_ARGS, model=demo_model_dir),
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        log=tmp_path / "server.log",
    )
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
        core = wait_for(lambda: _core_pid(srv))
        with open(f"/proc/{core}/stat") as f:
            stub = int(f.read().split(")")[-1].split()[1])  # the core's parent: Triton's backend stub
        client = LLMClient(srv.grpc_url, timeout_s=60)
        stream = client.stream("Hello", {"max_tokens": 480, "ignore_eos": True})
        next(stream)  # the core is busy when its front dies
        os.kill(stub, signal.SIGKILL)
        assert wait_for(lambda: not _alive(core), timeout_s=10), "the engine core outlived Triton's stub"
    finally:
        srv.stop()
