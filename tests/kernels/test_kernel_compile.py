"""Every kernel specialization the engine launches compiles for sm_80 and sm_90, on this CPU machine.

The launches are recorded from interpreter runs of the engine through the Triton backend (the demo
model and two real attention geometries) and of the GGUF, LoRA and MoE ops called directly, by
`tools.kernel_launches`; each is compiled by ptxas for both targets by `tools.kernel_resources` in a
process without the interpreter and must fit the target's shared memory per block. Both tools run as
subprocesses, as a developer runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.ops.triton.paged_attention import DECODE_BLOCK_M, PREFILL_BLOCK_M

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_unified_attention_kernel", "_merge_kernel", "_kv_write_kernel", "_rms_norm_kernel", "_rope_kernel"}
GGUF_KERNELS = {"_gguf_gemv_kernel", "_gguf_gemm_kernel", "_gguf_embedding_kernel"}
LORA_KERNELS = {"_lora_shrink_kernel", "_lora_expand_kernel"}
MOE_KERNELS = {"_fused_moe_kernel"}
GEOMETRIES = ("llama3_8b", "qwen2_hd80")  # tools.kernel_launches.GEOMETRIES
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # shared memory per block, bytes
# On a GPU machine the kernel tests run every kernel for real; this check is for machines without one.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records launches under TRITON_INTERPRET=1 (no GPU here)"
)
RUNS = {"demo/fp32", "demo/fp16", "demo/bf16"} | {f"{g}/{d}" for g in GEOMETRIES for d in ("fp16", "bf16")}
GGUF_RUNS = {"gguf/fp32", "gguf/fp16", "gguf/bf16"}  # tools.kernel_launches.capture_gguf_launches
LORA_RUNS = {"lora/fp32", "lora/fp16", "lora/bf16"}  # tools.kernel_launches.capture_lora_launches
MOE_RUNS = {"moe/fp32", "moe/fp16", "moe/bf16"}  # tools.kernel_launches.capture_moe_launches


def run_tool(args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (
        {"TRITON_INTERPRET": "1"} if interpret else {}
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", *args], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return done


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[Path, list[dict], dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("capture")
    run_tool(["tools.kernel_launches", "--capture-all", str(out)], interpret=True)
    specs = json.loads((out / "specs.json").read_text())
    return out / "specs.json", specs, json.loads((out / "attention_rows.json").read_text())


def constexprs(spec: dict) -> dict:
    return {name: value for name, kind, value in spec["params"] if kind == "constexpr"}


def test_every_jit_kernel_is_recorded(captured):
    """A kernel added to `inflight.ops.triton` must be launched by the capture (and so compile-checked)."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import inflight.ops.triton

    found = set()
    for info in pkgutil.iter_modules(inflight.ops.triton.__path__):
        module = importlib.import_module(f"inflight.ops.triton.{info.name}")
        found |= {
            f"{module.__name__}:{name}"
            for name, obj in vars(module).items()
            if isinstance(obj, InterpretedFunction) and name.endswith("_kernel")
        }
    assert found == {s["kernel"] for s in captured[1]}


def test_capture_sees_every_kernel_path(captured):
    specs = captured[1]
    assert {s["kernel"].split(":")[1] for s in specs} == KERNELS | GGUF_KERNELS | LORA_KERNELS | MOE_KERNELS
    assert {t for s in specs for t in s["tags"]} == RUNS | GGUF_RUNS | LORA_RUNS | MOE_RUNS
    for run in RUNS:
        attention = [
            constexprs(s) for s in specs if run in s["tags"] and s["kernel"].endswith("_unified_attention_kernel")
        ]
        # prefill tiles, decode tiles, split-K decode tiles: one binary each, whatever the batch
        # (no specialization on a value that changes from step to step, e.g. the block-table width or the
        # window), each with its sliding-window twin
        kinds = sorted((c["BLOCK_Q"] * c["GROUP_PAD"], c["SPLIT"], c["SLIDING"]) for c in attention)
        tiles = [(DECODE_BLOCK_M, False), (DECODE_BLOCK_M, True), (PREFILL_BLOCK_M, False)]
        assert kinds == [(*t, sliding) for t in tiles for sliding in (False, True)], (run, attention)


