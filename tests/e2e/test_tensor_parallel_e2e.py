"""Tensor parallelism through a real tritonserver (own server: it restarts a core): two ranks stream what one rank
generates offline, a killed worker rank is a core death (every stream ends with an error at once, the model serves
again with new ranks), and a killed core takes its worker rank with it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from e2e_util import ENGINE_ARGS, metric, scrape, wait_for
from inflight_client import InferenceError, LLMClient

from inflight import SamplingParams
from inflight.launcher.server import TritonServer

PROMPTS = ["The model runs fast", "A city of light and music", "Tokens flow into blocks"]


@pytest.fixture(scope="module")
def tp_server(demo_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tensor_parallel") / "server.log"
    parameters = dict(ENGINE_ARGS, model=demo_model_dir, tensor_parallel_size=2)
    srv = TritonServer(parameters=parameters, http_port=0, grpc_port=0, metrics_port=0, log=log)
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
        yield srv
    finally:
        assert srv.stop() == 0, f"tritonserver did not stop cleanly; log: {log}"


def _core_pid(server) -> int:
    return int(metric(scrape(server.metrics_url), "inflight_engine_core_pid"))


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, parent pid) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], rest[0], int(rest[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


def _worker_of(core: int) -> int | None:
    """The core's rank-1 worker process."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(int(entry))
        if stat is not None and stat[0] == "inflight-tp1" and stat[2] == core and stat[1] != "Z":
            return int(entry)
    return None


def test_two_ranks_stream_one_ranks_greedy_text(tp_server, offline_llm):
    client = LLMClient(tp_server.grpc_url, timeout_s=60)
    expected = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    for prompt, want in zip(PROMPTS, expected):
        with client.stream(prompt, {"temperature": 0, "max_tokens": 16}) as stream:
            deltas = list(stream)
        assert stream.completion.text == want.text, prompt
        assert len(deltas) > 1
    assert _worker_of(_core_pid(tp_server)) is not None, "no tensor-parallel worker under the engine core"


def test_a_killed_worker_rank_is_a_core_death_and_a_killed_core_takes_its_rank(tp_server):
    client = LLMClient(tp_server.grpc_url, timeout_s=60)
    core = wait_for(lambda: _core_pid(tp_server))
    worker = wait_for(lambda: _worker_of(core))
    assert worker, "no tensor-parallel worker under the engine core"
    streams = [client.stream(f"Story number {i}:", {"max_tokens": 480, "ignore_eos": True}) for i in range(3)]
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
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=10)
    assert len(ended) == len(streams), "a stream hung after a tensor-parallel rank died"
    for _, error in ended:
        assert isinstance(error, InferenceError), f"a stream ended without an error: {error!r}"
        assert "the engine process died" in str(error) and "restarting" in str(error)
    print(f"\nstreams failed {max(at for at, _ in ended) - killed:.3f} s after the rank's kill")
    assert wait_for(lambda: not _alive(core), timeout_s=5), "the core outlived its worker rank"

    def served():
        try:
            return client.generate("Hello world", {"temperature": 0, "max_tokens": 4}).text
        except InferenceError as e:
            assert "restarting" in str(e) or "unavailable" in str(e).lower(), e
            return None

    assert wait_for(served, timeout_s=120, interval_s=0.2), "not served again after the core's restart"
    new_core = wait_for(lambda: _core_pid(tp_server) if _core_pid(tp_server) != core else None)
    new_worker = wait_for(lambda: _worker_of(new_core))
    assert new_core and new_worker and new_worker != worker
    os.kill(new_core, signal.SIGKILL)
    assert wait_for(lambda: not _alive(new_worker), timeout_s=5), "a worker rank outlived its engine core"
