"""Core death under load: SIGKILL the engine core process again and again while streams are in flight.

    make core-kills                                   # = python -m loadtest.core_kills (demo model, 20 kills)
    python -m loadtest.core_kills --kills 3 --model smollm2

A real tritonserver (the launcher's `TritonServer`) serves the model while `--clients` gRPC streaming clients
keep it busy with long requests. Each kill comes at a random moment once every client is mid-stream, and at
least `--gap-s` after the previous one (by default the engine's restart bound allows: at most MAX_RESTARTS
deaths in RESTART_WINDOW_S, so every kill should be survived). Per kill it records how many requests were in
flight and when each ended (an error, or a completion that raced the kill; not ended within `--hung-after-s`
= hung), when a new core was up (its pid in the metrics), whether `/v2/models/llm/ready` ever said no, and
when a fresh request was served again. At the end: the server still serves, the KV cache is empty, exactly
one core process is left, and none outlives the server. A table on the terminal, JSON and a plot in `--out`;
exit status 1 if a request hung, the server did not serve again, or a final check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from inflight.serving.prometheus_text import sample as metric
from inflight.serving.prometheus_text import scrape
from loadtest.core_kills_report import SPEC_ERROR_S, failures, plot, row_line, summarize, table

# Small enough for 2 CPU cores. Clients stay below max_num_seqs so that the served-again probe is scheduled
# at once instead of queueing behind the load.
ENGINE_ARGS = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "num_kv_blocks": 1024, "max_model_len": 2048}
DEATH_ERROR = "the engine process died"
DRAIN_TIMEOUT_S = 600.0  # the last requests end by themselves (a slow model's long requests take a while)
MODEL_ALIASES = {"smollm2": ""}  # "" = the default served model (inflight.model_source)


@dataclass
class Request:
    """One client request: monotonic times (first text and end as they arrive, in tritonclient's callback),
    and the error it ended with (None: completed)."""

    started: float
    first_token: float | None = None
    ended: float | None = None
    error: str | None = None


@dataclass
class Load:
    """`clients` threads streaming long requests over Triton's gRPC stream, back to back until `stop`."""

    url: str
    clients: int
    max_tokens: tuple[int, int]
    seed: int
    request_timeout_s: float = 60.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    current: dict[int, Request] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"completed": 0, "unavailable": 0, "other": 0})
    others: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(i,), name=f"client-{i}", daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _run(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not self.stop.is_set():
            params = {"max_tokens": rng.randint(*self.max_tokens), "ignore_eos": True, "temperature": 0}
            req = self._one(i, f"Story number {rng.randrange(10**6)}:", params)
            error = req.error
            with self.lock:
                self.current.pop(i, None)
                # A request sent while the core restarts is refused with the death's message too.
                kind = "completed" if error is None else "unavailable" if DEATH_ERROR in error else "other"
                self.counts[kind] += 1
                if kind == "other" and len(self.others) < 20:
                    self.others.append(error[:200])
            if error is not None:
                self.stop.wait(0.2)  # refused while the core restarts: do not spin

    def _one(self, i: int, prompt: str, params: dict) -> Request:
        """Stream one request; its end is the arrival of its final response or error."""
        import numpy as np
        import tritonclient.grpc as grpcclient
        from inflight_client import make_inputs

        inputs = make_inputs({
            "text_input": np.array([prompt.encode()], dtype=np.object_),
            "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_),
            "exclude_input_in_output": np.array([True]),
        })  # fmt: skip
        done = threading.Event()
        req = Request(time.monotonic())

        def on_response(result, error) -> None:
            now = time.monotonic()
            if done.is_set():
                return
            if error is not None:
                req.error = error.message() or str(error)
            elif req.first_token is None and result.as_numpy("text_output") is not None:
                req.first_token = now
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                req.ended = now
                done.set()

        client = grpcclient.InferenceServerClient(self.url)
        with self.lock:
            self.current[i] = req
        try:
            client.start_stream(callback=on_response)
            client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
            ended = done.wait(self.request_timeout_s)
            if not ended:  # hung for good: give up on it (the kill's own record already says hung)
                req.error, req.ended = f"no end within {self.request_timeout_s:.0f} s", time.monotonic()
            # Cancel only what has not ended: a cancel racing the server's end crashes tritonserver 2.51.
            client.stop_stream(cancel_requests=not ended)
        except Exception as e:  # the transport's own failure is a finding too
            if req.ended is None:
                req.error, req.ended = repr(e)[:200], time.monotonic()
        finally:
            client.close()
        return req

    def in_flight(self) -> list[Request]:
        with self.lock:
            return [r for r in self.current.values() if r.ended is None]

    def all_mid_stream(self) -> bool:
        with self.lock:
            reqs = self.current.values()
            return len(reqs) == self.clients and all(r.first_token and r.ended is None for r in reqs)

    def finish(self, timeout_s: float) -> bool:
        """Stop after the requests in flight end by themselves (cancelling them could race their end)."""
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


# ---- the server's side -----------------------------------------------------------------------------------


def core_pid(server) -> int | None:
    try:
        pid = metric(scrape(server.metrics_url), "inflight_engine_core_pid")
    except OSError:
        return None
    return int(pid) if pid else None


# psutil's process status as the one letter /proc and ps show (the JSON result keeps those)
_STATE_LETTER = {psutil.STATUS_RUNNING: "R", psutil.STATUS_SLEEPING: "S", psutil.STATUS_DISK_SLEEP: "D",
                 psutil.STATUS_STOPPED: "T", psutil.STATUS_ZOMBIE: "Z", psutil.STATUS_DEAD: "X",
                 psutil.STATUS_IDLE: "I"}  # fmt: skip


def core_processes(run_dir: str) -> dict[int, str]:
    """Engine core processes of this launch: {pid: state letter, as ps shows it}. The core is a multiprocessing
    spawn child of the stub, which runs in tritonserver's run directory; a core orphaned outside the server's
    process tree keeps that working directory."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if proc.cwd().startswith(run_dir) and "spawn_main" in " ".join(proc.cmdline()):
                found[proc.pid] = _STATE_LETTER.get(proc.status(), "?")
        except psutil.Error:  # gone meanwhile, a zombie, or not ours to read
            continue
    return found


def stub_resources(server) -> dict[str, int]:
    """The model's backend stub (the front): open file descriptors and threads. Each core it starts brings
    sockets, a process sentinel and threads; what it keeps after the core is gone grows with every restart."""
    pids = [pid for pid, alive in server.stub_pids().items() if alive]
    if len(pids) != 1:
        return {}
    try:
        stub = psutil.Process(pids[0])
        return {"fds": stub.num_fds(), "threads": stub.num_threads()}
    except psutil.Error:
        return {}


def is_core(pid: int, run_dir: str) -> bool:
    return pid in core_processes(run_dir)


# ---- one kill --------------------------------------------------------------------------------------------


def served(client) -> bool:
    from inflight_client import InferenceError

    try:
        return bool(client.generate("Hello world", {"temperature": 0, "max_tokens": 4}).text)
    except InferenceError:
        return False


def kill_once(server, load: Load, client, run_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    pid = core_pid(server)
    if pid is None or not is_core(pid, run_dir):
        raise SystemExit(f"the metrics name core pid {pid}, which is not this server's engine core process")
    in_flight = load.in_flight()
    mid_stream = sum(r.first_token is not None for r in in_flight)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    core_back = served_again = None
    never_unready = True
    deadline = killed + args.served_timeout_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        if core_back is None:
            new = core_pid(server)
            if new is not None and new != pid:
                core_back = time.monotonic() - killed
        never_unready &= server.model_ready()
        if served_again is None and served(client):
            served_again = time.monotonic() - killed
        waiting = any(r.ended is None for r in in_flight) and now - killed < args.hung_after_s
        if served_again is not None and core_back is not None and not waiting:
            break
        time.sleep(0.05)
    if served_again is not None:  # a served request proves the new core was up (the pid is polled less often)
        core_back = served_again if core_back is None else min(core_back, served_again)
    ends = [max(0.0, r.ended - killed) for r in in_flight if r.ended is not None]
    ends = [t for t in ends if t <= args.hung_after_s]
    errors = [r for r in in_flight if r.ended is not None and r.error is not None]
    return {
        "core_pid": pid,
        "in_flight": len(in_flight),
        "mid_stream": mid_stream,
        "ended_with_death_error": sum(DEATH_ERROR in r.error for r in errors),
        "ended_with_other_error": sum(DEATH_ERROR not in r.error for r in errors),
        "completed": sum(r.ended is not None and r.error is None for r in in_flight),
        "hung": len(in_flight) - len(ends),
        "over_spec": sum(t > SPEC_ERROR_S for t in ends),
        "time_to_end_s": [round(t, 4) for t in sorted(ends)],
        "time_to_end_p50_s": round(statistics.median(ends), 4) if ends else None,
        "time_to_end_max_s": round(max(ends), 4) if ends else None,
        "core_back_s": None if core_back is None else round(core_back, 3),
        "served_again_s": None if served_again is None else round(served_again, 3),
        "ready_throughout": never_unready,
    }


# ---- the run ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from inflight_client import LLMClient

    from inflight.launcher.server import TritonServer

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server.log").unlink(missing_ok=True)  # the launcher appends: one run per log
    model = MODEL_ALIASES.get(args.model, args.model)
    server = TritonServer(
        parameters=dict(ENGINE_ARGS, model=model),
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        log=args.out / "server.log",
    )
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    started = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        run_dir = str(server.run_dir)
        client = LLMClient(server.grpc_url, timeout_s=args.request_timeout_s)
        if not served(client):
            raise SystemExit(f"the fresh server does not serve; see {args.out / 'server.log'}")
        final["stub_before"] = stub_resources(server)
        load = Load(server.grpc_url, args.clients, tuple(args.max_tokens), args.seed, args.request_timeout_s).start()
        print(f"{args.kills} kills, {args.clients} streaming clients, at least {args.gap_s:.0f} s apart", flush=True)
        last_kill = -float("inf")
        for k in range(args.kills):
            busy_since = time.monotonic()
            while time.monotonic() - last_kill < args.gap_s or not load.all_mid_stream():
                if time.monotonic() - busy_since > args.served_timeout_s + args.gap_s:
                    raise SystemExit("the clients never got mid-stream again")
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, args.jitter_s))  # a random moment in the streams
            last_kill = time.monotonic()
            row = kill_once(server, load, client, run_dir, args)
            rows.append(row)
            print(f"kill {k + 1:>2}/{args.kills}: {row_line(row)}", flush=True)
            if row["served_again_s"] is None:
                print(f"not served again within {args.served_timeout_s:.0f} s: stopping", flush=True)
                break
        final["load_stopped"] = load.finish(DRAIN_TIMEOUT_S)
        final["requests"] = dict(load.counts)
        final["other_errors"] = load.others
        final.update(final_checks(server, client, run_dir))
        final["core_starts_expected"] = len(rows) + 1
    finally:
        run_dir = str(server.run_dir) if server.run_dir else None
        final["server_exit_code"] = server.stop()
        if run_dir is not None:
            time.sleep(1.0)  # a core notices its parent's death within its idle poll
            final["cores_after_stop"] = sorted(core_processes(run_dir))
    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engine_args": ENGINE_ARGS,
        "kills": rows,
        "summary": summarize(rows),
        "final": final,
        "wall_s": round(time.monotonic() - started, 1),
    }


def final_checks(server, client, run_dir: str) -> dict[str, Any]:
    """After the load: still serving, nothing left in the engine or its KV cache, one core process."""
    out: dict[str, Any] = {"serves": served(client)}
    deadline, samples = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        samples = scrape(server.metrics_url)
        busy = [
            metric(samples, "inflight_requests", state="running"),
            metric(samples, "inflight_requests", state="waiting"),
            metric(samples, "inflight_kv_blocks", state="used"),
        ]
        if busy == [0, 0, 0]:
            break
        time.sleep(0.25)
    out["kv_blocks_used"] = metric(samples, "inflight_kv_blocks", state="used")
    out["kv_blocks_free"] = metric(samples, "inflight_kv_blocks", state="free")
    out["requests_running"] = metric(samples, "inflight_requests", state="running")
    out["requests_waiting"] = metric(samples, "inflight_requests", state="waiting")
    out["core_starts"] = metric(samples, "inflight_engine_core_starts_total")
    out["core_pid"] = metric(samples, "inflight_engine_core_pid")
    out["core_processes"] = {str(pid): state for pid, state in core_processes(run_dir).items()}
    out["stub_after"] = stub_resources(server)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from inflight.serving.engine_loop import MAX_RESTARTS, RESTART_WINDOW_S

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--model", default="demo", help="demo (default), smollm2, or a checkpoint directory / .gguf")
    seqs = ENGINE_ARGS["max_num_seqs"]
    p.add_argument("--clients", type=int, default=6, help=f"concurrent streams (< max_num_seqs={seqs})")
    p.add_argument("--max-tokens", type=int, nargs=2, default=[512, 1536], metavar=("MIN", "MAX"),
                   help="per request, uniform; long enough that every stream is mid-stream at a kill")  # fmt: skip
    gap = RESTART_WINDOW_S / MAX_RESTARTS + 1.0
    p.add_argument("--gap-s", type=float, default=gap, help=f"least time between kills (default {gap:.0f}: "
                   f"the engine restarts a core at most {MAX_RESTARTS} times in {RESTART_WINDOW_S:.0f} s)")  # fmt: skip
    p.add_argument("--jitter-s", type=float, default=0.5, help="random wait once every client is mid-stream")
    p.add_argument("--hung-after-s", type=float, default=5.0, help="an in-flight request not ended by then hung")
    p.add_argument("--served-timeout-s", type=float, default=120.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="a client's wait for its next response")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/core_kills"))
    args = p.parse_args(argv)
    if args.kills < 1 or args.clients < 1 or args.clients >= ENGINE_ARGS["max_num_seqs"]:
        p.error(f"--kills must be >= 1 and --clients in 1..{ENGINE_ARGS['max_num_seqs'] - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    missed = failures(result, args.kills)
    result["failures"] = missed
    (args.out / "core_kills.json").write_text(json.dumps(result, indent=2))
    if result["kills"]:
        plot(result, args.out / "core_kills.png")
    print(table(result))
    f = result["final"]
    print(
        f"after the kills: serves {f.get('serves')}, KV blocks used {f.get('kv_blocks_used')}, core processes "
        f"{f.get('core_processes')}, core starts {f.get('core_starts')}; stub {f.get('stub_before')} -> "
        f"{f.get('stub_after')}; requests {f.get('requests')}; "
        f"{result['wall_s']:.0f} s; results in {args.out}"
    )
    print("FAILED: " + "; ".join(missed) if missed else "ok: no request hung, served again after every kill")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
