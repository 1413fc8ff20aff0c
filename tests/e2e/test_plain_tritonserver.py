"""The product as a Triton user runs it: `model_repository/llm` copied into their own repository and served by
the plain `tritonserver` binary (the one the nvidia-pytriton wheel ships), not through `inflight serve`.

Only what a user must do by hand comes from the launcher's public helpers: where the binary is, a backends
directory with the Python-backend stub for this interpreter, and the stub's environment (PATH, libraries).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from e2e_util import ENGINE_ARGS
from helpers import PROMPTS

from inflight import SamplingParams
from inflight.launcher.server import default_model_repository, free_ports, set_parameters
from inflight.launcher.triton_dist import find_server, prepare_backends, server_env

# Long enough that the responder's polls see the answer in several parts even on a busy machine (it merges the
# tokens a request got between two polls into one response).
MAX_TOKENS = 160
READY_TIMEOUT_S = 240  # loading the model (and building the C++ ops once) on a busy 2-core machine


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory, demo_model_dir):
    """tritonserver on a repository holding a copy of model_repository/llm, its config.pbtxt edited as a user
    would: the model to serve and the engine settings the e2e tests use."""
    root = tmp_path_factory.mktemp("plain")
    repository = root / "models"
    source = default_model_repository() / "llm"
    shutil.copytree(source, repository / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    config = repository / "llm" / "config.pbtxt"
    config.write_text(set_parameters(config.read_text(), dict(ENGINE_ARGS, model=demo_model_dir)))

    dist = find_server()
    backends = prepare_backends(dist, root)
    http, grpc, metrics = free_ports(3)
    command = [
        str(dist.executable),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        "--model-control-mode=explicit",
        "--load-model=llm",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
    ]
    log_path = root / "tritonserver.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command, env=server_env(dist), cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(proc, f"http://localhost:{http}/v2/models/llm/ready", log_path)
        yield f"localhost:{grpc}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the backend stub shares the server's session
        proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        assert proc.poll() is None, f"tritonserver exited with {proc.returncode}:\n{tail}"
        assert time.monotonic() < deadline, f"llm not ready after {READY_TIMEOUT_S} s:\n{tail}"
        time.sleep(0.25)


def _stream(grpc_url: str, prompt: str) -> list[str]:
    """A greedy answer streamed over tritonclient's gRPC API, as a vLLM-backend client sends it: the deltas."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value, datatype: str):
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else np.bool_))
        return t

    sampling = f'{{"temperature": 0, "max_tokens": {MAX_TOKENS}, "ignore_eos": true}}'
    inputs = [
        tensor("text_input", prompt.encode(), "BYTES"),
        tensor("stream", True, "BOOL"),
        tensor("sampling_parameters", sampling.encode(), "BYTES"),
        tensor("exclude_input_in_output", True, "BOOL"),
    ]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        deltas = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            deltas.append(result.as_numpy("text_output")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return deltas
    finally:
        client.stop_stream()
        client.close()


def test_plain_tritonserver_streams_the_offline_greedy_answer(plain_server, offline_llm):
    prompt = PROMPTS[2]
    (expected,) = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    deltas = _stream(plain_server, prompt)
    assert "".join(deltas) == expected.text
    assert sum(bool(d) for d in deltas) > 1, "the answer came in one response: not streamed"
