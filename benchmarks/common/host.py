"""The host a figure was measured on, in one line: CPU model, family/model, cores, and the vector features that
decide which kernels run (AVX-512, its BF16, AMX)."""

from __future__ import annotations

import os
from pathlib import Path


def describe_host() -> str:
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return f"{os.cpu_count()} CPUs"
    flags = set(fields.get("flags", "").split())
    vector = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or (["avx2"] if "avx2" in flags else [])
    family = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{fields.get('model name', 'CPU')} ({family}), {os.cpu_count()} CPUs, {' '.join(vector) or 'no AVX2'}"
