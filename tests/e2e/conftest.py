"""One real tritonserver for the e2e session: the project's launcher, free ports, the demo model, tiny settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_util import ENGINE_ARGS

from inflight.launcher.server import LauncherError, TritonServer


@pytest.fixture(scope="session")
def server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tritonserver") / "server.log"


@pytest.fixture(scope="session")
def step_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("steps") / "steps.jsonl"


@pytest.fixture(scope="session")
def server(demo_model_dir, server_log, step_log):
    parameters = dict(ENGINE_ARGS, model=demo_model_dir, step_log=str(step_log))
    srv = TritonServer(parameters=parameters, http_port=0, grpc_port=0, metrics_port=0, log=server_log)
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
    except LauncherError:
        srv.stop()
        raise
    yield srv
    code = srv.stop()
    assert code == 0, f"tritonserver exited with {code}; log: {server_log}"


@pytest.fixture(scope="session")
def offline_llm(demo_model_dir):
    from inflight import LLM

    return LLM(demo_model_dir, **ENGINE_ARGS)


@pytest.fixture()
def client(server):
    from inflight_client import LLMClient

    return LLMClient(server.grpc_url, timeout_s=120)
