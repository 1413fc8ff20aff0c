"""Streaming through a real tritonserver: same text as the offline engine, concurrency, in-flight joins."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from e2e_util import http_generate, metric, scrape, settled, wait_for
from helpers import PROMPTS

from inflight import SamplingParams

GREEDY = {"temperature": 0, "max_tokens": 64}  # long enough that a stream is several responses even on a busy host


@pytest.fixture(scope="module")
def offline_greedy(offline_llm):
    """The offline engine's greedy text for every prompt (the reference for the server)."""
    outs = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"]))
    return {p: o.text for p, o in zip(PROMPTS, outs)}


def test_streamed_greedy_text_equals_offline(client, offline_greedy):
    for prompt in PROMPTS[:6]:
        with client.stream(prompt, GREEDY) as stream:
            deltas = list(stream)
        done = stream.completion
        assert done.text == offline_greedy[prompt], prompt
        assert len(deltas) > 1, "a stream must carry the text in several responses"
        assert all(d.text for d in deltas), "no empty intermediate responses"
        assert done.finish_reason in ("stop", "length")
        assert done.ttft_s is not None and done.ttft_s <= done.e2e_s


def test_32_concurrent_streams_all_correct(client, offline_greedy):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(lambda p: client.generate(p, GREEDY), prompts))
    for prompt, done in zip(prompts, results):
        assert done.text == offline_greedy[prompt], prompt


def _steps_since(step_log, line: int) -> list[dict]:
    return [json.loads(text) for text in step_log.read_text().splitlines()[line:]]


def test_late_requests_join_the_running_batch(client, server, step_log):
    """B and C arrive while A decodes: their prompts run in the same steps as A's decode instead of waiting
    for A to finish. The server's step log shows it (a step that decodes one sequence while it prefills
    another); static batching never has such a step. A runs for most of max_model_len so that it is still
    decoding when B arrives, however slow this client is; if it was not (the log shows the three one after
    another, nobody ever waiting), the scenario runs again."""
    long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    for _attempt in range(3):
        settled(server)  # nothing else in the engine: every logged step is A's, B's or C's
        start = len(step_log.read_text().splitlines())
        a = client.stream(PROMPTS[0], long)
        next(a)  # A is running
        b = client.stream(PROMPTS[1], {"temperature": 0, "max_tokens": 8})
        c = client.stream(PROMPTS[2], {"temperature": 0, "max_tokens": 8})
        assert b.collect().text and c.collect().text
        assert a.collect().finish_reason == "length"
        steps = _steps_since(step_log, start)
        assert steps and all(s["num_scheduled_seqs"] <= 3 for s in steps)
        if any(s["num_decode_seqs"] >= 1 and s["num_prefill_tokens"] > 0 for s in steps):
            break
        assert not any(s["num_waiting"] for s in steps), "a late request waited for the running batch to end"
    else:
        pytest.fail("A ended before B arrived three times: the client was too slow to test anything")
    assert max(s["num_scheduled_seqs"] for s in steps) >= 2
    assert max(s["arrival_spread_s"] for s in steps) > 0
    # Metrics are published at an interval: the step that mixed them may not be in the latest scrape yet.
    spread = wait_for(lambda: metric(scrape(server.metrics_url), "inflight_batch_arrival_spread_max_seconds") > 0)
    assert spread, "the largest arrival spread never reached the metrics"


def test_priority_input_is_accepted(client, offline_greedy):
    prompt = PROMPTS[5]
    assert client.generate(prompt, GREEDY, priority=-3).text == offline_greedy[prompt]


def test_non_streaming_sends_one_response_with_the_prompt(client, offline_greedy):
    prompt = PROMPTS[1]
    stream = client.stream(prompt, GREEDY, stream=False, exclude_input_in_output=False)
    deltas = list(stream)
    assert len(deltas) == 1
    assert stream.completion.text == prompt + offline_greedy[prompt]
    assert stream.completion.num_output_tokens > 0


def test_http_generate_returns_the_whole_text(server, offline_greedy):
    """Non-streaming through Triton's HTTP generate endpoint: one response, prompt prepended by default."""
    prompt = PROMPTS[3]
    status, reply = http_generate(server, {"text_input": prompt, "sampling_parameters": json.dumps(GREEDY)})
    assert status == 200, reply
    assert reply["text_output"] == prompt + offline_greedy[prompt]
    body = {"text_input": prompt, "exclude_input_in_output": True, "sampling_parameters": json.dumps(GREEDY)}
    assert http_generate(server, body)[1]["text_output"] == offline_greedy[prompt]


def test_optional_outputs(client):
    prompt = PROMPTS[0]
    tensors = {
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "stream": np.array([True]),
        "sampling_parameters": np.array(
            [b'{"max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": true}'], dtype=np.object_
        ),
        "return_finish_reason": np.array([True]),
        "return_cumulative_logprob": np.array([True]),
        "return_logprobs": np.array([True]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    }
    stream = client.stream_tensors(tensors)
    deltas = list(stream)
    final = stream.completion.deltas[-1].outputs
    assert stream.completion.finish_reason == "length"
    assert sum(int(d.outputs["num_output_tokens"][0]) for d in stream.completion.deltas) == 6
    assert all(int(d.outputs["num_input_tokens"][0]) > 0 for d in deltas)
    assert float(final["cumulative_logprob"][0]) <= 0
    logprobs = [entry for d in stream.completion.deltas for entry in json.loads(d.outputs["logprobs"][0])]
    assert len(logprobs) == 6
    assert all(v["logprob"] <= 0 and "decoded_token" in v for entry in logprobs for v in entry.values())


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_genai_perf_vllm_payload_streams_n_tokens(client, server, ignore_eos):
    """The payload exactly as genai-perf builds it for `--backend vllm` (strings for numbers)."""
    n = 12
    sampling = {"max_tokens": str(n)} | ({"ignore_eos": "true"} if ignore_eos else {})
    tensors = {
        "text_input": np.array([PROMPTS[2].encode()], dtype=np.object_),
        "exclude_input_in_output": np.array([True]),
        "stream": np.array([True]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
    }
    before = metric(settled(server), "inflight_generation_tokens_total")
    done = client.stream_tensors(tensors).collect()
    generated = metric(settled(server), "inflight_generation_tokens_total") - before
    assert done.text
    assert not done.text.startswith(PROMPTS[2])
    if ignore_eos:
        assert generated == n
    else:
        assert 1 <= generated <= n
