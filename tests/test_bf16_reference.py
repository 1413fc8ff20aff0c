"""bf16 against HF: the engine in bf16 is no further from the fp32 truth than HF's own bf16 run.

A fixed tolerance for bf16 would be arbitrary: bf16 keeps 8 mantissa bits, so every layer rounds
activations by up to 2**-9 relative, and how that compounds depends on the model. The reference is
therefore HF bf16 on the same checkpoint and tokens: both runs are compared with HF fp32, and ours
may deviate at most 2x as much as HF bf16 does (a different but equally valid rounding order:
fused GEMMs, fp32 attention math, per-step RoPE tables). Greedy: wherever HF fp32's top two logits are
further apart than HF bf16's own error, our argmax is fp32's. Closer than that they are a tie at bf16
precision, which any rounding order may break either way (measured: HF bf16 and ours each missed such
positions with margins 0.003-0.61 against an error of 0.95; counting them compared coin flips).

Also here: what dtype="auto" picks (bf16 on a CPU with AMX / AVX512-BF16) and that the engine says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, capture_logits, hf_logits

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.engine.engine import bf16_probe
from inflight.models.config import ModelConfig


@pytest.fixture(scope="module")
def hf_bf16(demo_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.bfloat16).eval()


def test_bf16_logits_within_hf_bf16_error(demo_model_dir, hf_model, hf_bf16):
    llm = LLM(demo_model_dir, dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    captured = capture_logits(llm.engine)
    prompts = PROMPTS[:6]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    full = {f"{i}": llm.tokenizer.encode(p).ids + o.token_ids for i, (p, o) in enumerate(zip(prompts, outs))}
    ours_err, hf_err, checked = 0.0, 0.0, 0
    margins, ours_hits = [], []
    rid_of = {o.request_id: str(i) for i, o in enumerate(outs)}
    truth = {k: hf_logits(hf_model, ids) for k, ids in full.items()}
    hf16 = {k: hf_logits(hf_bf16, ids) for k, ids in full.items()}
    for rid, positions, logits in captured:
        k = rid_of[rid]
        ours_err = max(ours_err, (logits - truth[k][positions]).abs().max().item())
        hf_err = max(hf_err, (hf16[k][positions] - truth[k][positions]).abs().max().item())
        checked += len(positions)
        top2 = truth[k][positions].topk(2, dim=-1)
        margins.append(top2.values[:, 0] - top2.values[:, 1])
        ours_hits.append(logits.argmax(-1) == top2.indices[:, 0])
    assert checked > sum(len(o.token_ids) for o in outs)
    assert hf_err > 0  # bf16 really rounds: the bound below is not vacuous
    assert ours_err <= 2 * hf_err, f"ours {ours_err:.4f} vs HF bf16 {hf_err:.4f} from HF fp32"
    decisive = torch.cat(margins) > hf_err
    assert decisive.sum() >= checked // 2  # most positions are decided: the check below is not vacuous
    missed = (decisive & ~torch.cat(ours_hits)).sum().item()
    assert missed == 0, f"argmax differs from fp32's at {missed} of {int(decisive.sum())} decided positions"


def cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def test_auto_dtype_on_this_cpu_follows_its_flags():
    fast_bf16 = bool(cpuinfo_flags() & {"amx_bf16", "avx512_bf16"})
    dtype, why = EngineConfig(device="cpu").resolve_dtype(torch.float32)
    assert dtype == (torch.bfloat16 if fast_bf16 else torch.float32), why


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, torch.float32),
        ({"avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, torch.float32),  # bf16 would be emulated
        ({"avx512_bf16": True}, torch.bfloat16),
        ({"amx_bf16": True, "amx_tile": True}, torch.bfloat16),
    ],
)
def test_auto_dtype_rule(monkeypatch, flags, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    assert EngineConfig(device="cpu").resolve_dtype(torch.float16)[0] == expected
    assert EngineConfig(device="cpu", dtype="float32").resolve_dtype(torch.float16)[0] == torch.float32
    # On an accelerator auto keeps the checkpoint's dtype, whatever the host CPU.
    assert EngineConfig(device="cuda").resolve_dtype(torch.float16)[0] == torch.float16


def test_the_engine_logs_its_dtype_once(demo_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="inflight"):
        llm = LLM(demo_model_dir, num_kv_blocks=16)
    records = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
    config = EngineConfig()  # where the LLM above runs: the GPU if there is one
    expected, why = config.resolve_dtype(torch.float32, bf16_probe(ModelConfig.load(demo_model_dir)))  # cached
    assert llm.engine.dtype == expected
    assert records == [f"dtype {str(expected).removeprefix('torch.')} on {config.device} ({why})"]
