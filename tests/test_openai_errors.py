"""How a request's error travels from the model to a Triton client: its kind and field as the message's tag,
read back as values (never guessed from the message's words)."""

from __future__ import annotations

import pytest

from inflight.errors import ErrorKind, InvalidRequestError, read_tagged, tag_message
from inflight.sampling_params import SamplingParams
from inflight.serving.openai.triton_stream import ModelError, TritonUnavailable, classify_error


@pytest.mark.parametrize(
    ("kind", "field"),
    [(ErrorKind.INVALID, "top_p"), (ErrorKind.LIMIT, "max_tokens"), (ErrorKind.INTERNAL, None)],
)
def test_the_tag_carries_kind_and_field_through_tritons_request_id_prefix(kind, field):
    message = "top_p=2.0 is invalid: must be in (0, 1] [not a tag]"
    tagged = read_tagged(f"[request id: 7] {tag_message(kind, field, message)}")
    assert tagged is not None and (tagged.kind, tagged.field, tagged.message) == (kind, field, message)


def test_user_errors_keep_their_kind_and_field():
    error = classify_error(tag_message(ErrorKind.LIMIT, "max_tokens", "max_tokens=900 is too large"))
    assert isinstance(error, ModelError)
    assert (error.kind, error.field, error.message) == (ErrorKind.LIMIT, "max_tokens", "max_tokens=900 is too large")


@pytest.mark.parametrize(
    "message",
    [
        # Triton's own (untagged): the model is not loaded, not ready, or its stub process died.
        "Failed to process the request(s) for model 'llm_0_0', message: Stub process 'llm_0_0' is not healthy.",
        "Request for unknown model: 'llm' is not found",
        tag_message(ErrorKind.UNAVAILABLE, None, "the model is shutting down"),
    ],
)
def test_a_dead_or_stopping_model_is_unavailable_not_a_500(message):
    assert isinstance(classify_error(message), TritonUnavailable)


def test_an_engine_failure_is_internal_whatever_its_words():
    # Words that once meant "a field" or "unavailable" decide nothing: the tag does.
    error = classify_error(tag_message(ErrorKind.INTERNAL, None, "top_p=1 unavailable: RuntimeError('x')"))
    assert isinstance(error, ModelError) and (error.kind, error.field) == (ErrorKind.INTERNAL, None)


def test_a_bracketed_message_without_a_known_kind_is_not_a_tag():
    assert read_tagged("[warning] something") is None and read_tagged("[invalid without the space") is None


@pytest.mark.parametrize(
    ("params", "field", "kind"),
    [
        ({"top_p": 1.5}, "top_p", ErrorKind.INVALID),
        ({"structured_outputs": {"regex": 3}}, "structured_outputs", ErrorKind.INVALID),
        ({"structured_outputs": {"json": 1, "regex": "a"}}, "structured_outputs", ErrorKind.INVALID),
        ({"temprature": 0.5}, "temprature", ErrorKind.INVALID),
    ],
)
def test_sampling_parameters_name_the_field_they_refuse(params, field, kind):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(params)
    assert (info.value.field, info.value.kind) == (field, kind)


def test_a_sampling_parameters_text_over_its_bound_is_a_limit():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_json('{"stop": ["' + "x" * 100 + '"]}', max_bytes=64)
    assert (info.value.field, info.value.kind) == ("sampling_parameters", ErrorKind.LIMIT)
