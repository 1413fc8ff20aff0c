"""The exact requests of Triton's OpenAI-compatible frontend (vLLM-backend path): native JSON types, every
default spelled out, logprobs and token counts asked for. Checked against the offline engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import PROMPTS

from inflight import SamplingParams


def openai_frontend_tensors(prompt: str, sampling: dict, logprobs: bool) -> dict:
    """What the frontend's `_create_vllm_generate_request` builds for /v1/completions with stream=true."""
    return {
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "stream": np.array([True]),
        "exclude_input_in_output": np.array([True]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
        "return_logprobs": np.array([logprobs]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    }


@pytest.mark.parametrize(
    ("stop", "logprobs"),
    [("\n\n", 2), (["zzz", "qqq"], None), ([], 1)],
)
def test_openai_frontend_completion_payload(client, offline_llm, stop, logprobs):
    prompt = PROMPTS[1]
    sampling = {
        "frequency_penalty": 0.0,
        "n": 1,
        "presence_penalty": 0.0,
        "stop": stop,
        "temperature": 0.0,
        "top_p": 1.0,
        "ignore_eos": False,
        "max_tokens": 12,
    }
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    stream = client.stream_tensors(openai_frontend_tensors(prompt, sampling, logprobs is not None))
    deltas = list(stream)
    done = stream.completion

    expected = offline_llm.generate([prompt], SamplingParams(**{k: v for k, v in sampling.items()}))[0]
    assert done.text == expected.text
    assert all(d.text for d in deltas)  # no empty intermediate responses
    counts = [int(d.outputs["num_output_tokens"][0]) for d in done.deltas]
    assert sum(counts) == len(expected.token_ids)  # the frontend sums per-response counts
    assert {int(d.outputs["num_input_tokens"][0]) for d in done.deltas} == {len(expected.prompt_token_ids)}
    if logprobs is not None:
        entries = [e for d in done.deltas for e in json.loads(d.outputs["logprobs"][0])]
        assert len(entries) == len(expected.token_ids)
        assert all(len(e) >= 1 for e in entries)


def test_openai_frontend_rejects_n_above_one_clearly(client):
    from inflight_client import InferenceError

    sampling = {"n": 2, "max_tokens": 4, "temperature": 0.0, "top_p": 1.0}
    with pytest.raises(InferenceError, match="n=2 is invalid: must be 1"):
        client.stream_tensors(openai_frontend_tensors(PROMPTS[0], sampling, False)).collect()
