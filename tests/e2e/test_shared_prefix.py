"""Prefix caching through a real tritonserver: a second client with the same long prefix is served from
the cache (num_cached_tokens > 0, the metrics count it) and streams the text it would without the cache."""

from __future__ import annotations

import json
import random

import numpy as np
from e2e_util import ENGINE_ARGS, metric, settled

from inflight import LLM, SamplingParams

WORDS = ["river", "cloud", "stone", "garden", "light", "quiet", "engine", "token", "block", "forest", "story"]


def shared_prefix(tokenizer, num_tokens: int) -> str:
    """A system prompt of about `num_tokens` tokens, unique to this test (so earlier traffic cannot hit it)."""
    rng = random.Random(1234)
    words: list[str] = ["You are a careful assistant for the prefix-cache test."]
    while len(tokenizer.encode(" ".join(words)).ids) < num_tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words) + "\n"


def stream_with_cached_count(client, prompt: str, params: dict) -> tuple[str, int]:
    tensors = {
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "stream": np.array([True]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_),
        "return_num_cached_tokens": np.array([True]),
    }
    completion = client.stream_tensors(tensors).collect()
    counts = {int(d.outputs["num_cached_tokens"][0]) for d in completion.deltas}
    assert len(counts) == 1, f"num_cached_tokens changed within one request: {counts}"
    assert len(completion.deltas) > 1, "expected a stream of several responses"
    return completion.text, counts.pop()


def test_second_client_with_a_shared_prefix_is_served_from_the_cache(client, server, demo_model_dir):
    # ~400 tokens, not 1k: the e2e server runs with max_model_len=512 to stay small on 2 CPU cores.
    no_cache = LLM(demo_model_dir, **ENGINE_ARGS, enable_prefix_caching=False)
    prefix = shared_prefix(no_cache.tokenizer, 400)
    prompts = [prefix + "Question one: what is a river?", prefix + "Question two: why do forests sing?"]
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    expected = [o.text for o in no_cache.generate(prompts, SamplingParams(**params))]
    assert all(o == 0 for o in [c.num_cached_tokens for c in no_cache.generate(prompts, SamplingParams(**params))])

    before = settled(server)
    first_text, first_cached = stream_with_cached_count(client, prompts[0], params)
    second_text, second_cached = stream_with_cached_count(client, prompts[1], params)
    after = settled(server)

    prefix_len = len(no_cache.tokenizer.encode(prefix).ids)
    block = ENGINE_ARGS["block_size"]
    assert first_cached == 0
    assert prefix_len - 2 * block < second_cached <= prefix_len  # whole blocks of the shared prefix

    for name in ("inflight_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
        assert metric(after, name) - metric(before, name) == second_cached, name
    for name in ("inflight_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"):
        assert metric(after, name) - metric(before, name) >= 2 * prefix_len, name
    assert metric(after, "inflight_kv_blocks", state="cached") > 0

    assert [first_text, second_text] == expected
