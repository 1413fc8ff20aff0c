"""The soak harness itself works: 90 s of its mix on SmolLM2 with one engine core kill, then every quantity
was sampled and no request hung. It runs `python -m loadtest.soak` as a subprocess (Locust's gevent patching
must not reach pytest). Its wall time (server start, 90 s of traffic, two pauses, teardown: ~4 min) is over the
budget of `make test` on 2 cores, so it runs only with INFLIGHT_SOAK_SMOKE=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("INFLIGHT_SOAK_SMOKE") != "1", reason="minutes of wall time: set INFLIGHT_SOAK_SMOKE=1"
)


@pytest.mark.timeout(1200)
def test_soak_samples_everything_and_no_request_hangs(tmp_path):
    # The kill comes early, before the one pause (whose drain may run long on a busy box and would put it off);
    # no snapshot of the checkout: it would build the C++ ops once more, in a directory of its own.
    args = ["--minutes", "1.5", "--baseline-s", "50", "--pause-s", "5", "--kill-offset-s", "15",
            "--front-restart-s", "-1", "--no-unread-stream", "--no-snapshot", "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "loadtest.soak", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)  # fmt: skip
    log = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode in (0, 1), log  # 1: a target missed, which a 90 s run may (RSS settles later)
    summary = json.loads((tmp_path / "summary.json").read_text())
    targets = {t["name"]: t for t in summary["targets"]}
    assert targets["every quantity sampled"]["pass"], log
    assert targets["0 requests hung"]["pass"], log
    assert summary["requests"]["hung"] == 0 and summary["requests"]["total"] > 0
    kills = [f for f in summary["faults"] if f["kind"] == "core_kill"]
    assert len(kills) == 1 and kills[0]["recovered"] is not None, log
    assert (tmp_path / "soak.png").stat().st_size > 0
