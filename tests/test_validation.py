"""The request checks the front runs before a request reaches the engine core: no torch behind them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inflight.config import EngineConfig
from inflight.engine.validation import check_fits, check_params, check_prompt_token_ids
from inflight.sampling_params import InvalidRequestError, SamplingParams


def test_the_request_checks_import_without_torch():
    code = "import sys, inflight.engine.validation; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("check", "field", "kind", "match"),
    [
        (lambda: check_prompt_token_ids([], 10), "prompt", "invalid", "prompt_token_ids is empty"),
        (lambda: check_prompt_token_ids([3, 10], 10), "prompt", "invalid", r"\[10\] outside the vocabulary \[0, 10\)"),
        (lambda: check_fits(8, 1, 8, 100), "prompt", "limit", "must be shorter than max_model_len=8"),
        (lambda: check_fits(4, 5, 8, 100), "max_tokens", "limit", "max_tokens <= 4"),
        (lambda: check_fits(4, 4, 8, 6), "max_tokens", "limit", "KV cache capacity of 6 tokens"),
        (
            lambda: check_params(EngineConfig(max_stop_strings=1), SamplingParams(stop=["a", "b"])),
            "stop",
            "limit",
            "max_stop_strings=1",
        ),
        (
            lambda: check_params(EngineConfig(max_grammar_depth=1), SamplingParams(guided_regex="((a))")),
            "structured_outputs",
            "limit",
            "nests 2 levels deep",
        ),
    ],
)
def test_each_check_names_the_field_and_the_limit(check, field, kind, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        check()
    assert (info.value.field, info.value.kind.value) == (field, kind)


def test_a_request_within_every_bound_passes():
    assert check_prompt_token_ids([0, 9], 10) == [0, 9]
    check_fits(4, 4, 8, 8)
    check_params(EngineConfig(), SamplingParams(stop=["a"], logprobs=2))
