"""The OpenAI-compatible API with the official `openai` client, in front of the session's real tritonserver."""

from __future__ import annotations

import json
import socket

import pytest
from e2e_util import ENGINE_ARGS, metric, scrape, settled, wait_for
from helpers import PROMPTS

from inflight import SamplingParams
from inflight.launcher.server import free_port
from inflight.serving.openai import OpenAIServer

openai = pytest.importorskip("openai")

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Tell me about the river"},
]


@pytest.fixture(scope="module")
def api(server, demo_model_dir):
    with OpenAIServer(server.grpc_url, port=0, host="127.0.0.1", model_dir=demo_model_dir) as srv:
        yield srv


@pytest.fixture()
def oai(api):
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(oai):
    assert [m.id for m in oai.models.list().data] == ["llm"]


def test_completion_matches_the_engine_and_the_stream(oai, offline_llm, hf_tokenizer):
    prompt = PROMPTS[2]
    expected = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    kwargs = dict(model="llm", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    done = oai.completions.create(**kwargs)
    assert done.choices[0].text == expected.text
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(hf_tokenizer(prompt).input_ids)
    assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12

    chunks = list(oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == done.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_streams_as_it_generates(oai):
    # The engine loop merges the outputs a slow reader has not taken yet, so 12 fast tokens may come as one
    # chunk; hundreds of steps come as one only if the server held the answer back.
    stream = oai.completions.create(
        model="llm", prompt=PROMPTS[2], max_tokens=300, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert len([t for t in texts if t]) > 1


def test_chat_streams_what_it_returns_with_hf_prompt_tokens(oai, hf_tokenizer):
    kwargs = dict(model="llm", messages=MESSAGES, max_completion_tokens=10, temperature=0)
    done = oai.chat.completions.create(**kwargs)
    message = done.choices[0].message
    assert message.role == "assistant" and message.content
    # The template rendered as HF renders it, and tokenized once (no doubled BOS).
    hf_ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert done.usage.prompt_tokens == len(hf_ids)
    assert done.usage.completion_tokens == 10 or done.choices[0].finish_reason == "stop"

    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    assert chunks[-1].usage == done.usage


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(oai):
    done = oai.chat.completions.create(model="llm", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage.total_tokens == ENGINE_ARGS["max_model_len"]


def test_stop_seed_and_sampling_fields(oai):
    base = dict(model="llm", prompt=PROMPTS[0], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = oai.completions.create(**base).choices[0].text
    stop = full[len(full) // 2 :][:3]
    cut = oai.completions.create(**base, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]

    sampled = dict(base, temperature=1.0, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.5)
    sampled["extra_body"] = {"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 4}
    first, second = (oai.completions.create(**sampled).choices[0].text for _ in range(2))
    assert first == second and first != full


def test_logprobs_name_the_sampled_tokens(oai):
    kwargs = dict(model="llm", max_tokens=8, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    done = oai.chat.completions.create(**kwargs, messages=MESSAGES, logprobs=True, top_logprobs=3).choices[0]
    content = done.logprobs.content
    assert len(content) == 8
    assert "".join(t.token for t in content) == done.message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert any(t.top_logprobs[0].token != t.token for t in content)  # sampled, not always the argmax

    text = oai.completions.create(**kwargs, prompt=PROMPTS[1], logprobs=2).choices[0]
    assert "".join(text.logprobs.tokens) == text.text
    assert text.logprobs.text_offset[0] == 0 and len(text.logprobs.top_logprobs) == 8


def test_closed_stream_frees_its_kv_blocks(oai, server):
    settled(server)
    stream = oai.chat.completions.create(
        model="llm", messages=MESSAGES, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _chunk in zip(range(4), stream):
        pass
    in_use = lambda: metric(scrape(server.metrics_url), "inflight_kv_blocks", state="used") > 0  # noqa: E731
    assert wait_for(in_use, timeout_s=5)  # metrics are published every 0.5 s
    stream.close()

    def blocks_back():
        samples = scrape(server.metrics_url)
        return metric(samples, "inflight_kv_blocks", state="used") == 0

    assert wait_for(blocks_back, timeout_s=10), "KV blocks still in use after the client closed the stream"
    after = settled(server)
    assert metric(after, "inflight_kv_blocks", state="free") == ENGINE_ARGS["num_kv_blocks"]
    assert oai.completions.create(model="llm", prompt="Hello", max_tokens=2).choices[0].text


def test_disconnect_during_a_non_streamed_request_cancels_it(api, server):
    settled(server)
    body = json.dumps({"model": "llm", "prompt": PROMPTS[4], "max_tokens": 400, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.create_connection(("127.0.0.1", api.port)) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        running = lambda: metric(scrape(server.metrics_url), "inflight_kv_blocks", state="used") > 0  # noqa: E731
        assert wait_for(running, timeout_s=30)
    freed = lambda: metric(scrape(server.metrics_url), "inflight_kv_blocks", state="used") == 0  # noqa: E731
    assert wait_for(freed, timeout_s=10), "KV blocks still in use after the client hung up"
    assert metric(scrape(server.metrics_url), "inflight_requests", state="running") == 0


BAD = {
    "n=0": ({"n": 0}, "n"),
    "n past the choices bound": ({"n": 257}, "n"),
    "negative max_tokens": ({"max_tokens": -5}, "max_tokens"),
    "negative max_completion_tokens": ({"max_completion_tokens": -5}, "max_completion_tokens"),
    "message without role": ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    "message content not text": ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    "no messages": ({"messages": []}, "messages"),
    "role the template rejects": ({"messages": [{"role": "critic", "content": "hi"}]}, "messages"),
    "response_format of unknown type": ({"response_format": {"type": "xml"}}, "response_format.type"),
    "json_schema without a schema": ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    "top_p out of range": ({"top_p": 1.5}, "top_p"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs too many": ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    "prompt longer than the context": ({"messages": [{"role": "user", "content": "river " * 600}]}, "messages"),
    "tool_choice auto without a parser": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    "tool_choice naming no tool": (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),  # fmt: skip
    "tool without a name": ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    "logit_bias out of range": ({"logit_bias": {"5": 101}}, "logit_bias"),
    "template kwargs naming messages": ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    "template kwargs naming add_generation_prompt": (
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs",
    ),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_400_naming_the_field(oai, case, stream):
    change, param = BAD[case]
    kwargs = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | change
    known = {"model", "messages", "max_tokens", "max_completion_tokens", "n", "response_format", "top_p", "logprobs",
             "top_logprobs", "tools", "tool_choice", "logit_bias"}  # fmt: skip
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**kwargs, stream=stream, extra_body=extra or None)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert oai.completions.create(model="llm", prompt="Hello", max_tokens=2).choices[0].text  # still serving


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_gets_404_model_not_found(oai, stream):
    # as OpenAI answers it: the model (or LoRA adapter) does not exist
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], stream=stream)
    error = info.value.body
    assert info.value.status_code == 404 and error["param"] == "model" and error["code"] == "model_not_found", error
    assert "gpt-4" in error["message"]


def test_oversized_chat_is_refused_before_templating_naming_the_limit(oai):
    # Many small messages: the front must bound what it templates and tokenizes on its event loop, before
    # doing either (the model's own bound comes only after both).
    limit = 16 * ENGINE_ARGS["max_model_len"]  # max_prompt_bytes' default
    many = [{"role": "user", "content": "hi"}] * (limit // 8)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="llm", messages=many, max_tokens=2)
    error = info.value.body
    assert error["param"] == "messages", error
    assert error["message"].startswith("messages are ") and f"max_prompt_bytes={limit}" in error["message"]


def test_n_prefills_the_prompt_once_and_equals_single_requests_with_derived_seeds(oai, server):
    prompt = PROMPTS[1] + " and a prompt long enough to fill blocks " * 3
    kwargs = dict(model="llm", prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    before = settled(server)
    four = oai.completions.create(**kwargs, n=4, seed=7)
    after = settled(server)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    texts = [c.text for c in four.choices]
    assert len(set(texts)) == 4  # distinct samples
    prompt_tokens = four.usage.prompt_tokens
    assert four.usage.completion_tokens == 32
    cached = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
    full_blocks = prompt_tokens // ENGINE_ARGS["block_size"] * ENGINE_ARGS["block_size"]
    assert cached == 3 * full_blocks  # the three later samples found the first one's prompt blocks
    singles = [oai.completions.create(**kwargs, seed=7 + j).choices[0].text for j in range(4)]
    assert singles == texts  # sample j is the single request with seed + j
    streamed = {}
    for chunk in oai.completions.create(**kwargs, n=4, seed=7, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == texts


def test_prompt_batches_and_token_ids_equal_their_text(oai, offline_llm):
    params = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    texts = [oai.completions.create(model="llm", prompt=p, **params).choices[0].text for p in PROMPTS[:3]]
    batch = oai.completions.create(model="llm", prompt=PROMPTS[:3], **params)
    assert [c.index for c in batch.choices] == [0, 1, 2] and [c.text for c in batch.choices] == texts
    one = oai.completions.create(model="llm", prompt=PROMPTS[0], **params)
    ids = offline_llm.engine.tokenize(PROMPTS[0])
    by_ids = oai.completions.create(model="llm", prompt=ids, **params)
    assert by_ids.choices[0].text == texts[0] and by_ids.usage.prompt_tokens == one.usage.prompt_tokens
    id_batch = oai.completions.create(model="llm", prompt=[ids, offline_llm.engine.tokenize(PROMPTS[1])], **params)
    assert [c.text for c in id_batch.choices] == texts[:2]
    echoed = oai.completions.create(model="llm", prompt=ids, echo=True, **params).choices[0].text
    assert echoed.endswith(texts[0]) and PROMPTS[0] in echoed
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="llm", prompt=[1, 10**9], max_tokens=2)
    assert info.value.body["param"] == "prompt" and "outside the vocabulary" in info.value.body["message"]


def test_logit_bias_forces_and_forbids_tokens(oai, offline_llm):
    ids = offline_llm.engine.tokenize(PROMPTS[0])
    tokenizer = offline_llm.engine.tokenizer
    greedy_first = offline_llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    forced = oai.completions.create(model="llm", prompt=ids, max_tokens=4, temperature=1.0, logit_bias={"77": 100},
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert forced.choices[0].text == tokenizer.decode([77] * 4)
    banned = oai.completions.create(model="llm", prompt=ids, max_tokens=1, temperature=0,
                                    logit_bias={str(greedy_first): -100})  # fmt: skip
    plain = oai.completions.create(model="llm", prompt=ids, max_tokens=1, temperature=0)
    assert plain.choices[0].text == tokenizer.decode([greedy_first]) != banned.choices[0].text


def test_tokenize_and_detokenize_as_the_model_counts(oai, api, hf_tokenizer):
    import httpx2 as httpx

    prompt = PROMPTS[3]
    answer = httpx.post(f"{api.url}/tokenize", json={"model": "llm", "prompt": prompt}, timeout=30).json()
    assert answer["tokens"] == hf_tokenizer(prompt).input_ids and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == ENGINE_ARGS["max_model_len"]
    usage = oai.completions.create(model="llm", prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == answer["count"]
    chat = httpx.post(f"{api.url}/tokenize", json={"model": "llm", "messages": MESSAGES}, timeout=30).json()
    assert (
        chat["count"] == oai.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    )
    back = httpx.post(f"{api.url}/detokenize", json={"model": "llm", "tokens": answer["tokens"]}, timeout=30).json()
    assert back["prompt"] == hf_tokenizer.decode(answer["tokens"])
    bad = httpx.post(f"{api.url}/detokenize", json={"model": "llm", "tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_malformed_json_body_is_a_400(api):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{api.url}/v1/completions", data=b'{"model": "llm", "prompt": ', method="POST")
    request.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400
    assert json.loads(info.value.read())["error"]["type"] == "invalid_request_error"


def test_triton_unavailable_is_a_503(demo_model_dir):
    with OpenAIServer(f"localhost:{free_port()}", port=0, host="127.0.0.1", model_dir=demo_model_dir) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for call in (
            lambda: client.completions.create(model="llm", prompt="Hello", max_tokens=2),
            lambda: client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=2, stream=True),
        ):
            with pytest.raises(openai.APIStatusError) as info:
                call()
            assert info.value.status_code == 503
            assert info.value.body["code"] == "service_unavailable"


def test_echo_and_per_chunk_usage(oai):
    kwargs = dict(model="llm", prompt=PROMPTS[3], max_tokens=5, temperature=0, echo=True)
    done = oai.completions.create(**kwargs).choices[0].text
    assert done.startswith(PROMPTS[3]) and len(done) > len(PROMPTS[3])
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(oai.completions.create(**kwargs, stream=True, stream_options=options))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].text and c.usage]
    assert counts == sorted(counts) and counts[-1] == 5  # cumulative on every chunk with text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_constrains_the_output(oai):
    jsonschema = pytest.importorskip("jsonschema")
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(3):
        kwargs = dict(model="llm", messages=MESSAGES, max_tokens=150, temperature=1.0, seed=seed)
        done = oai.chat.completions.create(**kwargs, response_format=schema_format).choices[0]
        assert done.finish_reason == "stop", done.message.content
        jsonschema.validate(json.loads(done.message.content), PERSON)
    free = oai.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=8, temperature=0)
    assert not free.choices[0].message.content.startswith("{")
    as_json = oai.chat.completions.create(
        model="llm", messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "json_object"}
    )
    assert as_json.choices[0].message.content.startswith("{")


def test_response_format_the_grammar_engine_rejects_is_a_400(oai):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4, response_format=bad)
    assert info.value.body["param"] == "response_format"
    assert "nonsense" in info.value.body["message"]


def test_a_body_over_the_cap_is_a_413_before_it_is_read(api):
    # Content-Length alone decides: the 20 MB never need to be sent.
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 20000000\r\n\r\n{\"prompt\": \"")  # fmt: skip
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after the 413
            reply += chunk
        reply = reply.decode()
    head, _, body = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    assert "max_body_bytes=16777216" in json.loads(body)["error"]["message"]


def test_an_oversized_completion_prompt_is_refused_by_the_front(oai):
    limit = 16 * ENGINE_ARGS["max_model_len"]  # max_prompt_bytes' default
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="llm", prompt="é" * limit, max_tokens=2)
    error = info.value.body
    assert error["param"] == "prompt", error
    assert f"max_prompt_bytes={limit}" in error["message"] and "refused by the API" in error["message"]


def test_the_api_key_is_required_on_v1_only(server, demo_model_dir):
    import urllib.request

    with OpenAIServer(server.grpc_url, port=0, host="127.0.0.1", model_dir=demo_model_dir, api_key="k3y") as srv:
        anonymous = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as info:
            anonymous.completions.create(model="llm", prompt="Hello", max_tokens=2)
        assert info.value.body["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k3y", max_retries=0, timeout=60)
        assert client.completions.create(model="llm", prompt="Hello", max_tokens=2).choices[0].text
        with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as reply:
            assert reply.status == 200


def test_health_says_ready_only_once_the_front_can_render_a_prompt(server, demo_model_dir):
    """A front that says 200 before it has its tokenizer and chat template makes the first requests a balancer
    sends wait for that load: it loads them as soon as Triton answers, and says ready only then."""
    import urllib.error
    import urllib.request

    with OpenAIServer(server.grpc_url, port=0, host="127.0.0.1", model_dir=demo_model_dir) as srv:
        served = srv._server.config.app.state.served_model

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as reply:
                    return reply.status == 200
            except urllib.error.HTTPError:
                return False

        assert wait_for(healthy, timeout_s=120)
        assert served._renderer is not None, "/health said ready before the tokenizer and chat template were loaded"
