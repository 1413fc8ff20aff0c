"""The C++ CPU ops keep the GIL while they compute, on purpose.

csrc/cpu/bindings.cpp binds them through `torch::wrap_pybind_function`, which holds the GIL (its `_no_gil`
twin releases it). Served, the responder thread (encoding and sending the last step's responses) then runs
between forwards, not during them: releasing the GIL measured slower on the 2-core host (docs/PERFORMANCE.md),
since a responder free to run during the forward takes a core from one of the step's two threads, which then
stall each other at every barrier. A change of binding must be measured again; this test says when one happens.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from inflight.ops import cpu


def _runs_during(call) -> bool:
    """Whether another thread that wants the GIL gets it while `call()` runs on this one.

    The other thread is released just before the calls and needs the GIL for one statement. The switch
    interval is made longer than all the calls together, so this thread is never made to hand the GIL over
    between bytecodes: only a call that releases it lets the other thread in. `call` must be the bare
    native function on tensors made beforehand: torch's own functions (torch.empty, ...) release the GIL
    and would let the other thread in whatever ours do."""
    go, ran = threading.Event(), threading.Event()

    def other() -> None:
        go.wait()
        ran.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        worker = threading.Thread(target=other, daemon=True)
        worker.start()
        time.sleep(0.05)  # the worker is parked in go.wait(), which holds no GIL
        go.set()
        deadline = time.perf_counter() + 0.5
        while not ran.is_set() and time.perf_counter() < deadline:
            call()
        during = ran.is_set()
    finally:
        sys.setswitchinterval(interval)
    worker.join()
    return during


@pytest.mark.skipif(not cpu.gemm_supports(torch.float32, 64), reason="our GEMM needs AVX-512 or AVX2 and a compiler")
def test_our_gemm_keeps_the_gil():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=gen)
    packed = cpu.pack(torch.randn(1024, 1024, generator=gen))
    out = cpu.linear(x, packed, 1024, None)  # built and warm
    module = cpu.load()
    assert not _runs_during(lambda: module.linear(out, x, packed, None, 0)), "the GEMM released the GIL"
    # The probe can see a release: torch's own matmul drops the GIL, and the other thread gets in.
    weight = torch.randn(1024, 1024, generator=gen)
    assert _runs_during(lambda: torch.mm(x, weight, out=out)), "the probe did not see torch.mm release the GIL"


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler to build the ops")
def test_the_cpu_ops_keep_the_gil():
    x, weight = torch.randn(4096, 1024), torch.ones(1024)
    out, module = torch.empty_like(x), cpu.load()
    assert not _runs_during(lambda: module.rms_norm(out, x, weight, 1e-6)), "rms_norm released the GIL"
