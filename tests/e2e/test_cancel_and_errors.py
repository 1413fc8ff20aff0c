"""Cancellation frees KV blocks at once; bad requests get INVALID_ARG and the server keeps serving."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
from e2e_util import ENGINE_ARGS, http_generate, metric, scrape, settled, wait_for
from helpers import PROMPTS
from inflight_client import InferenceError

from inflight.errors import ErrorKind, read_tagged


def test_cancel_mid_stream_returns_kv_blocks(client, server, step_log):
    before = metric(settled(server), "inflight_generation_tokens_total")
    steps_before = len(step_log.read_text().splitlines())
    max_tokens = 400
    stream = client.stream(PROMPTS[4], {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    for _ in range(3):
        next(stream)
    # Cancelled at once: the demo model decodes 400 tokens in well under a second, faster than the metrics
    # are published (every 0.5 s), so the step log, not a metrics scrape, shows the request holding blocks.
    stream.cancel()
    assert list(stream) == []
    assert stream.completion.finish_reason == "cancelled"

    def blocks_back():
        samples = scrape(server.metrics_url)
        free = metric(samples, "inflight_kv_blocks", state="free") == ENGINE_ARGS["num_kv_blocks"]
        return samples if free and metric(samples, "inflight_kv_blocks", state="used") == 0 else None

    after = wait_for(blocks_back, timeout_s=10)
    assert after, "KV blocks still in use after the cancel"
    assert metric(after, "inflight_requests", state="running") == 0
    assert metric(after, "inflight_kv_blocks", state="free") == ENGINE_ARGS["num_kv_blocks"]
    generated = metric(settled(server), "inflight_generation_tokens_total") - before
    assert generated < max_tokens, "the server kept generating after the cancel"
    steps = [json.loads(line) for line in step_log.read_text().splitlines()[steps_before:]]
    assert any(s["num_running"] == 1 and s["num_kv_blocks_used"] > 0 for s in steps), "it never held blocks"

    # The server is still healthy.
    assert client.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 4}).text


@dataclass
class Bad:
    text: bytes | None = b"Hello world"
    sampling: bytes | None = None
    flags: dict = field(default_factory=dict)
    mention: str = ""

    def tensors(self) -> dict[str, np.ndarray]:
        tensors = {name: np.array([value]) for name, value in self.flags.items()}
        if self.text is not None:
            tensors["text_input"] = np.array([self.text], dtype=np.object_)
        if self.sampling is not None:
            tensors["sampling_parameters"] = np.array([self.sampling], dtype=np.object_)
        return tensors

    def http_body(self) -> dict | None:
        """The same request for Triton's HTTP generate endpoint; None if JSON cannot carry it."""
        try:
            body = {k: v.decode() for k, v in (("text_input", self.text), ("sampling_parameters", self.sampling)) if v}
        except UnicodeDecodeError:
            return None
        if self.text == b"":
            body["text_input"] = ""
        return body | self.flags


