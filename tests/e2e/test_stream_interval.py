"""`stream_interval` (a server parameter): fewer, larger streamed responses, the same text, the first at once."""

from __future__ import annotations

import math

import numpy as np
import pytest
from e2e_util import ENGINE_ARGS
from helpers import PROMPTS

from inflight import SamplingParams
from inflight.launcher.server import LauncherError, TritonServer

INTERVAL = 8
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def interval_client(demo_model_dir, tmp_path_factory):
    from inflight_client import LLMClient

    log = tmp_path_factory.mktemp("interval") / "server.log"
    parameters = dict(ENGINE_ARGS, model=demo_model_dir, stream_interval=INTERVAL)
    srv = TritonServer(parameters=parameters, http_port=0, grpc_port=0, metrics_port=0, log=log).start()
    try:
        srv.wait_ready(timeout_s=240)
        yield LLMClient(srv.grpc_url, timeout_s=120)
    finally:
        assert srv.stop() == 0, f"tritonserver failed; log: {log}"


def _stream(client, prompt: str):
    tensors = {
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "stream": np.array([True]),
        "sampling_parameters": np.array(
            [f'{{"max_tokens": {MAX_TOKENS}, "temperature": 0, "ignore_eos": true}}'.encode()], dtype=np.object_
        ),
        "return_num_output_tokens": np.array([True]),
    }
    stream = client.stream_tensors(tensors)
    list(stream)
    return stream.completion


def test_responses_carry_at_least_the_interval_and_the_same_text(interval_client, offline_llm):
    expected = offline_llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    firsts = []
    for prompt, want in zip(PROMPTS[:4], expected):
        done = _stream(interval_client, prompt)
        assert done.text == want.text, prompt
        counts = [int(d.outputs["num_output_tokens"][0]) for d in done.deltas]
        assert sum(counts) == MAX_TOKENS
        firsts.append(counts[0])
        assert all(c >= INTERVAL for c in counts[1:-1]), counts  # intermediate responses: >= the interval
        # Every token on its own would be MAX_TOKENS responses; at the interval, about an eighth of that.
        assert len(counts) <= 2 + math.ceil((MAX_TOKENS - 1) / INTERVAL), counts
    # The first response goes out with the first text, not after the interval (time to first token is not
    # delayed). It carries more when the responder merged outputs that queued up while the host was busy, so
    # only one stream of the four must show it; a server that waited for the interval never would.
    assert min(firsts) < INTERVAL, firsts


def test_a_bad_stream_interval_fails_model_load_naming_it(tmp_path):
    log = tmp_path / "server.log"
    server = TritonServer(
        parameters={"stream_interval": "0"}, http_port=0, grpc_port=0, metrics_port=0, log=log
    ).start()
    try:
        with pytest.raises(LauncherError) as info:
            server.wait_ready(timeout_s=120)
    finally:
        server.stop()
    assert "stream_interval" in str(info.value)
