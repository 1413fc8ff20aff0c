"""A Mixture-of-Experts checkpoint through a real tritonserver: concurrent gRPC streams give the offline
engine's greedy text, token for token (greedy decoding on CPU is batch-invariant)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_util import ENGINE_ARGS
from helpers import PROMPTS
from helpers.families import MOE_FAMILIES, write_family

from inflight import LLM, SamplingParams
from inflight.launcher.server import LauncherError, TritonServer

pytest.importorskip("transformers")

ARCH = "Qwen3MoeForCausalLM"
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
ARGS = dict(ENGINE_ARGS, dtype="float32")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    config_class, fields = MOE_FAMILIES[ARCH]
    model_dir, _ = write_family(tmp_path_factory.mktemp("moe"), ARCH, config_class, fields)
    return str(model_dir)


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tritonserver") / "moe_server.log"
    srv = TritonServer(parameters=dict(ARGS, model=moe_dir), http_port=0, grpc_port=0, metrics_port=0, log=log)
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
    except LauncherError:
        srv.stop()
        raise
    yield srv
    assert srv.stop() == 0, f"tritonserver failed; log: {log}"


def test_moe_streams_equal_the_offline_engine(moe_dir, moe_server):
    from inflight_client import LLMClient

    offline = LLM(moe_dir, **ARGS)
    expected = [o.text for o in offline.generate(PROMPTS[:8], SamplingParams(**GREEDY), use_tqdm=False)]
    client = LLMClient(moe_server.grpc_url, timeout_s=120)

    def stream(prompt: str):
        with client.stream(prompt, GREEDY) as s:
            deltas = list(s)
        return deltas, s.completion

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(stream, PROMPTS[:8]))
    for (deltas, done), text in zip(results, expected):
        assert done.text == text
        assert len(deltas) > 1 and done.finish_reason == "length"
