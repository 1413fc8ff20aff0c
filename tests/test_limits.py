"""Every input that can cost memory or time is bounded by an engine argument named in the error."""

from __future__ import annotations

import json

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


class _NoTokenizing:
    def encode(self, *args, **kwargs):
        raise AssertionError("the prompt was tokenized before its size was checked")


def test_a_huge_prompt_is_rejected_before_tokenizing(engine, monkeypatch):
    prompt = "word " * 2_000_000  # 10 MB: tokenizing it takes seconds
    monkeypatch.setitem(engine.__dict__, "tokenizer", _NoTokenizing())
    with pytest.raises(InvalidRequestError, match=r"prompt is 10000000 bytes: the limit is max_prompt_bytes=4096"):
        engine.add_request("huge", prompt, SamplingParams())


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


@pytest.mark.parametrize(
    ("parameters", "want"),
    [
        ({"max_model_len": "256", "num_kv_blocks": "64", "block_size": "16"}, (256, 4096, 1024)),
        ({"max_model_len": "", "max_prompt_bytes": "100", "block_size": "16"}, (None, 100, None)),
    ],
)
def test_a_client_reads_the_limits_the_config_publishes(parameters, want):
    from inflight.limits import ModelLimits

    limits = ModelLimits.from_parameters(parameters)
    assert (limits.max_model_len, limits.max_prompt_bytes, limits.kv_capacity_tokens) == want


def test_a_client_resolves_the_limits_as_the_engine_does(engine, demo_model_dir):
    # One rule for each default: what a client derives from the config and the checkpoint is the engine's.
    from inflight.limits import ModelLimits

    native = engine.model_config.max_position_embeddings
    for configured in ("256", str(native * 2), ""):
        parameters = {"max_model_len": configured, "num_kv_blocks": "64", "block_size": "16"}
        limits = ModelLimits.from_parameters(parameters, native)
        config = EngineConfig(max_model_len=int(configured) if configured else None, num_kv_blocks=64)
        other = engine if configured == "256" else LLMEngine(demo_model_dir, config)
        assert (limits.max_model_len, limits.max_prompt_bytes) == (other.max_model_len, other.max_prompt_bytes)
        assert limits.kv_capacity_tokens == other.num_kv_blocks * other.config.block_size
    assert ModelLimits.from_parameters({"max_model_len": "256"}).max_tokens_after(250) == 6


def test_the_default_max_tokens_is_what_both_the_context_and_the_kv_cache_leave():
    from inflight.limits import ModelLimits

    limits = ModelLimits.from_parameters({"max_model_len": "512", "num_kv_blocks": "8", "block_size": "16"})
    assert limits.max_tokens_after(100) == 28 and limits.max_tokens_after(128) is None
