"""The prompt as token ids (`input_ids`) and the output as token ids (`token_ids`), the way Dynamo's worker
(inflight.serving.dynamo) talks to the model: the same tokens as the text prompt, greedy; the counts and the
prefix-cache hits come back; with `detokenize` false, no text; a bad prompt is INVALID_ARG naming its field."""

from __future__ import annotations

import asyncio

import pytest

from inflight.errors import ErrorKind
from inflight.serving.openai.triton_stream import ModelError, TritonLLM

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running through the quiet garden"


async def _collect(url: str, prompt, params: dict) -> tuple[str, list[int], list]:
    llm = TritonLLM(url)
    try:
        outs = [o async for o in llm.generate(prompt, params, stream=True, token_ids=True)]
    finally:
        await llm.close()
    return "".join(o.text for o in outs), [t for o in outs for t in (o.token_ids or [])], outs


def test_token_ids_in_and_out_match_the_text_path(server, offline_llm):
    ids = offline_llm.tokenizer.encode(PROMPT).ids
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text_a, out_a, outs_a = asyncio.run(_collect(server.grpc_url, PROMPT, params))
    text_b, out_b, outs_b = asyncio.run(_collect(server.grpc_url, ids, params))
    assert len(out_a) == len(out_b) == 12
    assert out_a == out_b and text_a == text_b
    assert outs_b[-1].final and outs_b[-1].num_input_tokens == len(ids)
    assert offline_llm.tokenizer.decode(out_b) == text_b
    # the second request with the same prompt finds its full blocks in the prefix cache
    assert outs_b[-1].num_cached_tokens >= 16
    # detokenize false (what the worker asks for: Dynamo makes the text): the same tokens, no text
    text_c, out_c, outs_c = asyncio.run(_collect(server.grpc_url, ids, params | {"detokenize": False}))
    assert out_c == out_b and text_c == "" and outs_c[-1].final


@pytest.mark.parametrize("ids, field", [([], "input_ids"), ([10**9], "prompt")])
def test_bad_input_ids_are_invalid_arguments(server, ids, field):
    async def run():
        llm = TritonLLM(server.grpc_url)
        try:
            return [o async for o in llm.generate(ids, {"max_tokens": 2}, stream=True, token_ids=True)]
        finally:
            await llm.close()

    with pytest.raises(ModelError) as err:
        asyncio.run(run())
    assert (err.value.kind, err.value.field) == (ErrorKind.INVALID, field), err.value.message
