"""The layer stack in one C++ call (csrc/cpu/layer_stack.cpp) against the per-op path it replaces.

Both run the same row functions and GEMM tasks, so the oracle is exact: the same hidden states and the
same K/V written, bit for bit, for every family the loader supports (Llama with llama3 RoPE and a tied
head, Mistral, Qwen2's qkv bias, Qwen3's q/k norms and a head_dim of its own, Mixture-of-Experts layers beside
dense ones), in fp32 and bf16, on a
batch that mixes a fresh prompt, decode rows and a chunk after a cached prefix, on one thread, on all and
on more threads than cores.
The HF-reference tests (test_engine_reference, test_bf16_reference, test_loader) run through it too,
since the runner takes it wherever it is supported.
"""

from __future__ import annotations

import pytest
import torch
from helpers.families import MOE_FAMILIES, write_family
from test_loader import CASES, make_checkpoint

from inflight.executor.attention import AttentionMetadata
from inflight.executor.attention.metadata import consecutive_batch
from inflight.executor.cpu_forward import CpuForward
from inflight.executor.model_runner import ModelRunner
from inflight.models.loader import load_model
from inflight.ops import cpu

BLOCK = 8
# (context length, query tokens) per sequence: a decode row, a fresh prompt, a chunk after a cached
# prefix, a decode row at a block boundary.
BATCH = [(37, 1), (11, 11), (29, 13), (BLOCK * 3, 1)]


def runner_for(path, dtype: torch.dtype) -> ModelRunner:
    model, _ = load_model(path, dtype, torch.device("cpu"))
    return ModelRunner(model, 64, BLOCK, 256, dtype, torch.device("cpu"), "torch")


