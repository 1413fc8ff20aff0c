"""dtype="auto" on a CPU follows what runs faster here, measured once per CPU and layer shape, and says so."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.config import EngineConfig
from inflight.ops import cpu, dtype_probe


@pytest.mark.parametrize(
    ("speedup", "expected"), [(1.8, torch.bfloat16), (0.85, torch.float32), (None, torch.bfloat16)]
)
def test_auto_follows_the_measured_speedup(monkeypatch, speedup, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    dtype, why = EngineConfig(device="cpu").resolve_dtype(torch.float32, lambda: speedup)
    assert dtype == expected
    if speedup is not None:
        assert f"{speedup:.2f}x fp32's speed here" in why and "avx512_bf16" in why


def test_the_probe_is_asked_only_where_bf16_is_native(monkeypatch):
    def probe():
        raise AssertionError("not asked")

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {})
    assert EngineConfig(device="cpu").resolve_dtype(torch.float32, probe)[0] == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").resolve_dtype(torch.float32, probe)[0] == torch.bfloat16


def test_the_probe_measures_once_and_caches_per_shape(monkeypatch, tmp_path):
    if not (cpu.gemm_supports(torch.float32, 64) and cpu.gemm_supports(torch.bfloat16, 64)):
        pytest.skip("our GEMM does not run both dtypes on this CPU")
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    first = dtype_probe.bf16_speedup(64, 96)
    assert first > 0
    monkeypatch.setattr(dtype_probe, "_measure", lambda k, n: pytest.fail("measured again"))
    assert dtype_probe.bf16_speedup(64, 96) == first
    cached = json.loads((tmp_path / "dtype_probe.json").read_text())
    assert list(cached.values()) == [first] and next(iter(cached)).endswith("/64x96")
