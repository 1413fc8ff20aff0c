"""Engine level: the demo model generates the same greedy tokens with the Triton kernels as with torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import inflight.executor.attention.triton_backend as attention_triton
from inflight import LLM, SamplingParams

# 5, 27, 3 and 18 tokens: the long ones exceed the 16-token step budget, so their prefill is chunked
# and the chunks share steps with other sequences' decode tokens.
PROMPTS = [
    "The model runs fast",
    "A city of light and music, a river under the mountain, and a long road home",
    "Why",
    "Engines build queues while kernels keep the cache warm",
]


def generate(model_dir: str, backend: str, **engine_args) -> list[list[int]]:
    # fp32: on a CPU the kernels run under TRITON_INTERPRET=1, whose bf16 arithmetic is garbage (and
    # dtype="auto" means bf16 on a CPU with AVX512-BF16); bf16 kernels are checked by compiling them.
    llm = LLM(
        model_dir,
        dtype="float32",
        attention_backend=backend,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_kv_blocks=48,
        max_model_len=128,
        **engine_args,
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("block_size", [16, 32])
def test_greedy_outputs_match_torch_backend(demo_model_dir, block_size, monkeypatch):
    query_lens = []  # per attention call: this step's query length of every sequence

    def spy(query, k_cache, v_cache, query_start_loc, *args):
        # A CUDA graph being captured may not read the device (decode steps only; mixed ones run eagerly).
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            query_lens.append(np.diff(query_start_loc.tolist()))
        return paged_attention(query, k_cache, v_cache, query_start_loc, *args)

    paged_attention = attention_triton.paged_attention
    monkeypatch.setattr(attention_triton, "paged_attention", spy)

    expected = generate(demo_model_dir, "torch", block_size=block_size)
    assert all(len(ids) == 5 for ids in expected) and not query_lens
    assert generate(demo_model_dir, "triton", block_size=block_size) == expected
    assert any((q > 1).any() and (q == 1).any() for q in query_lens), "no step mixed a prefill chunk with decode"


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
def test_bf16_under_the_triton_interpreter_is_refused(demo_model_dir, dtype, monkeypatch):
    """The interpreter's bf16 arithmetic is garbage: the engine says so and what to pass instead."""
    from inflight.config import ConfigError, cpu_bf16_feature

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if dtype == "auto" and (torch.cuda.is_available() or cpu_bf16_feature() is None):
        pytest.skip("dtype=auto is not bf16 here")
    # auto takes bf16 where the machine measures it faster: say it did, whatever a busy moment measured
    monkeypatch.setattr("inflight.ops.dtype_probe.bf16_speedup", lambda *shape: 2.0)
    refused = r"bfloat16 under TRITON_INTERPRET=1.*dtype='float32'.*attention_backend='torch'"
    with pytest.raises(ConfigError, match=refused):
        LLM(demo_model_dir, dtype=dtype, attention_backend="triton", device="cpu", num_kv_blocks=16)