def step_inputs(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    seq_lens, query_lens = zip(*BATCH)
    positions, meta, _ = consecutive_batch(list(seq_lens), list(query_lens), BLOCK, torch.device("cpu"))
    ids = torch.randint(0, runner.model.cfg.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(1))
    return ids, positions, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_same_bits_as_the_per_op_path(tmp_path, case, dtype):
    if not cpu.gemm_supports(dtype, 64):
        pytest.skip(f"our GEMM does not run {dtype} on this CPU: the per-op path runs")
    arch, extra = CASES[case]
    assert_same_bits(runner_for(make_checkpoint(tmp_path, arch, **extra), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
def test_gguf_layers_give_the_same_bits_as_the_per_op_path(tmp_path, qtype, dtype):
    """Every linear on GGUF blocks (QuantizedLinear): the stack calls the same GGUF task function. Q4_K: layer
    0's qkv_proj fused from parts of two block types (Q6_K v beside Q4_K q and k), one segment each."""
    gguf = pytest.importorskip("gguf")
    from test_gguf_cpu import random_blocks
    from test_gguf_loader import TINY_K, tiny_hf_model, write_gguf

    from inflight.models.quantized import GGUFWeight, QuantizedLinear

    Q = gguf.GGMLQuantizationType
    if not cpu.gguf_supports(int(Q[qtype]), dtype, 256):
        pytest.skip(f"no GGUF kernel for {dtype} on this CPU")
    hf = tiny_hf_model(**(TINY_K if qtype == "Q4_K" else {}))
    model, _ = load_model(write_gguf(tmp_path / "tiny.gguf", hf, Q[qtype]), dtype, torch.device("cpu"), "packed")
    attn = model.model.layers[0].self_attn
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * model.cfg.num_hidden_layers + 1  # every linear and the output layer
    if qtype == "Q4_K":
        h, d, kv = model.cfg.hidden_size, model.cfg.head_dim, model.cfg.num_key_value_heads
        shapes = [(Q.Q4_K, model.cfg.num_attention_heads * d), (Q.Q4_K, kv * d), (Q.Q6_K, kv * d)]
        parts = [GGUFWeight(int(q), random_blocks(q, n, h, seed=i), (n, h)) for i, (q, n) in enumerate(shapes)]
        attn.qkv_proj = QuantizedLinear.from_gguf(parts, dtype, torch.device("cpu"))
        assert len(attn.qkv_proj.segments) == 2
    assert_same_bits(ModelRunner(model, 64, BLOCK, 256, dtype, torch.device("cpu"), "torch"))


# MoE families the stack runs: Qwen3-MoE with a dense layer among its sparse ones, Mixtral (renormalised top-k)
MOE_CASES = {
    "qwen3-moe-one-dense-layer": ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1], num_hidden_layers=3)),
    "mixtral": ("MixtralForCausalLM", dict()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_layers_give_the_same_bits_as_the_per_op_path(tmp_path, case, dtype):
    """The router and the grouped expert GEMM inside the stack's region: the per-op path's row and task functions."""
    if not cpu.gemm_supports(dtype, 64):
        pytest.skip(f"our GEMM does not run {dtype} on this CPU: the per-op path runs")
    arch, extra = MOE_CASES[case]
    config_class, fields = MOE_FAMILIES[arch]
    path, _ = write_family(tmp_path, arch, config_class, fields | extra)
    runner = runner_for(path, dtype)
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in runner.model.model.layers]
    assert any(sparse) and (case != "qwen3-moe-one-dense-layer" or sparse == [True, False, True])
    assert_same_bits(runner)


@pytest.mark.parametrize("arch", ["OlmoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_a_shared_expert_or_a_whole_projection_norm_runs_op_by_op(tmp_path, arch):
    """Qwen2-MoE's gated shared expert and OLMoE's q/k norm over the whole projection have no place in the stack."""
    if not cpu.gemm_supports(torch.float32, 64):
        pytest.skip("our GEMM does not run fp32 on this CPU")
    config_class, fields = MOE_FAMILIES[arch]
    path, _ = write_family(tmp_path, arch, config_class, fields)
    assert runner_for(path, torch.float32).cpu_forward is None


def assert_same_bits(runner: ModelRunner) -> None:
    assert runner.cpu_forward is not None
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:  # the cached prefixes: anything but zeros
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [c.clone() for pair in runner.kv_caches for c in pair]
    ids, positions, _ = step_inputs(runner)
    with torch.inference_mode():
        ref = runner.model(ids, positions, step_inputs(runner)[2], runner.kv_caches, runner.ops)
    ref_caches = [c.clone() for pair in runner.kv_caches for c in pair]
    threads = torch.get_num_threads()
    try:
        # 2 * threads + 1: more threads than cores (and an odd count): waiters at the barrier outlast their spin
        # and sleep on the futex, peers get descheduled mid-op; the bits must not change
        for n in sorted({1, threads, 2 * threads + 1}):
            torch.set_num_threads(n)
            for cache, saved in zip((c for pair in runner.kv_caches for c in pair), before):
                cache.copy_(saved)
            with torch.inference_mode():
                out = runner.cpu_forward(ids, positions, step_inputs(runner)[2])
            assert torch.equal(out, ref), f"{n} thread(s): hidden states differ"
            assert all(torch.equal(a, b) for a, b in zip((c for p in runner.kv_caches for c in p), ref_caches))
    finally:
        torch.set_num_threads(threads)


def test_bad_step_inputs_are_refused_before_any_thread_starts(demo_model_dir):
    if not cpu.gemm_supports(torch.float32, 64):
        pytest.skip("our GEMM does not run fp32 on this CPU")
    runner = runner_for(demo_model_dir, torch.float32)
    assert isinstance(runner.cpu_forward, CpuForward)
    ids, positions, meta = step_inputs(runner)
    meta.block_tables[0, 0] = 10_000
    with torch.inference_mode(), pytest.raises(RuntimeError, match="block id outside the cache"):
        runner.cpu_forward(ids, positions, meta)
    ids, positions, meta = step_inputs(runner)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="position out of the RoPE table"):
        runner.cpu_forward(ids, positions + 10_000, meta)
    ids, positions, meta = step_inputs(runner)
    meta.slot_mapping[-1] = -1
    with torch.inference_mode(), pytest.raises(RuntimeError, match="slot out of the cache"):
        runner.cpu_forward(ids, positions, meta)
    ids, positions, meta = step_inputs(runner)  # and the model still runs
    with torch.inference_mode():
        assert torch.isfinite(runner.cpu_forward(ids, positions, meta)).all()