BAD_REQUESTS = {
    "missing text_input": Bad(text=None, mention="text_input"),
    "empty text_input": Bad(text=b"", mention="text_input"),
    "non-UTF-8 text_input": Bad(text=b"caf\xe9 \xff", mention="UTF-8"),
    "invalid JSON": Bad(sampling=b'{"max_tokens": 4', mention="JSON"),
    "sampling_parameters not an object": Bad(sampling=b"[1, 2]", mention="JSON object"),
    "non-UTF-8 sampling_parameters": Bad(sampling=b'{"stop": "\xff"}', mention="UTF-8"),
    "unknown sampling key": Bad(sampling=b'{"max_tokenz": 4}', mention="max_tokenz"),
    "temperature out of range": Bad(sampling=b'{"temperature": -1}', mention="temperature"),
    "top_p out of range": Bad(sampling=b'{"top_p": 1.5}', mention="top_p"),
    "max_tokens zero": Bad(sampling=b'{"max_tokens": 0}', mention="max_tokens"),
    "max_tokens not a number": Bad(sampling=b'{"max_tokens": "many"}', mention="max_tokens"),
    "max_tokens wrong type": Bad(sampling=b'{"max_tokens": [4]}', mention="max_tokens"),
    # SamplingParams raises TypeError here (list(5)); the server still answers INVALID_ARG.
    "stop wrong type": Bad(sampling=b'{"stop": 5}', mention="stop=5"),
    "prompt over max_model_len": Bad(text=b"the model " * 600, mention="max_model_len"),
    "max_tokens over the limit": Bad(sampling=b'{"max_tokens": 100000}', mention="max_tokens"),
    "stream without excluding the input": Bad(
        flags={"stream": True, "exclude_input_in_output": False}, mention="exclude_input_in_output"
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_invalid_arg_and_server_keeps_serving(client, server, case):
    bad = BAD_REQUESTS[case]
    # gRPC streaming: the message names the field. (The status code travels on the gRPC stream only
    # with tritonserver >= 2.53; see inflight_client.stream.)
    with pytest.raises(InferenceError) as info:
        client.stream_tensors(bad.tensors()).collect()
    assert bad.mention in info.value.message
    assert info.value.code in (None, "INVALID_ARGUMENT")
    # HTTP generate carries Triton's error code as the HTTP status: INVALID_ARG -> 400 (INTERNAL -> 500).
    body = bad.http_body()
    if body is not None:
        status, reply = http_generate(server, body)
        assert status == 400, reply
        assert bad.mention in reply["error"]

    good = client.generate("Hello world", {"temperature": 0, "max_tokens": 3})
    assert good.text and good.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("sampling", "kind", "field"),
    [
        ({"top_p": 1.5}, ErrorKind.INVALID, "top_p"),
        ({"temprature": 0.5}, ErrorKind.INVALID, "temprature"),
        ({"stop": ["x" * 300_000]}, ErrorKind.LIMIT, "sampling_parameters"),  # over max_sampling_parameters_bytes
    ],
)
def test_an_error_carries_its_kind_and_field_as_values(client, sampling, kind, field):
    # The client reads the kind and the field from the error's tag: no parsing of the message's words.
    with pytest.raises(InferenceError) as info:
        client.generate("Hello", sampling)
    assert (info.value.kind, info.value.field) == (kind.value, field), info.value
    assert read_tagged(info.value.message) is None  # the tag is not shown as part of the message


def test_limits_are_named_in_the_message(client):
    with pytest.raises(InferenceError) as info:
        client.generate("Hello", {"max_tokens": 100000})
    assert "512" in info.value.message  # max_model_len of the test server
    with pytest.raises(InferenceError) as info:
        client.generate("Hello", {"top_p": 1.5})
    assert "1.5" in info.value.message and "(0, 1]" in info.value.message


def test_the_model_repository_api_is_closed_to_clients(server, client):
    # Explicit model control (for the self-unload of a broken engine) also opens load/unload over HTTP and
    # gRPC; without the launch's secret header a client can neither unload nor replace the model.
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{server.http_url}/v2/repository/models/llm/unload", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code in (401, 403)
    with urllib.request.urlopen(f"{server.http_url}/v2/models/llm/ready", timeout=30) as ready:
        assert ready.status == 200
    assert client.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 2}).text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v2/systemsharedmemory/region/probe/register", {"key": "/probe", "offset": 0, "byte_size": 64}),
        ("/v2/logging", {"log_verbose_level": 3, "log_error": False}),
        ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}),
        ("/v2/models/llm/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ],
)
def test_triton_admin_apis_are_closed_to_clients(server, client, path, body):
    # Shared-memory registration, log settings and trace settings are for the operator, as the repository is.
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code in (401, 403), refused.value.read()
    assert client.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 2}).text


def test_a_grammar_that_matches_nothing_is_invalid_arg(client):
    # It compiles but allows no token (root never ends): the user's input, not an engine failure.
    with pytest.raises(InferenceError) as info:
        client.generate(PROMPTS[0], {"max_tokens": 4, "structured_outputs": {"grammar": 'root ::= root "a"'}})
    assert (info.value.kind, info.value.field) == ("invalid", "structured_outputs"), info.value
    assert info.value.message.startswith("structured_outputs.grammar matches nothing"), info.value.message
    assert info.value.code in (None, "INVALID_ARGUMENT"), info.value
    assert client.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 2}).text
