"""Multi-LoRA end to end: one real tritonserver started by the launcher with four PEFT adapters (its
multi_lora.json) and a LoRA admin key, the OpenAI front in this process, and the offline engine with the same
engine arguments as the reference. Greedy decoding on CPU is batch-invariant bit for bit, so every stream must
give the offline tokens of its adapter, whatever it was batched with.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import urllib.error
import urllib.request

import numpy as np
import pytest
from e2e_util import ENGINE_ARGS, http_generate, wait_for
from helpers import PROMPTS
from helpers.lora import make_adapter

from inflight import SamplingParams
from inflight.launcher.cli import build_parser, engine_args, serve_parameters
from inflight.launcher.server import LauncherError, TritonServer, default_model_repository, write_model_repository
from inflight.lora_request import LoRARequest
from inflight.serving.openai import OpenAIServer

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

# rank, target modules, seed: ranks 8 and 16, attention and MLP projections
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], 11),
    "mlp16": (16, ["gate_proj", "up_proj", "down_proj"], 12),
    "ko8": (8, ["k_proj", "o_proj"], 13),
    "all16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 14),
}
LATE = ("late8", 8, ["q_proj", "up_proj"], 15)  # loaded at run time over HTTP
# Two device slots for four adapters: a step's adapters are swapped in and out as the streams mix.
LORA_ARGS = dict(ENGINE_ARGS, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
API_KEY = "lora-test-key"


@pytest.fixture(scope="module")
def adapters(demo_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    made = {name: make_adapter(demo_model_dir, root / name, r, t, seed) for name, (r, t, seed) in ADAPTERS.items()}
    name, r, t, seed = LATE
    made[name] = make_adapter(demo_model_dir, root / name, r, t, seed)
    return made


@pytest.fixture(scope="module")
def lora_server(demo_model_dir, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("tritonserver") / "lora_server.log"
    srv = TritonServer(
        parameters=dict(LORA_ARGS, model=demo_model_dir),
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        log=log,
        lora_modules={name: adapters[name] for name in ADAPTERS},  # the launcher's multi_lora.json
        lora_admin_key=secrets.token_urlsafe(16),
    )
    srv.start()
    try:
        srv.wait_ready(timeout_s=240)
    except LauncherError:
        srv.stop()
        raise
    yield srv
    code = srv.stop()
    assert code == 0, f"tritonserver exited with {code}; log: {log}"


@pytest.fixture(scope="module")
def offline(demo_model_dir, adapters):
    """(prompt, adapter or None) -> the offline engine's greedy token ids and text."""
    from inflight import LLM

    llm = LLM(demo_model_dir, **LORA_ARGS)
    cache: dict[tuple[str, str | None], tuple[list[int], str]] = {}

    def run(pairs: list[tuple[str, str | None]]) -> dict[tuple[str, str | None], tuple[list[int], str]]:
        todo = [p for p in dict.fromkeys(pairs) if p not in cache]
        if todo:
            loras = [LoRARequest(a, lora_path=adapters[a]) if a else None for _, a in todo]
            outs = llm.generate([p for p, _ in todo], SamplingParams(**GREEDY), lora_request=loras)
            cache.update({pair: (out.token_ids, out.text) for pair, out in zip(todo, outs)})
        return {p: cache[p] for p in pairs}

    return run


@pytest.fixture(scope="module")
def api(lora_server, demo_model_dir):
    with OpenAIServer(lora_server.grpc_url, port=0, model_dir=demo_model_dir, api_key=API_KEY,
                      lora_admin_key=lora_server.lora_admin_key) as srv:  # fmt: skip
        yield srv


@pytest.fixture()
def oai(api):
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


class Reply:
    def __init__(self, status: int, text: str) -> None:
        self.status_code, self.text = status, text

    def json(self) -> dict:
        return json.loads(self.text)


