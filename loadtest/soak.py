"""Hours, not minutes: a soak under mixed load with faults injected.

    make soak                                   # SOAK_MINUTES=30 by default
    SOAK_MINUTES=10 make soak
    python -m loadtest.soak --minutes 2 --baseline-s 40 --pause-s 15 --out /tmp/soak

`inflight serve` starts tritonserver with the default model (SmolLM2) and the features users combine: prefix
caching, n-gram speculative decoding, structured outputs, a KV cache small enough that long prompts force
preemption. The OpenAI front runs beside it as `inflight openai` with an API key, in its own process so that
it can be restarted. Locust (headless, loadtest/soak_locustfile.py) drives a mix: gRPC streams, OpenAI chat
streams and plain calls, JSON-schema requests, long prompts, clients that cancel or disconnect mid-stream and
a trickle of hostile requests (loadtest/hostile_input.py). Faults on a schedule: the engine core SIGKILLed
every `--kill-every-s`, the OpenAI front restarted once, one stream opened and never read. The traffic pauses
after the baseline, every `--pause-every-s` and at the end, for `--pause-s` and then until the engine holds no
request, to measure the server idle. The server runs a copy of the checkout taken at the start (`--snapshot`):
edits made meanwhile never reach a restarted core.

Every `--sample-s` (and at each pause's end) one sample: RSS, open fds and threads of every process, KV blocks
in use, grammar cache bytes, /dev/shm, requests ended by outcome and reason, TTFT and inter-token p50/p99;
one progress line each. At the end: `summary.json` (targets PASS/MISS, faults with their windows, every
sample) and `soak.png` in `--out`; exit status 1 if a target is missed. `--report-only` evaluates a finished
soak's record (`run.json`, `events.jsonl`) again.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadtest import soak_report
from loadtest.soak_probe import Probe

REPO = Path(__file__).resolve().parent.parent
# Sized for 2 CPU cores. 96 blocks of 16 tokens (max_model_len's worth): a long prompt (~1100 tokens) and the
# other streams do not fit together, so running sequences get preempted. max_num_seqs stays at speculation's
# batch bound (disable_by_batch_size).
ENGINE_ARGS: dict[str, Any] = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "num_kv_blocks": 96,
    "max_model_len": 1536,
    "enable_prefix_caching": True,
    "speculative_config": json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    ),
    "max_grammar_cache_bytes": 2 << 20,  # small, so that distinct schemas make the cache evict
}
LOCUST_USERS = 9  # soak_locustfile.py's users, their fixed_count summed
RESUME_S = 15.0  # a fault put off by a pause waits this long after the traffic resumes
# The never-read stream: with 20 logprobs a token, ~750 KB of SSE, far more than the client's receive buffer and
# uvicorn's write buffer (the kernel's send buffer may take it: up to tcp_wmem's maximum).
UNREAD_MAX_TOKENS = 400


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--minutes",
        type=float,
        default=float(os.environ.get("SOAK_MINUTES") or 30),
        help="traffic time (default: $SOAK_MINUTES, else 30)",
    )
    p.add_argument("--baseline-s", type=float, default=300.0, help="the first stretch, the reference for growth")
    p.add_argument("--pause-s", type=float, default=20.0, help="length of each traffic pause")
    p.add_argument("--pause-every-s", type=float, default=600.0, help="pauses after the baseline's, this far apart")
    p.add_argument("--kill-every-s", type=float, default=300.0, help="engine core SIGKILLs this far apart")
    p.add_argument("--kill-offset-s", type=float, default=150.0, help="the first kill (between two pauses)")
    p.add_argument(
        "--front-restart-s",
        type=float,
        default=None,
        help="when to restart the OpenAI front (default: mid-run between a pause and a kill; <0: never)",
    )
    p.add_argument("--no-unread-stream", action="store_true", help="skip the stream opened and never read")
    p.add_argument(
        "--snapshot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve a copy of the checkout taken at the start (default), not the live tree",
    )
    p.add_argument(
        "--drain-s",
        type=float,
        default=120.0,
        help="a pause waits at most this much longer for the engine to hold no request before its probe",
    )
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--report-only", action="store_true", help="evaluate --out's recorded soak (run.json) again")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (the default model)")
    p.add_argument("--long-prompt-words", type=int, default=900)
    p.add_argument("--recover-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    args = p.parse_args(argv)
    if args.minutes * 60 <= args.baseline_s:
        p.error("--minutes must leave traffic after --baseline-s")
    return args


# ---- the schedule ------------------------------------------------------------------------------------------


def schedule(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds from the traffic's start: pauses [(start, end)], core kills, the front's restart."""
    duration = args.minutes * 60
    pauses, at = [], args.baseline_s
    while at + args.pause_s < duration:
        pauses.append((at, at + args.pause_s))
        at += args.pause_every_s
    pauses.append((duration, duration + args.pause_s))  # the last: the traffic stops, the server drains

    def clear(t: float) -> bool:  # a fault at least a pause's length away from every pause
        return all(not (a - args.pause_s <= t <= b + args.pause_s) for a, b in pauses)

    kills = [t for t in _range(args.kill_offset_s, duration - args.pause_s, args.kill_every_s) if clear(t)]
    restart = args.front_restart_s
    if restart is None:  # halfway between the pause at or after the middle and the next kill
        middle = next((b for a, b in pauses if a >= duration / 2 and b < duration), duration / 2)
        later = [k for k in kills if k > middle]
        restart = (middle + later[0]) / 2 if later else middle + 30
        restart = restart if restart < duration - args.pause_s and clear(restart) else -1
    return {
        "duration_s": duration,
        "baseline_s": args.baseline_s,
        "pauses": pauses,
        "core_kills": kills,
        "front_restart": restart if restart is not None and restart >= 0 else None,
    }


