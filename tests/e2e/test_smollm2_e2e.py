"""The default model served for real: `inflight serve` with no model is SmolLM2-135M-Instruct. One server
start: a factual chat question through the OpenAI port (the front finds the chat template in the GGUF by
itself) and the same question, rendered by the template, through Triton's gRPC stream."""

from __future__ import annotations

import pytest
from e2e_util import ENGINE_ARGS

from inflight.launcher.server import LauncherError, TritonServer
from inflight.model_source import default_model_path
from inflight.serving.openai import OpenAIServer
from inflight.serving.openai.renderer import PromptRenderer

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("smollm2") / "server.log"
    parameters = dict(ENGINE_ARGS)  # no `model`: the default one
    srv = TritonServer(parameters=parameters, http_port=0, grpc_port=0, metrics_port=0, log=log)
    srv.start()
    try:
        srv.wait_ready(timeout_s=300)
    except LauncherError:
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0, f"tritonserver failed; log: {log}"


def test_the_default_model_answers_paris_over_openai_and_grpc(default_server):
    with OpenAIServer(default_server.grpc_url, port=0, host="127.0.0.1") as api:
        oai = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)
        chat = oai.chat.completions.create(model="llm", messages=QUESTION, max_completion_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer and chat.choices[0].finish_reason == "stop", answer

    from inflight_client import LLMClient

    prompt = PromptRenderer.load(default_model_path()).chat_prompt(QUESTION, add_generation_prompt=True)
    done = LLMClient(default_server.grpc_url, timeout_s=120).generate(prompt, {"max_tokens": 24, "temperature": 0})
    assert done.text == answer and done.finish_reason == "stop"
    assert len([d for d in done.deltas if d.text]) > 1  # streamed