def _http(base: str, path: str, body: dict | None = None, key: str | None = None) -> Reply:
    """A POST (with `body`) or GET to the front: its status and text, errors included."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return Reply(reply.status, reply.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


# ---- Triton's gRPC stream (tritonclient) ---------------------------------------------------------------


async def _stream(client, prompt: str, sampling: dict, request_id: str) -> tuple[list[int], str | None]:
    """One streamed request: (its output token ids, the error message if it failed)."""
    import tritonclient.grpc as grpcclient

    def tensor(name, array):
        t = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == np.object_ else "BOOL")
        t.set_data_from_numpy(array)
        return t

    inputs = [
        tensor("text_input", np.array([prompt.encode()], dtype=np.object_)),
        tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_)),
        tensor("stream", np.array([True])),
        tensor("exclude_input_in_output", np.array([True])),
        tensor("return_token_ids", np.array([True])),
    ]

    async def requests():
        yield {"model_name": "llm", "inputs": inputs, "request_id": request_id}

    tokens: list[int] = []
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            return tokens, error.message()
        ids = result.as_numpy("token_ids")
        tokens += ids.tolist() if ids is not None else []
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    return tokens, None


def _run_streams(url: str, jobs: list[tuple[str, dict]]) -> list[tuple[list[int], str | None]]:
    import tritonclient.grpc.aio as grpcaio

    async def main():
        client = grpcaio.InferenceServerClient(url)
        try:
            return await asyncio.gather(*(_stream(client, p, s, f"lora-{i}") for i, (p, s) in enumerate(jobs)))
        finally:
            await client.close()

    return asyncio.run(main())


def test_32_streams_over_four_adapters_and_base_match_the_offline_engine(lora_server, offline):
    names = [*ADAPTERS, None]
    pairs = [(PROMPTS[i % 8], names[i % len(names)]) for i in range(32)]
    jobs = [(p, GREEDY | ({"lora_name": a} if a else {})) for p, a in pairs]
    results = _run_streams(lora_server.grpc_url, jobs)
    expected = offline(pairs)
    for (prompt, adapter), (tokens, error) in zip(pairs, results):
        assert error is None, (adapter, error)
        assert tokens == expected[(prompt, adapter)][0], (prompt, adapter)
    # The adapters must matter, or the equality above would hold with LoRA ignored.
    expected = offline(pairs + [(p, None) for p, _ in pairs])
    for adapter in ADAPTERS:
        differs = [expected[(p, adapter)][0] != expected[(p, None)][0] for p, a in pairs if a == adapter]
        assert any(differs), adapter


def test_unknown_lora_name_is_invalid_arg_naming_the_known_ones(lora_server):
    [(tokens, error)] = _run_streams(lora_server.grpc_url, [(PROMPTS[0], GREEDY | {"lora_name": "nope"})])
    assert tokens == [] and error is not None
    assert "[invalid lora_name]" in error and "'nope'" in error, error
    assert all(repr(name) in error for name in ADAPTERS), error
    # Triton's HTTP generate carries the code: INVALID_ARG -> 400.
    body = {"text_input": PROMPTS[0], "sampling_parameters": json.dumps({"max_tokens": 2, "lora_name": "nope"})}
    status, reply = http_generate(lora_server, body)
    assert status == 400 and "lora_name" in reply["error"], reply


# ---- the OpenAI API ----------------------------------------------------------------------------------


def test_openai_model_selects_the_adapter(oai, offline):
    prompt = PROMPTS[2]
    expected = offline([(prompt, "mlp16"), (prompt, None)])
    assert expected[(prompt, "mlp16")][1] != expected[(prompt, None)][1]
    kwargs = dict(prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    done = oai.completions.create(model="mlp16", **kwargs)
    assert done.model == "mlp16"
    assert done.choices[0].text == expected[(prompt, "mlp16")][1]
    assert oai.completions.create(model="llm", **kwargs).choices[0].text == expected[(prompt, None)][1]
    chunks = oai.completions.create(model="mlp16", stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[(prompt, "mlp16")][1]


def test_openai_models_lists_the_adapters_with_their_parent(oai, adapters):
    cards = {m.id: m.model_dump() for m in oai.models.list().data}
    assert list(cards) == ["llm", *sorted(ADAPTERS)]
    assert cards["llm"]["parent"] is None
    for name in ADAPTERS:
        assert cards[name]["parent"] == "llm" and cards[name]["object"] == "model", cards[name]


def test_openai_unknown_model_is_404_naming_what_exists(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=2)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert "'nope'" in error["message"] and "'qv8'" in error["message"] and "'llm'" in error["message"], error
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_load_use_and_unload_an_adapter_at_run_time(api, oai, adapters, offline, lora_server):
    late, path = LATE[0], adapters[LATE[0]]
    body = {"lora_name": late, "lora_path": path}

    refused = _http(api.url, "/v1/load_lora_adapter", body)
    assert refused.status_code == 401, refused.text
    missing = {"lora_name": "broken", "lora_path": str(path) + "-missing"}
    bad = _http(api.url, "/v1/load_lora_adapter", missing, key=API_KEY)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text

    loaded = _http(api.url, "/v1/load_lora_adapter", body, key=API_KEY)
    assert loaded.status_code == 200 and loaded.text == f"Success: LoRA adapter '{late}' added successfully."
    again = _http(api.url, "/v1/load_lora_adapter", body, key=API_KEY)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"], again.text

    prompt = PROMPTS[4]
    expected = offline([(prompt, late), (prompt, None)])
    assert expected[(prompt, late)][0] != expected[(prompt, None)][0]
    done = oai.completions.create(model=late, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert done.choices[0].text == expected[(prompt, late)][1]
    cards = {m.id: m.model_dump() for m in oai.models.list().data}
    assert cards[late]["parent"] == "llm" and cards[late]["root"] == path, cards[late]

    assert _http(api.url, "/v1/unload_lora_adapter", {"lora_name": late}).status_code == 401
    # A request still running with it keeps it: 409 until that request has finished.
    stream = oai.completions.create(model=late, prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    busy = _http(api.url, "/v1/unload_lora_adapter", {"lora_name": late}, key=API_KEY)
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"], busy.text
    assert busy.json()["error"]["param"] == "lora_name"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"  # it ran on, unharmed

    def unload():
        reply = _http(api.url, "/v1/unload_lora_adapter", {"lora_name": late}, key=API_KEY)
        return reply if reply.status_code != 409 else None

    unloaded = wait_for(unload, timeout_s=30)
    assert unloaded.status_code == 200 and unloaded.text == f"Success: LoRA adapter '{late}' removed successfully."
    gone = _http(api.url, "/v1/unload_lora_adapter", {"lora_name": late}, key=API_KEY)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"], gone.text

    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model=late, prompt=prompt, max_tokens=2)
    assert late not in {m.id for m in oai.models.list().data}
    [(_, error)] = _run_streams(lora_server.grpc_url, [(prompt, GREEDY | {"lora_name": late})])
    assert error is not None and "[invalid lora_name]" in error, error


def test_load_endpoints_are_off_without_the_admin_key(lora_server, demo_model_dir, monkeypatch):
    monkeypatch.delenv("INFLIGHT_LORA_ADMIN_KEY", raising=False)
    with OpenAIServer(lora_server.grpc_url, port=0, model_dir=demo_model_dir) as srv:
        reply = _http(srv.url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
        assert reply.status_code == 404, reply.text
        assert "--allow-runtime-lora-updating" in reply.json()["error"]["message"]
        # Listing needs no key: the adapters are still served.
        models = _http(srv.url, "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["llm", *sorted(ADAPTERS)]


# ---- the launcher ------------------------------------------------------------------------------------


def test_serve_lora_modules_write_multi_lora_json(tmp_path, monkeypatch):
    (tmp_path / "adapters" / "a").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "adapters")  # a relative path is taken from here
    ns = build_parser().parse_args(["serve", "--lora-modules", "a=a", '{"name": "b", "path": "../b"}',
                                    "--max-loras", "2"])  # fmt: skip
    assert engine_args(ns)["lora_modules"] == {"a": "a", "b": "../b"}
    parameters, modules = serve_parameters(ns)
    assert parameters["enable_lora"] is True and parameters["max_loras"] == 2 and "lora_modules" not in parameters
    repo = write_model_repository(default_model_repository(), tmp_path / "repo", parameters, lora_modules=modules)
    written = json.loads((repo / "llm" / "1" / "multi_lora.json").read_text())
    assert written == {"a": str(tmp_path / "adapters" / "a"), "b": str(tmp_path / "b")}
    assert 'key: "enable_lora"\n  value {\n    string_value: "True"' in (repo / "llm" / "config.pbtxt").read_text()

    with pytest.raises(LauncherError, match="'c'.*not a directory"):
        write_model_repository(default_model_repository(), tmp_path / "repo2", {}, lora_modules={"c": "missing"})
    with pytest.raises(SystemExit, match="--no-enable-lora"):
        serve_parameters(build_parser().parse_args(["serve", "--lora-modules", "a=a", "--no-enable-lora"]))