def _range(start: float, stop: float, step: float) -> list[float]:
    out = []
    while step > 0 and start < stop:
        out.append(start)
        start += step
    return out


# ---- the processes -----------------------------------------------------------------------------------------


def snapshot(out: Path) -> Path:
    """A copy of the checkout (tracked and untracked files, not ignored ones) in out/tree: the server, the front
    and Locust run from it, so that edits to the checkout during a long soak never reach a restarted core."""
    tree = out / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split(b"\0")):
        src, dst = REPO / os.fsdecode(name), tree / os.fsdecode(name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():  # a tracked file deleted in the checkout is skipped
            shutil.copy2(src, dst)
    # The backend stub ignores PYTHONPATH and finds the installed (editable) package: put the copy first. The
    # engine core, a spawn child of the stub, inherits the stub's sys.path.
    model = tree / "model_repository" / "llm" / "1" / "model.py"
    paths = [str(tree / "src"), str(tree / "client")]
    model.write_text(f"import sys  # the soak's snapshot first\n\nsys.path[:0] = {paths!r}\n\n" + model.read_text())
    return tree


def _get(url: str, timeout: float = 3.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class Stack:
    """`inflight serve` (tritonserver, the stub, the engine core; its own OpenAI port off) and `inflight openai`
    with an API key, each in its own session, logs in `out`."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        from inflight.launcher.server import free_ports

        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        self.api_key = secrets.token_urlsafe(16)
        self.out = out
        self.model = args.model
        self.server: subprocess.Popen | None = None
        self.front: subprocess.Popen | None = None
        self.root = snapshot(out) if args.snapshot else REPO
        paths = [str(self.root / "src"), str(self.root / "client"), str(self.root)] if args.snapshot else [str(REPO)]
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")])))
        if args.snapshot:
            # The copy's C++ sources live at another path, which torch's build files record: built in a directory
            # of the soak's own (once per --out), they never make the checkout's build start over.
            extensions = out / "torch_extensions"
            for lock in extensions.glob("**/lock"):  # left by a core killed while it built: nobody builds now
                lock.unlink()
            self.env["TORCH_EXTENSIONS_DIR"] = str(extensions)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc}"

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        with open(self.out / log, "ab") as f:
            return subprocess.Popen(
                [sys.executable, "-m", "inflight.launcher.cli", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env=self.env,
                start_new_session=True,
            )

    def start(self, timeout_s: float = 900.0) -> None:
        cmd = ["serve", "--http-port", str(self.http), "--grpc-port", str(self.grpc),
               "--metrics-port", str(self.metrics), "--openai-port", "0"]  # fmt: skip
        if self.model:
            cmd += ["--model", self.model]
        for key, value in ENGINE_ARGS.items():
            flag = "--" + key.replace("_", "-")
            cmd += [flag] if value is True else [flag, str(value)]
        self.server = self._spawn(cmd, "server.log")
        deadline = time.monotonic() + timeout_s
        while _get(f"{self.http_url}/v2/models/llm/ready") != 200 or _get(self.metrics_url) != 200:
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up; see {self.out / 'server.log'}")
            time.sleep(0.5)
        self.start_front()
        healthy = time.time()
        if self.chat_served(healthy + 600) is None:
            raise SystemExit(f"the OpenAI front never served a chat request; see {self.out / 'openai.log'}")
        print(f"OpenAI front: /health 200, first chat served {time.time() - healthy:.1f} s later", flush=True)

    def start_front(self, timeout_s: float = 120.0) -> None:
        args = ["openai", "--triton-url", self.grpc_url, "--port", str(self.openai), "--host", "127.0.0.1",
                "--api-key", self.api_key]  # fmt: skip
        self.front = self._spawn(args, "openai.log")
        deadline = time.monotonic() + timeout_s
        while _get(f"{self.openai_url}/health") != 200:
            if self.front.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI front did not come up; see {self.out / 'openai.log'}")
            time.sleep(0.1)

    def chat_served(self, deadline: float, stop: threading.Event | None = None) -> float | None:
        """When a chat completion through the OpenAI front was first served (its /health says yes before it can
        answer: it loads the tokenizer and chat template on the first request); None by the deadline."""
        body = json.dumps({"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"}
        while time.time() < deadline and not (stop is not None and stop.is_set()):
            request = urllib.request.Request(f"{self.openai_url}/v1/chat/completions", body, headers)
            try:
                with urllib.request.urlopen(request, timeout=60) as reply:
                    if reply.status == 200:
                        return time.time()
            except OSError:  # HTTPError included: 503 while the engine is not back
                pass
            time.sleep(0.2)
        return None

    def stop_front(self, timeout_s: float = 20.0) -> None:
        if self.front is None or self.front.poll() is not None:
            return
        self.front.send_signal(signal.SIGTERM)
        try:
            self.front.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.front.pid, signal.SIGKILL)
            self.front.wait()

    def front_pid(self) -> int | None:
        return self.front.pid if self.front is not None and self.front.poll() is None else None

    def stop(self) -> int | None:
        self.stop_front()
        if self.server is None:
            return None
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGINT)
        try:
            return self.server.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.server.pid, signal.SIGKILL)
            return self.server.wait()


def end_orphan_builds(extensions: Path) -> None:
    """Compilers a core started for the C++ ops outlive it (ninja puts them in a group of their own): a server
    stopped mid-build leaves them running. Those building in the soak's own directory are ours to end."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if Path(proc.cwd()).is_relative_to(extensions):
                proc.kill()
        except (psutil.Error, OSError):
            continue


# ---- the faults --------------------------------------------------------------------------------------------


class UnreadStream:
    """One OpenAI chat stream whose client never reads a byte (a tiny receive buffer: the server's writes back
    up at once)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.sock: socket.socket | None = None

    def open(self) -> None:
        body = json.dumps(
            {
                "model": "llm",
                "messages": [{"role": "user", "content": "Count to a thousand."}],
                "stream": True,
                "max_tokens": UNREAD_MAX_TOKENS,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 20,
            }
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", self.stack.openai))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {self.stack.api_key}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Faults(threading.Thread):
    """Runs the schedule's faults at their times; each fault's record: kind, start, recovered (the first
    moment served again), window_end = recovered + 1 s (epoch seconds)."""

    def __init__(self, stack: Stack, plan: dict, t0: float, args: argparse.Namespace, traffic) -> None:
        super().__init__(name="faults", daemon=True)
        self.stack, self.plan, self.t0, self.args = stack, plan, t0, args
        self.traffic = traffic  # set while the traffic is on: a fault waits out a pause
        self.records: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.unread = None if args.no_unread_stream else UnreadStream(stack)
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # the harness's own failure ends up in the summary
            self.error = repr(e)
            print(f"fault driver failed: {e!r}", flush=True)

    def _run(self) -> None:
        events = [(t, "core_kill") for t in self.plan["core_kills"]]
        if self.plan["front_restart"] is not None:
            events.append((self.plan["front_restart"], "front_restart"))
        if self.unread is not None:
            self.wait_until(5.0)
            self.open_unread()
        for at, kind in sorted(events):
            if self.wait_until(at):
                return
            record = self.kill_core() if kind == "core_kill" else self.restart_front()
            self.records.append(record)
            print(
                f"fault {kind} at t={record['start'] - self.t0:.0f}s: served again after "
                f"{_after(record)}; {record.get('detail', '')}",
                flush=True,
            )

    def wait_until(self, at: float) -> bool:
        """Sleep until t0 + at and the traffic is on (not in a pause); True if the soak is stopping."""
        if self.stop.wait(max(0.0, self.t0 + at - time.time())):
            return True
        if self.traffic.is_set():
            return False
        while not self.traffic.wait(1.0):
            if self.stop.is_set():
                return True
        return self.stop.wait(RESUME_S)  # a fault lands on requests in flight, not on an idle server

    def open_unread(self) -> None:
        self.unread.open()
        self.records.append({"kind": "unread_stream", "start": time.time(), "end": None})

    def close_unread(self) -> None:
        if self.unread is not None and self.unread.sock is not None:
            self.unread.close()
            open_ = [r for r in self.records if r["kind"] == "unread_stream" and r["end"] is None]
            for r in open_:
                r["end"] = time.time()

    def kill_core(self) -> dict[str, Any]:
        from loadtest.soak_probe import engine_metrics, server_pids

        pid = engine_metrics(self.stack.metrics_url).get("core_pid")
        tree = server_pids(self.stack.server.pid, int(pid) if pid else None)
        if not pid or tree.get("core") != int(pid):
            return _fault("core_kill", time.time(), None, f"no engine core to kill (metrics: {pid}, tree: {tree})")
        start = time.time()
        os.kill(int(pid), signal.SIGKILL)
        recovered = self.served_again(start)
        return _fault("core_kill", start, recovered, f"pid {int(pid)}")

    def served_again(self, start: float) -> float | None:
        from inflight_client import InferenceError, LLMClient

        client = LLMClient(self.stack.grpc_url, timeout_s=30)
        while time.time() - start < self.args.recover_timeout_s and not self.stop.is_set():
            try:
                client.generate("Hello", {"max_tokens": 2, "temperature": 0})
                return time.time()
            except InferenceError:
                time.sleep(0.2)
        return None

    def restart_front(self) -> dict[str, Any]:
        start = time.time()
        had_unread = self.unread is not None and self.unread.sock is not None
        self.stack.stop_front()
        self.close_unread()
        try:
            self.stack.start_front()
        except RuntimeError as e:
            return _fault("front_restart", start, None, str(e))
        healthy = time.time()
        recovered = self.stack.chat_served(start + self.args.recover_timeout_s, self.stop)
        if had_unread:
            self.open_unread()
        detail = f"new pid {self.stack.front_pid()}, /health 200 after {healthy - start:.1f} s"
        return _fault("front_restart", start, recovered, detail)


def _fault(kind: str, start: float, recovered: float | None, detail: str) -> dict[str, Any]:
    end = None if recovered is None else recovered + soak_report.FAULT_SLACK_S
    return {"kind": kind, "start": start, "recovered": recovered, "window_end": end, "detail": detail}


def _after(record: dict) -> str:
    rec = record.get("recovered")
    return "never" if rec is None else f"{rec - record['start']:.1f} s"


# ---- the run -----------------------------------------------------------------------------------------------


class Control:
    """The file the Locust users read before each request: paused or not, and when the traffic ends."""

    def __init__(self, path: Path, end: float) -> None:
        self.path, self.end = path, end
        self.set(paused=False)

    def set(self, paused: bool) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"paused": paused, "end": self.end}))
        tmp.replace(self.path)


class Samples:
    """Samples in time order, each with the requests that ended since the one before; a line each to the
    terminal and to samples.jsonl."""

    def __init__(self, probe: Probe, t0: float, out: Path) -> None:
        self.probe, self.t0, self.out = probe, t0, out
        self.items: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.log = open(out / "samples.jsonl", "w")  # noqa: SIM115 - closed by close()

    def take(self, **extra) -> dict[str, Any]:
        taken = self.probe.sample()
        with self.lock:
            wall = time.time()
            sample = {"t": round(wall - self.t0, 2), "wall": wall, "pause_probe": None, **extra, **taken}
            requests, _ = soak_report.read_events(self.out / "events.jsonl")
            last = self.items[-1]["wall"] if self.items else -float("inf")
            sample["window"] = soak_report.window_stats(requests, last, wall)
            self.items.append(sample)
            self.log.write(json.dumps(sample) + "\n")
            self.log.flush()
            print(progress(sample), flush=True)
        return sample

    def close(self) -> None:
        self.log.close()


class Pauser(threading.Thread):
    """Pauses the traffic on the schedule: no new request for at least `pause_s`, and then until the engine holds
    no request (at most `drain_s` more); then one sample (the pause's probe), and the traffic resumes. The last
    pause ends the run."""

    def __init__(self, plan: dict, t0: float, args, control: Control, samples: Samples, traffic) -> None:
        super().__init__(name="pauser", daemon=True)
        self.plan, self.t0, self.args = plan, t0, args
        self.control, self.samples, self.traffic = control, samples, traffic
        self.windows: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            for i, (start, _) in enumerate(self.plan["pauses"]):
                if self.stop.wait(max(0.0, self.t0 + start - time.time())):
                    return
                self.pause(i, last=i == len(self.plan["pauses"]) - 1)
        finally:
            self.done.set()

    def pause(self, i: int, last: bool) -> None:
        begin = time.time()
        self.traffic.clear()
        self.control.set(paused=True)
        self.stop.wait(self.args.pause_s)
        deadline = time.time() + self.args.drain_s
        while time.time() < deadline and not self.stop.is_set():
            engine = self.samples.probe.quick()
            if engine.get("requests_running") == 0 and engine.get("requests_waiting") == 0:
                break
            time.sleep(0.5)
        self.samples.take(pause_probe=i, drained_after_s=round(time.time() - begin, 1))
        if not last:
            self.control.set(paused=False)
            self.traffic.set()
        self.windows.append((begin, time.time()))


def start_locust(stack: Stack, args: argparse.Namespace, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "locust", "-f", str(stack.root / "loadtest" / "soak_locustfile.py"),
           "--headless", "--only-summary", "--users", str(LOCUST_USERS), "--spawn-rate", str(LOCUST_USERS),
           "--run-time", "24h", "--stop-timeout", "30", "--host", stack.grpc_url, "--loglevel", "WARNING",
           "--soak-events", str(out / "events.jsonl"), "--soak-control", str(out / "control.json"),
           "--openai-url", stack.openai_url, "--triton-http-url", stack.http_url, "--api-key", stack.api_key,
           "--long-prompt-words", str(args.long_prompt_words)]  # fmt: skip
    with open(out / "locust.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=stack.root, env=stack.env)


def stop_locust(locust: subprocess.Popen, events: Path, timeout_s: float = 120.0):
    """After the last pause: let requests still out end (a slow one is not cut into a hung one), then stop
    Locust, whose users are idle by then."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and locust.poll() is None and soak_report.read_events(events)[1]:
        time.sleep(1.0)
    if locust.poll() is None:
        locust.send_signal(signal.SIGTERM)
    try:
        return locust.wait(60)
    except subprocess.TimeoutExpired:
        locust.kill()
        return "killed"


def progress(sample: dict[str, Any]) -> str:
    w, e, p = sample["window"], sample["engine"], sample["procs"]
    n = w["requests"]
    rss = " ".join(f"{role} {p[role]['rss_mb']:.0f}" for role in p if p[role] is not None)
    ttft = "-" if w["ttft_p99_s"] is None else f"{w['ttft_p99_s']:.2f}"
    shm = "-" if sample["shm_bytes"] is None else f"{sample['shm_bytes'] / 2**20:.0f}"
    tag = "" if sample.get("pause_probe") is None else f" pause-end (drained after {sample['drained_after_s']} s)"
    return (
        f"t={sample['t']:6.0f}s{tag} ok {n['ok']} cancel {n['cancelled']} refused {n['refused']} "
        f"failed {n['failed']} | TTFT p99 {ttft} s | KV {e.get('kv_blocks_used')} | grammar "
        f"{(e.get('grammar_cache_bytes') or 0) / 2**20:.1f} MiB | shm {shm} MiB | RSS MiB {rss}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out = args.out.resolve()  # the processes run elsewhere (tritonserver in its run directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("events.jsonl", "samples.jsonl", "server.log", "openai.log", "locust.log"):
        (out / name).unlink(missing_ok=True)
    plan = schedule(args)
    print(
        f"soak: {args.minutes:g} min of traffic; pauses at {[a for a, _ in plan['pauses']]}; core kills at "
        f"{plan['core_kills']}; front restart at {plan['front_restart']} (s from the traffic's start)",
        flush=True,
    )
    stack = Stack(args, out)
    started = time.time()
    faults = locust = pauser = samples = None
    early = False
    locust_code = None
    try:
        stack.start()
        print(f"server ready in {time.time() - started:.0f} s; logs in {out}", flush=True)
        t0 = time.time() + 3.0  # the first sample (the idle start) comes before any traffic
        traffic = threading.Event()
        traffic.set()
        control = Control(out / "control.json", t0 + plan["duration_s"])
        samples = Samples(Probe(stack.server.pid, stack.front_pid, stack.metrics_url), t0, out)
        samples.take()
        time.sleep(max(0.0, t0 - time.time()))
        locust = start_locust(stack, args, out)
        faults = Faults(stack, plan, t0, args, traffic)
        pauser = Pauser(plan, t0, args, control, samples, traffic)
        faults.start()
        pauser.start()
        tick, early = t0, False
        while not pauser.done.is_set():
            tick += args.sample_s
            if pauser.done.wait(max(0.0, tick - time.time())):
                break
            if locust.poll() is not None:
                print(f"Locust exited early (code {locust.returncode}); see {out / 'locust.log'}", flush=True)
                early = True
                break
            samples.take()
        faults.stop.set()
        faults.join(60)
        faults.close_unread()
        locust_code = stop_locust(locust, out / "events.jsonl")
    finally:
        for worker in (faults, pauser):
            if worker is not None:
                worker.stop.set()
        if faults is not None:
            faults.close_unread()
        if locust is not None and locust.poll() is None:
            locust.kill()
        if samples is not None:
            samples.close()
        server_code = stack.stop()
        if args.snapshot:
            end_orphan_builds(out / "torch_extensions")
            shutil.rmtree(out / "tree", ignore_errors=True)
    return {
        "t0": t0,
        "schedule": {k: v for k, v in plan.items() if k != "pauses"} | {"planned_pauses": plan["pauses"]},
        "pauses": pauser.windows,
        "engine_args": ENGINE_ARGS,
        "faults": faults.records,
        "fault_driver_error": faults.error,
        "samples": sorted(samples.items, key=lambda s: s["wall"]),
        "locust_exit": locust_code,
        "locust_early_exit": early,
        "server_exit": server_code,
        "wall_s": round(time.time() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.report_only:  # the targets evaluated again over a finished soak's record
        result = json.loads((args.out / "run.json").read_text())
    else:
        result = run(args)
        (args.out / "run.json").write_text(json.dumps(result, default=str))
    summary = soak_report.summarize(result, args.out / "events.jsonl")
    summary |= {k: result.get(k) for k in ("locust_exit", "server_exit", "wall_s", "fault_driver_error")}
    summary["plot"] = str(soak_report.plot(summary, args.out / "soak.png"))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    r = summary["requests"]
    faults = sorted(summary["faults"], key=lambda f: f["start"])
    print(
        f"\n{r['total']} requests: {r['requests']}; hung {r['hung']}; faults: "
        + ", ".join(f"{f['kind']}@{f['start']:.0f}s" for f in faults)
    )
    soak_report.print_targets(summary)
    print(f"summary {args.out / 'summary.json'}, figure {summary['plot']}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
