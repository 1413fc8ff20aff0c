"""Which dtype our CPU GEMM runs faster on this machine, measured once per CPU and layer shape.

AVX512-BF16 alone does not make bf16 the faster dtype: which one wins depends on the CPU's bf16 throughput
relative to its fp32 FMAs, which its flags do not say. So `dtype="auto"` asks the machine: fp32 and bf16
GEMMs of one of the model's layer shapes, at a decode-sized and a prefill-sized row count, in turns; the
ratio is cached under ~/.cache/inflight (keyed by the build, which carries the CPU's flags, and the shape),
so a server pays for it once per machine.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from inflight.ops import cpu, native

logger = logging.getLogger(__name__)

ROWS = (32, 256)  # a decode step's batch and a prefill chunk's tokens
ROUNDS = 7
MIN_SAMPLE_S = 0.002  # each timing repeats its call for at least this long: a preemption spoils one sample
MAX_OUTPUTS = 3072


def cache_path() -> Path:
    root = os.environ.get("INFLIGHT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "inflight")
    return Path(root) / "dtype_probe.json"


def bf16_speedup(in_features: int, out_features: int) -> float | None:
    """fp32 seconds ÷ bf16 seconds of our GEMM on an [in_features -> out_features] layer here (> 1: bf16 is
    faster), or None where our GEMM does not run both dtypes at this width."""
    if not (cpu.gemm_supports(torch.float32, in_features) and cpu.gemm_supports(torch.bfloat16, in_features)):
        return None
    key = f"{native.build_name()}/{in_features}x{out_features}"
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = _measure(in_features, out_features)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached, indent=1))
            tmp.replace(path)
        except OSError as e:  # a read-only home: measured again next time
            logger.warning("could not cache the dtype probe in %s (%s)", path, e)
    return cached[key]


def _measure(in_features: int, out_features: int) -> float:
    out_features = min(out_features, MAX_OUTPUTS)  # the ratio is per output panel: bound the probe's time
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.02
    packed = {dt: cpu.pack(weight.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    xs = {(dt, m): torch.randn(m, in_features, generator=gen).to(dt) for dt in packed for m in ROWS}
    best = {key: float("inf") for key in xs}
    for _ in range(ROUNDS):  # in turns, so that a busy moment hits both dtypes; the best sample of each
        for (dt, m), x in xs.items():
            calls, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < MIN_SAMPLE_S or calls == 0:
                cpu.linear(x, packed[dt], out_features, None)
                calls += 1
            best[dt, m] = min(best[dt, m], elapsed / calls)
    fp32 = sum(best[torch.float32, m] for m in ROWS)
    bf16 = sum(best[torch.bfloat16, m] for m in ROWS)
    return round(fp32 / bf16, 3)
