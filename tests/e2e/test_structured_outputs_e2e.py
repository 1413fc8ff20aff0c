"""Structured outputs through a real tritonserver: a JSON schema in `sampling_parameters` streams valid
JSON; a schema the grammar engine rejects gets INVALID_ARG with the reason."""

from __future__ import annotations

import json

import pytest
from e2e_util import http_generate
from inflight_client import InferenceError

from inflight import SamplingParams

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role", "address"],
}


def test_json_schema_streams_valid_json(client, offline_llm):
    for seed, sampling in enumerate(
        [
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            # The older key, with the schema as JSON text and numbers as strings (genai-perf style).
            {"guided_json": json.dumps(SCHEMA), "structured_outputs": None} | {"max_tokens": "160"},
        ]
    ):
        sampling = {k: v for k, v in sampling.items() if v is not None}
        sampling = {"temperature": 1.0, "seed": seed, "max_tokens": 160} | sampling
        with client.stream("Tell me about the user", sampling) as stream:
            deltas = list(stream)
        done = stream.completion
        assert len(deltas) > 3 and all(d.text for d in deltas)
        if done.finish_reason == "length":  # free whitespace may run a random model past max_tokens
            assert "disable_any_whitespace" not in json.dumps(sampling)
            continue
        assert done.finish_reason == "stop", done.finish_reason
        jsonschema.validate(json.loads(done.text), SCHEMA)
        # The same request offline gives the same text: the server adds nothing and drops nothing.
        offline = offline_llm.generate(["Tell me about the user"], SamplingParams.from_dict(sampling))[0]
        assert offline.text == done.text


@pytest.mark.parametrize(
    "sampling, mention",
    [
        ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}, "nonsense"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum greater than maximum"),
        ({"structured_outputs": {"regex": "(abc"}}, "parenthesis"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one constraint"),
    ],
)
def test_bad_constraint_gets_invalid_arg_with_the_reason(client, server, sampling, mention):
    with pytest.raises(InferenceError) as info:
        client.generate("Hello", sampling)
    assert mention in info.value.message and "structured_outputs" in info.value.message
    status, reply = http_generate(server, {"text_input": "Hello", "sampling_parameters": json.dumps(sampling)})
    assert status == 400, reply
    assert mention in reply["error"]
    assert client.generate("Hello world", {"temperature": 0, "max_tokens": 3}).text
