"""The one build of csrc/cpu gives the same bits as the build it replaced (three inline-source modules, the
GEMM's without -ffast-math), op by op and for the one-call layer stack, in fp32 and bf16.

native_bits.json holds sha256 digests of the old build's outputs (native_cases.py's inputs), keyed by what
decides the machine code: the compiler, its -march=native target and the AVX-512 / BF16 / AMX flags. A
machine with another key has no digests to compare with: the test skips there. To record a new key, run
`python tests/ops/native_cases.py` with the build you trust and add its line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from native_cases import cpu_key, digests, outputs

from inflight.ops import cpu

DIGESTS = json.loads((Path(__file__).parent / "native_bits.json").read_text())


def test_same_bits_as_the_recorded_build(tmp_path):
    key = cpu_key()
    if key not in DIGESTS:
        pytest.skip(f"no digests recorded for {key} (recorded: {', '.join(DIGESTS)})")
    if not cpu.available():
        pytest.skip("no C++ compiler to build the ops")
    got = digests(outputs(cpu, tmp_path, lambda dtype: cpu.gemm_supports(dtype, 64)))
    want = DIGESTS[key]
    assert sorted(got) == sorted(want), "the cases changed: record the digests again"
    assert [name for name in want if got[name] != want[name]] == []
