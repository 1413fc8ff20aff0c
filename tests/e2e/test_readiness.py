"""Readiness while the engine core restarts (own server): the probes a load balancer polls, Triton's
`/v2/models/llm_health/ready` and the OpenAI API's `/health`, say not ready from the moment the server knows
the core died until the new core serves, and a balancer that sends only when told ready gets no error.

The restarted core is held at a gate (a file) until the test has looked at the gap, so what is asserted is what
the server reports, in order, never how long anything took."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import textwrap
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from e2e_util import ENGINE_ARGS, metric, scrape, settled, wait_for
from faulty_engines import START_GATE_ENV
from inflight_client import InferenceError, LLMClient

from inflight.launcher.server import TritonServer, default_model_repository
from inflight.serving.openai import OpenAIServer

GATED_MODEL = """
import os
import sys

sys.path.insert(0, {tests!r})  # the core process is spawned with this path too
os.environ[{env!r}] = {gate!r}  # and with this environment

from inflight.serving.triton_model import TritonPythonModel as _Real


class TritonPythonModel(_Real):
    engine_class = "faulty_engines:GatedEngine"
"""
SHORT = {"temperature": 0, "max_tokens": 2}


@pytest.fixture(scope="module")
def gated(demo_model_dir, tmp_path_factory):
    """A server whose restarted cores wait while `gate` exists, its OpenAI API, and the gate."""
    tmp = tmp_path_factory.mktemp("readiness")
    gate = tmp / "gate"
    repo = tmp / "repo"
    shutil.copytree(default_model_repository(), repo, ignore=shutil.ignore_patterns("__pycache__"))
    model_py = GATED_MODEL.format(tests=str(Path(__file__).parent), env=START_GATE_ENV, gate=str(gate))
    (repo / "llm" / "1" / "model.py").write_text(textwrap.dedent(model_py))
    params = dict(ENGINE_ARGS, model=demo_model_dir)
    srv = TritonServer(repo, params, http_port=0, grpc_port=0, metrics_port=0, log=tmp / "server.log")
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
        assert srv.health_model == "llm_health"
        assert wait_for(srv.serving, timeout_s=60), "the health model was not loaded once the model was ready"
        with OpenAIServer(srv.grpc_url, port=0, host="127.0.0.1", model_dir=demo_model_dir) as api:
            yield srv, api, gate
    finally:
        assert srv.stop() == 0, f"tritonserver did not stop cleanly; log: {tmp / 'server.log'}"


class Probe:
    """GET `path` on a kept-alive connection: True for 200, False for anything else."""

    def __init__(self, url: str, path: str) -> None:
        self.netloc, self.path = urlsplit(url).netloc, path
        self.conn = http.client.HTTPConnection(self.netloc, timeout=10)

    def __call__(self) -> bool:
        try:
            self.conn.request("GET", self.path)
            reply = self.conn.getresponse()
            reply.read()
            return reply.status == 200
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.netloc, timeout=10)
            return False


def _post(url: str, path: str, body: dict) -> int:
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        return reply.status
    finally:
        conn.close()


def _transitions(samples: list[bool]) -> list[bool]:
    """The runs of a series, one entry per run: [True, False, True] for ready, then not, then ready."""
    return [s for i, s in enumerate(samples) if i == 0 or s != samples[i - 1]]


def test_probes_say_not_ready_while_the_core_restarts(gated):
    srv, api, gate = gated
    client = LLMClient(srv.grpc_url, timeout_s=60)
    triton_probe = Probe(srv.http_url, "/v2/models/llm_health/ready")
    openai_probe = Probe(api.url, "/health")
    samples: list[tuple[bool, bool]] = []  # (Triton's probe, the OpenAI API's), in order
    balancer: list[str] = []  # what the balancer did each turn: "skip" (not ready), "ok", or the error
    stop = threading.Event()
    turn = threading.Lock()  # held by the balancer for one turn (probe, then send); the test takes it to kill

    def poll() -> None:
        while not stop.is_set():
            samples.append((triton_probe(), openai_probe()))
            stop.wait(0.002)

    def balance() -> None:
        probe = Probe(srv.http_url, "/v2/models/llm_health/ready")
        while not stop.is_set():
            with turn:
                if not probe():
                    balancer.append("skip")
                else:
                    try:
                        client.generate("Hello", SHORT)
                        balancer.append("ok")
                    except InferenceError as e:
                        balancer.append(str(e))
            stop.wait(0.01)

    pid = int(metric(scrape(srv.metrics_url), "inflight_engine_core_pid"))
    streams = [client.stream(f"Story {i}:", {"max_tokens": 400, "ignore_eos": True}) for i in range(2)]
    for stream in streams:
        next(stream)  # in flight when the core dies
    threads = [threading.Thread(target=f, daemon=True) for f in (poll, balance)]
    for t in threads:
        t.start()
    assert wait_for(lambda: balancer.count("ok") >= 2 and len(samples) >= 20, timeout_s=60)
    gate.touch()  # the next core waits
    try:
        with turn:  # no balancer request is between its probe and its answer
            before_kill = len(samples)
            os.kill(pid, signal.SIGKILL)
            for stream in streams:
                with pytest.raises(InferenceError, match="the engine process died"):
                    for _ in stream:
                        pass
            # The server failed the streams only after it had unloaded the health model.
            in_gap = len(samples)
            assert not srv.serving()
            assert not Probe(api.url, "/health")()
            # A request sent anyway gets UNAVAILABLE (gRPC) / 503 (OpenAI), not a hang.
            with pytest.raises(InferenceError, match="restarting"):
                client.generate("Hello", SHORT)
            assert _post(api.url, "/v1/completions", {"model": "llm", "prompt": "Hello", "max_tokens": 2}) == 503
        # The core is held: however long the balancer keeps probing, it is told not ready and sends nothing.
        skips = balancer.count("skip")
        assert wait_for(lambda: balancer.count("skip") >= skips + 10 and len(samples) >= in_gap + 20, timeout_s=60)
        assert not any(ready for pair in samples[in_gap:] for ready in pair)
    finally:
        gate.unlink(missing_ok=True)
    assert wait_for(srv.serving, timeout_s=120), "not ready again after the core's restart"
    oks = balancer.count("ok")
    assert wait_for(lambda: balancer.count("ok") >= oks + 3 and len(samples) >= in_gap + 40, timeout_s=60)
    stop.set()
    for t in threads:
        t.join(timeout=30)

    errors = [b for b in balancer if b not in ("ok", "skip")]
    assert not errors, f"the balancer was told ready and then refused: {errors[:3]}"
    for i, name in enumerate(("/v2/models/llm_health/ready", "/health")):
        series = [pair[i] for pair in samples]
        assert all(series[:before_kill]), f"{name} said not ready before the kill"
        assert _transitions(series) == [True, False, True], f"{name} flapped: {_transitions(series)}"
    samples_after = settled(srv)
    assert metric(samples_after, "inflight_engine_core_starts_total") == 2
    assert metric(samples_after, "inflight_engine_core_pid") != pid
