"""Dynamo's preprocessed request -> the model's sampling_parameters (no Dynamo install needed)."""

from __future__ import annotations

import json

import pytest

from inflight.sampling_params import SamplingParams
from inflight.serving.dynamo.request import finish_reason, router_endpoint, sampling_parameters, usage


def test_sampling_parameters_map_dynamo_fields_to_ours():
    request = {
        "token_ids": [1, 2, 3],
        "sampling_options": {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 7, "n": 1, "min_p": None},
        "stop_conditions": {
            "max_tokens": 12,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop": ["\n\n"],
            "stop_token_ids_hidden": [2, 5],
        },
        "output_options": {"logprobs": 3},
    }
    params = sampling_parameters(request)
    assert params == {
        "detokenize": False,  # Dynamo's frontend makes the text: the model sends token ids only
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 7,
        "max_tokens": 12,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2, 5],
        "logprobs": 3,
    }
    assert "stop" not in params  # Dynamo matches stop strings on the detokenized stream itself
    SamplingParams.from_json(json.dumps(params), 1 << 16, 16)  # the model accepts it


def test_default_max_tokens_fills_the_context():
    assert sampling_parameters({"token_ids": [1] * 10}, default_max_tokens=100)["max_tokens"] == 90
    assert "max_tokens" not in sampling_parameters({"token_ids": [1]})


def test_more_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="n=2"):
        sampling_parameters({"token_ids": [1], "sampling_options": {"n": 2}})


def test_finish_reasons_and_usage():
    assert finish_reason("stop") == "stop" and finish_reason("length") == "length"
    assert finish_reason("abort") == "cancelled" and finish_reason("") is None
    assert usage(10, 3, 8) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_router_endpoint_from_kv_events_config():
    on = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}
    assert router_endpoint(json.dumps(on)) == ("tcp://127.0.0.1:5557", "kv")
    assert router_endpoint({**on, "endpoint": "ipc:///run/x"}) == ("ipc:///run/x", "kv")
    assert router_endpoint({**on, "enable_kv_cache_events": False}) is None
    assert router_endpoint("") is None
