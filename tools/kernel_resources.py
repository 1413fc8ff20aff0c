"""Compile every kernel specialization the engine launches for sm_80 and sm_90, without a GPU.

The launches come from interpreter runs of the engine (`tools.kernel_launches`); each one is
compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` (ptxas and
cuobjdump ship in the triton wheel) and checked against the target's shared memory per block.
Prints, per kernel and target, registers per thread, stack bytes per thread (where ptxas puts
spilled registers: these kernels call no functions, so any stack is spills) and shared memory.

    python -m tools.kernel_resources                    # capture (interpreter) + compile + table
    python -m tools.kernel_resources --json out.json    # also write the rows
    python -m tools.kernel_resources --specs specs.json # compile launches captured elsewhere

Compiles are cached by Triton (TRITON_CACHE_DIR, default ~/.triton/cache), keyed by the kernel's
source hash, so an unchanged kernel is compiled once per machine. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

# Max dynamic shared memory per block with the opt-in attribute (CUDA programming guide, table 21).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
TARGETS = (80, 90)


@dataclass
class Compiled:
    kernel: str
    tags: list[str]
    constexprs: dict
    dtypes: str  # the pointer element types, in parameter order
    arch: int
    num_warps: int
    num_stages: int
    ok: bool
    error: str = ""
    registers: int = -1
    stack_bytes: int = -1  # per thread; these kernels make no calls, so this is spill space
    shared_bytes: int = -1  # dynamic shared memory Triton asks for at launch


def _resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out.stdout)
    if usage is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out.stdout}{out.stderr}")
    reg, stack, _static_shared, local = map(int, usage.groups())
    return {"registers": reg, "stack_bytes": stack + local}


def compile_launch(spec: dict, arch: int) -> Compiled:
    """Compiles one recorded launch (a `kernel_launches.Launch` as a dict) for sm_<arch>."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    module_name, fn_name = spec["kernel"].split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    assert isinstance(fn, triton.runtime.JITFunction), "compile without TRITON_INTERPRET"
    params = spec["params"]
    signature = {name: kind for name, kind, _ in params}
    constexprs = {name: value for name, kind, value in params if kind == "constexpr"}
    attrs = {(i,): CUDABackend.parse_attr(a) for i, (_, kind, a) in enumerate(params) if isinstance(a, str)}
    result = Compiled(
        kernel=fn_name,
        tags=spec["tags"],
        constexprs={k: v for k, v in constexprs.items() if k.isupper()},
        dtypes=",".join(kind[1:] for _, kind, _ in params if kind.startswith("*")),
        arch=arch,
        num_warps=spec["num_warps"],
        num_stages=spec["num_stages"],
        ok=False,
    )
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]},
        )
        result.shared_bytes = compiled.metadata.shared
        for k, v in _resource_usage(compiled.asm["cubin"]).items():
            setattr(result, k, v)
    except Exception as e:  # a compile error is a result to report, not a crash of the sweep
        result.error = f"{type(e).__name__}: {str(e)[:2000]}"
        return result
    if result.shared_bytes > SHARED_LIMIT[arch]:
        result.error = f"shared memory {result.shared_bytes} B > {SHARED_LIMIT[arch]} B per block on sm_{arch}"
    else:
        result.ok = True
    return result


def _compile_one(job: tuple[dict, int]) -> Compiled:
    return compile_launch(*job)


def compile_all(specs: list[dict], jobs: int = 2) -> list[Compiled]:
    work = [(spec, arch) for spec in specs for arch in TARGETS]
    if jobs <= 1:
        return [compile_launch(*w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, work))


def run_in_subprocess(args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    """Runs this module in a fresh interpreter: the interpreter flag is fixed once triton is imported."""
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default, without the 3.9 warning
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "tools.kernel_resources", *args], env=env, capture_output=True, text=True
    )


def format_table(rows: list[Compiled]) -> str:
    """One line per specialization (both targets side by side); runs with equal figures share a line."""
    lines: dict[tuple, list[str]] = {}
    by_spec: dict[tuple, dict[int, Compiled]] = {}
    for r in rows:
        spec = (r.kernel, json.dumps(r.constexprs), r.num_warps, r.num_stages, ",".join(r.tags))
        by_spec.setdefault(spec, {})[r.arch] = r
    for (kernel, ce, warps, stages, tags), per_arch in by_spec.items():
        figures = tuple(
            f"{c.registers} / {c.stack_bytes} / {c.shared_bytes}" if c.ok else "FAILED: " + c.error.splitlines()[0]
            for c in (per_arch[a] for a in TARGETS)
        )
        lines.setdefault((kernel, ce, warps, stages, figures), []).extend(tags.split(","))
    out = [
        "| kernel | constexprs | warps/stages | runs | "
        + " | ".join(f"sm_{a}: regs / spill B / shared B" for a in TARGETS)
        + " |",
        "|---|---|---|---|" + "---|" * len(TARGETS),
    ]
    for (kernel, ce, warps, stages, figures), tags in lines.items():
        constexprs = " ".join(f"{k}={v}" for k, v in json.loads(ce).items())
        out.append(
            f"| {kernel} | {constexprs} | {warps}/{stages} | {' '.join(sorted(set(tags)))} | {' | '.join(figures)} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", help="launches captured by tools.kernel_launches (JSON); default: capture now")
    parser.add_argument("--capture", metavar="OUT", help="only capture the launches into OUT (runs the interpreter)")
    parser.add_argument("--json", help="write the compiled rows here")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()

    if args.capture:
        from tools.kernel_launches import capture_all, dump

        with tempfile.TemporaryDirectory() as work:
            dump(capture_all(work)[0], args.capture)
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_resources compiles for GPUs: unset TRITON_INTERPRET")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        specs_path = args.specs
        if specs_path is None:
            specs_path = str(Path(tmp) / "specs.json")
            done = run_in_subprocess(["--capture", specs_path], interpret=True)
            if done.returncode:
                sys.exit(f"capture failed:\n{done.stderr[-4000:]}")
        specs = json.loads(Path(specs_path).read_text())
    rows = compile_all(specs, args.jobs)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    failed = [r for r in rows if not r.ok]
    print(f"{len(specs)} specializations x {len(TARGETS)} targets: {len(rows) - len(failed)} compiled, ", end="")
    print(f"{len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