def test_every_gguf_format_is_captured_in_every_dtype(captured):
    """Each block format's GEMV, GEMM and embedding binary, for fp32, fp16 and bf16 activations."""
    from inflight.ops.triton.gguf_gemm import SUPPORTED_QTYPES

    seen = {
        (s["kernel"].split(":")[1], constexprs(s)["QTYPE"], tag)
        for s in captured[1]
        if s["kernel"].split(":")[1] in GGUF_KERNELS
        for tag in s["tags"]
    }
    assert seen == {(k, q, run) for k in GGUF_KERNELS for q in SUPPORTED_QTYPES for run in GGUF_RUNS}


def test_every_lora_row_tile_is_captured_in_every_dtype(captured):
    """The shrink's and the expand's decode and prefill row tiles, for fp32, fp16 and bf16 activations."""
    from inflight.ops.triton.lora import DECODE_BLOCK_M, PREFILL_BLOCK_M

    seen = {
        (s["kernel"].split(":")[1], constexprs(s)["BLOCK_M"], tag)
        for s in captured[1]
        if s["kernel"].split(":")[1] in LORA_KERNELS
        for tag in s["tags"]
    }
    tiles = (DECODE_BLOCK_M, PREFILL_BLOCK_M)
    assert seen == {(k, m, run) for k in LORA_KERNELS for m in tiles for run in LORA_RUNS}


def test_every_moe_config_is_captured_in_every_dtype(captured):
    """Both GEMMs (with and without the routing weight) of every config `get_config` can pick, per dtype."""
    from inflight.ops.triton import fused_moe

    def moe_capture_configs(dtype: str) -> list:  # every config `get_config` can pick for `dtype`
        if dtype == "float32":
            return [fused_moe.FP32_CONFIG]
        return list(dict.fromkeys([fused_moe.DEFAULT_CONFIG, *fused_moe.CONFIGS.values()]))

    def key(spec: dict) -> tuple:
        c = constexprs(spec)
        tile = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], spec["num_warps"], spec["num_stages"])
        return (*tile, c["MUL_ROUTED_WEIGHT"])

    seen = {(tag, *key(s)) for s in captured[1] if s["kernel"].split(":")[1] in MOE_KERNELS for tag in s["tags"]}
    dtypes = {"moe/fp32": "float32", "moe/fp16": "float16", "moe/bf16": "bfloat16"}
    configs = {run: moe_capture_configs(dtype) for run, dtype in dtypes.items()}
    assert len(configs["moe/fp16"]) > 1  # the default and the table's entries
    assert seen == {
        (run, c.block_m, c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages, weighted)
        for run, cs in configs.items()
        for c in cs
        for weighted in (False, True)
    }


def test_every_launched_specialization_compiles_for_sm80_and_sm90(captured, tmp_path):
    specs_path, specs, _ = captured
    run_tool(["tools.kernel_resources", "--specs", str(specs_path), "--json", str(tmp_path / "out.json")], False)
    rows = json.loads((tmp_path / "out.json").read_text())
    assert len(rows) == len(specs) * len(SHARED_LIMIT)
    for row in rows:
        assert row["ok"] and 0 <= row["shared_bytes"] <= SHARED_LIMIT[row["arch"]], row
        assert 0 < row["registers"] <= 255, row


def test_mixed_steps_give_decode_queries_decode_tiles(captured):
    for run, rows in captured[2].items():
        mixed = 0
        for launch in rows:
            if launch["block_m"] == PREFILL_BLOCK_M:  # a prefill-sized tile holds no decode query
                assert launch["decode_tiles"] == 0, (run, launch)
            mixed += launch["decode_seqs"] > 0 and launch["prefill_seqs"] > 0
        assert mixed, f"{run}: no step mixed a prefill chunk with decode"
