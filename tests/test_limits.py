"""Every input that can cost memory or time is bounded by an engine argument named in the error."""

from __future__ import annotations

import json
import time

import pytest

from inflight.config import ConfigError, EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.llm import LLM
from inflight.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return LLMEngine(demo_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=256))


def _finish(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(logprobs=21), r"logprobs=21 is too large: the limit is max_logprobs=20"),
        (SamplingParams(stop=["a"] * 65), r"stop has 65 strings: the limit is max_stop_strings=64"),
        (SamplingParams(stop=["x" * 5_000_000]), r"5000000 characters: the limit is max_stop_str_len=1024"),
        (SamplingParams(stop_token_ids=list(range(100))), r"stop_token_ids has 100 ids.*max_stop_strings=64"),
    ],
)
def test_request_bounds_name_the_engine_argument(engine, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bounded", "Hello", params)
    assert not engine.has_unfinished_requests()


def test_the_largest_allowed_stop_list_is_accepted(engine):
    stops = [f"{i:04d}" + "x" * 1020 for i in range(64)]
    engine.add_request("many-stops", "Hello", SamplingParams(temperature=0, max_tokens=4, stop=stops))
    assert _finish(engine)[-1].finished


def test_a_huge_prompt_is_rejected_before_tokenizing(engine):
    prompt = "word " * 2_000_000  # 10 MB
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"prompt is 10000000 bytes: the limit is max_prompt_bytes=4096"):
        engine.add_request("huge", prompt, SamplingParams())
    assert time.perf_counter() - started < 0.5  # tokenizing 10 MB takes seconds


def test_max_prompt_bytes_can_be_set(demo_model_dir):
    eng = LLMEngine(demo_model_dir, EngineConfig(num_kv_blocks=64, max_model_len=256, max_prompt_bytes=10))
    with pytest.raises(InvalidRequestError, match="max_prompt_bytes=10"):
        eng.tokenize("Hello world, again")
    with pytest.raises(ConfigError, match="max_prompt_bytes=0 is invalid"):
        EngineConfig(max_prompt_bytes=0)


def test_sampling_parameters_json_is_bounded_in_size_and_depth():
    with pytest.raises(InvalidRequestError, match=r"the limit is max_sampling_parameters_bytes=1000"):
        SamplingParams.from_json(json.dumps({"stop": ["x" * 2000]}), max_bytes=1000)
    deep = "[" * 100_000 + "]" * 100_000  # would exhaust the parser's recursion
    with pytest.raises(InvalidRequestError, match=r"nests more than 64 levels deep: the limit is max_json_depth=64"):
        SamplingParams.from_json(json.dumps({"stop": "x", "extra": None})[:-1] + ', "deep": ' + deep + "}")
    with pytest.raises(InvalidRequestError, match="max_json_depth=8"):
        SamplingParams.from_json(json.dumps({"stop": [[[[[[[[["x"]]]]]]]]]}), max_depth=8)


def test_a_normal_json_schema_passes_the_bounds():
    schema: dict = {"type": "string"}
    for i in range(10):  # nesting ~10 objects deep, a few KB
        schema = {
            "type": "object",
            "properties": {f"field_{i}_{j}": {"type": "integer", "minimum": 0} for j in range(8)} | {"child": schema},
            "required": ["child"],
        }
    text = json.dumps({"max_tokens": 8, "structured_outputs": {"json": schema}})
    assert 2_000 < len(text) < 64_000
    params = SamplingParams.from_json(text)
    assert params.structured_outputs is not None


def test_stop_token_text_is_not_output_unless_asked(engine):
    ids = engine.tokenize("Hello world")
    engine = LLM.from_engine(engine)  # with the output processor: text
    engine.add_request("probe", ids, SamplingParams(temperature=0, max_tokens=3))
    probe = [o for o in _finish(engine) if o.request_id == "probe"]
    tokens = [t for o in probe for t in o.new_token_ids]
    stop_at = tokens[1]
    for include in (False, True):
        rid = f"stop-tok-{include}"
        params = SamplingParams(
            temperature=0, max_tokens=3, stop_token_ids=[stop_at], include_stop_str_in_output=include
        )
        engine.add_request(rid, ids, params)
        outs = [o for o in _finish(engine) if o.request_id == rid]
        text = "".join(o.new_text for o in outs)
        assert outs[-1].finish_reason == "stop"
        first = engine.tokenizer.decode(tokens[:1])
        both = engine.tokenizer.decode(tokens[:2])
        assert text == (both if include else first)
