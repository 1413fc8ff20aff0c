"""Every kernel specialization the engine launches compiles for sm_80 and sm_90, on this CPU machine.

The launches are recorded from interpreter runs of the engine through the Triton backend (the demo
model and two real attention geometries); each is compiled by ptxas for both targets in a process
without the interpreter and must fit the target's shared memory per block.
"""

from __future__ import annotations

import json
import os

import pytest

from inflight.ops.triton.paged_attention import DECODE_BLOCK_M, PREFILL_BLOCK_M
from loadtest.kernel_launches import GEOMETRIES, capture_all
from loadtest.kernel_resources import SHARED_LIMIT, TARGETS, run_in_subprocess

KERNELS = {"_unified_attention_kernel", "_merge_kernel", "_kv_write_kernel", "_rms_norm_kernel", "_rope_kernel"}
# On a GPU machine the kernel tests run every kernel for real; this check is for machines without one.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records launches under TRITON_INTERPRET=1 (no GPU here)"
)
RUNS = {"demo/fp32", "demo/fp16", "demo/bf16"} | {f"{g}/{d}" for g in GEOMETRIES for d in ("fp16", "bf16")}


@pytest.fixture(scope="module")
def captured(tmp_path_factory, demo_model_dir):
    return capture_all(tmp_path_factory.mktemp("capture"), demo_model_dir)


def constexprs(spec) -> dict:
    return {name: value for name, kind, value in spec.params if kind == "constexpr"}


def test_recorder_covers_every_launched_kernel():
    """A kernel added to `inflight.ops.triton` must be added to the recorder (and so to the compile check)."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import inflight.ops.triton
    from loadtest.kernel_launches import KERNELS as RECORDED

    found = set()
    for info in pkgutil.iter_modules(inflight.ops.triton.__path__):
        module = importlib.import_module(f"inflight.ops.triton.{info.name}")
        found |= {
            f"{module.__name__}:{name}"
            for name, obj in vars(module).items()
            if isinstance(obj, InterpretedFunction) and name.endswith("_kernel")
        }
    assert found == {f"{m}:{k}" for m, names in RECORDED.items() for k in names}


def test_capture_sees_every_kernel_path(captured):
    specs, _ = captured
    assert {s.kernel.split(":")[1] for s in specs} == KERNELS
    assert {t for s in specs for t in s.tags} == RUNS
    for run in RUNS:
        attention = [constexprs(s) for s in specs if run in s.tags and s.kernel.endswith("_unified_attention_kernel")]
        # prefill tiles, decode tiles, split-K decode tiles: one binary each, whatever the batch
        # (no specialization on a value that changes from step to step, e.g. the block-table width)
        kinds = sorted((c["BLOCK_Q"] * c["GROUP_PAD"], c["SPLIT"]) for c in attention)
        assert kinds == [(DECODE_BLOCK_M, False), (DECODE_BLOCK_M, True), (PREFILL_BLOCK_M, False)], (run, attention)


def test_every_launched_specialization_compiles_for_sm80_and_sm90(captured, tmp_path):
    from loadtest.kernel_launches import dump

    specs, _ = captured
    dump(specs, tmp_path / "specs.json")
    done = run_in_subprocess(["--specs", str(tmp_path / "specs.json"), "--json", str(tmp_path / "out.json")], False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    rows = json.loads((tmp_path / "out.json").read_text())
    assert len(rows) == len(specs) * len(TARGETS)
    for row in rows:
        assert row["ok"] and 0 <= row["shared_bytes"] <= SHARED_LIMIT[row["arch"]], row
        assert 0 < row["registers"] <= 255, row


def test_mixed_steps_give_decode_queries_decode_tiles(captured):
    _, logs = captured
    for run, log in logs.items():
        mixed = 0
        for launch in log.attention_rows:
            if launch["block_m"] == PREFILL_BLOCK_M:  # a prefill-sized tile holds no decode query
                assert launch["decode_tiles"] == 0, (run, launch)
            mixed += launch["decode_seqs"] > 0 and launch["prefill_seqs"] > 0
        assert mixed, f"{run}: no step mixed a prefill chunk with decode"
