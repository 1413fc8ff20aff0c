"""How the OpenAI front reads the model's error messages: the field a user error names, or unavailability."""

from __future__ import annotations

import pytest

from inflight.serving.openai.protocol import MODEL_FIELDS
from inflight.serving.openai.triton_stream import ModelError, TritonUnavailable, classify_error


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("[request id: 7] top_p=2.0 is invalid: must be in (0, 1]", "top_p"),
        ("structured_outputs.grammar matches nothing: no token may follow 0 output tokens", "structured_outputs"),
        ("sampling_parameters has unknown key 'temprature'; known keys: ...", "temprature"),
    ],
)
def test_user_errors_name_their_field(message, field):
    error = classify_error(message, MODEL_FIELDS | {"temprature"})
    assert isinstance(error, ModelError) and error.field == field


@pytest.mark.parametrize(
    "message",
    [
        "Failed to process the request(s) for model 'llm_0_0', message: Stub process 'llm_0_0' is not healthy.",
        "the model is shutting down",
        "Request for unknown model: 'llm' is not found",
    ],
)
def test_a_dead_or_stopping_model_is_unavailable_not_a_500(message):
    assert isinstance(classify_error(message, MODEL_FIELDS), TritonUnavailable)


def test_an_engine_failure_is_an_internal_error():
    error = classify_error("the engine failed while running this request: RuntimeError('x')", MODEL_FIELDS)
    assert isinstance(error, ModelError) and error.field is None
