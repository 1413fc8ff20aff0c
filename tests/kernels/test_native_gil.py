"""The C++ CPU ops let other Python threads run while they compute.

Served, the engine thread runs the forward while the responder thread encodes and sends the last step's
responses; a native call that kept the GIL would make the two take turns. `load_inline` binds each function
through `torch::wrap_pybind_function`, which releases the GIL: this keeps it so if the bindings change.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from inflight.models import cpu_gemm


def _python_progress_during(call) -> int:
    """How many iterations a pure-Python loop on another thread makes between just before and just after
    `call()` on this one. The interpreter's switch interval is made long, so that this thread is not made to
    hand the GIL over at some bytecode around the call: only the call itself can let the other thread run."""
    count = 0
    stop = threading.Event()
    running = threading.Event()

    def spin() -> None:
        nonlocal count
        running.set()
        while not stop.is_set():
            count += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        worker = threading.Thread(target=spin, daemon=True)
        worker.start()
        running.wait()
        before = count
        call()
        after = count
        stop.set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return after - before


@pytest.mark.skipif(not cpu_gemm.supports(torch.float32, 64), reason="our GEMM needs AVX-512 and a compiler")
def test_a_native_call_lets_other_python_threads_run():
    # One thread for the op, so that the spinning thread has a core of its own on a 2-core machine.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 2048, generator=gen)
    packed = cpu_gemm.pack(torch.randn(2048, 2048, generator=gen))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu_gemm.linear(x, packed, 2048, None)  # warm
        # Best of five: an op that keeps the GIL gives 0 every time; one that drops it gave millions in 18 of
        # 20 tries and 0 in 2 (the other thread not getting the GIL back in time, not a held GIL).
        progress = max(_python_progress_during(lambda: cpu_gemm.linear(x, packed, 2048, None)) for _ in range(5))
    finally:
        torch.set_num_threads(threads)
    # 4 GFLOP on one thread is tens of milliseconds (well inside the switch interval): a loop that may run
    # meanwhile counts far past this; one that may not stays at 0.
    assert progress > 1000, f"the other thread advanced {progress} iterations: the op kept the GIL"
