"""`inflight serve`: run tritonserver (server.py) in the foreground and supervise it until it exits or Ctrl-C.

Two things can go wrong under a running server that tritonserver itself does not act on. The model unloads
itself when its engine cannot recover; tritonserver stays up (its server-level readiness may stay true), so
the model's own readiness is what says this process is still useful. A dead backend stub (killed, OOM)
leaves the model READY while every request fails ("Stub process is not healthy"): the supervisor reloads
the model (a fresh stub and engine), a bounded number of times.
"""

from __future__ import annotations

import signal
import time

from inflight.launcher.console import say
from inflight.launcher.server import MODEL_NAME, LauncherError, TritonServer

# The model's readiness is checked this often; this many failures in a row end `serve`.
MODEL_CHECK_INTERVAL_S = 1.0
MODEL_CHECKS_BEFORE_EXIT = 3
MODEL_GONE_EXIT_CODE = 3
# At most STUB_RESTARTS reloads after a stub death in STUB_RESTART_WINDOW_S, then STUB_DEAD_EXIT_CODE.
STUB_RESTARTS = 3
STUB_RESTART_WINDOW_S = 600.0
STUB_DEAD_EXIT_CODE = 4


class StubWatch:
    """Notices the model's backend stub dying under a READY model, and reloads the model (bounded)."""

    def __init__(self, server: TritonServer) -> None:
        self.server = server
        self.known_dead: set[int] = set()
        self.restarts: list[float] = []

    def newly_dead(self) -> list[int]:
        dead = [pid for pid, alive in self.server.stub_pids().items() if not alive and pid not in self.known_dead]
        self.known_dead.update(dead)
        return dead

    def check(self) -> int | None:
        """Reload the model if a stub died; None while serving, else the exit code `serve` should return."""
        dead = self.newly_dead()
        if not dead or self.server.model_state() != "READY":  # a model unloading itself is not a crash
            return None
        pids = ", ".join(map(str, dead))
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < STUB_RESTART_WINDOW_S] + [now]
        if len(self.restarts) > STUB_RESTARTS:
            say(
                f"model {MODEL_NAME!r}: its Python backend stub (pid {pids}) died again, {len(self.restarts)} times "
                f"in {STUB_RESTART_WINDOW_S:.0f}s; stopping with exit code {STUB_DEAD_EXIT_CODE}"
            )
            return STUB_DEAD_EXIT_CODE
        say(
            f"model {MODEL_NAME!r}: its Python backend stub (pid {pids}) died (killed?); requests fail until it is "
            "back: reloading the model"
        )
        if self.server.health_model:  # the probe turns false now; the reloaded model loads it again once it serves
            self.server.unload_model(self.server.health_model)
        error = self.server.load_model()
        if error is not None:
            say(f"model {MODEL_NAME!r} could not be reloaded ({error}); stopping with exit code {STUB_DEAD_EXIT_CODE}")
            return STUB_DEAD_EXIT_CODE
        self.known_dead.update(pid for pid, alive in self.server.stub_pids().items() if not alive)
        say(f"model {MODEL_NAME!r} reloaded in {time.monotonic() - now:.1f}s")
        return None


class ModelWatch:
    """Notices the model unloading itself (its engine could not recover). Loading, which may take minutes,
    is not gone; a failed load ends tritonserver itself."""

    def __init__(self, server: TritonServer) -> None:
        self.server = server
        self.unready = 0

    def check(self) -> int | None:
        """None while the model serves, else the exit code `serve` should return."""
        self.unready = self.unready + 1 if self.server.model_state() in ("UNLOADING", "UNAVAILABLE") else 0
        if self.unready < MODEL_CHECKS_BEFORE_EXIT:
            return None
        say(
            f"model {MODEL_NAME!r} is no longer ready (it unloads itself when its engine cannot recover; see the "
            f"log above); stopping with exit code {MODEL_GONE_EXIT_CODE}"
        )
        return MODEL_GONE_EXIT_CODE


def _start_api(server: TritonServer, port: int, host: str, model_dir: str | None):
    from inflight.serving.openai import OpenAIServer

    try:
        api = OpenAIServer(server.grpc_url, port, host, model_dir=model_dir).start()
    except RuntimeError as e:
        raise LauncherError(str(e)) from None
    say(f"OpenAI-compatible API on {api.url}/v1")
    return api


def _supervise(server: TritonServer, stopped) -> int | None:
    """Check the model every MODEL_CHECK_INTERVAL_S until tritonserver exits, `stopped()` or a watch gives up
    (its exit code)."""
    watches = (StubWatch(server), ModelWatch(server))
    next_check = time.monotonic() + MODEL_CHECK_INTERVAL_S
    while not stopped() and server.process is not None and server.process.poll() is None:
        time.sleep(0.2)
        if time.monotonic() >= next_check:
            for watch in watches:
                exit_code = watch.check()
                if exit_code is not None:
                    return exit_code
            next_check = time.monotonic() + MODEL_CHECK_INTERVAL_S
    return None


def serve(
    server: TritonServer, openai_port: int = 0, openai_host: str = "0.0.0.0", model_dir: str | None = None
) -> int:
    """Run in the foreground until the server exits or Ctrl-C / SIGTERM; return its exit code.

    openai_port: also serve the OpenAI-compatible API there (0 = not), a client of the server's gRPC port."""
    stop_signals: list[int] = []
    api = None
    previous = {s: signal.signal(s, lambda signum, _frame: stop_signals.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        server.start()
        say(
            f"tritonserver {server.dist.executable} serving {MODEL_NAME!r}: gRPC {server.grpc_url}, "
            f"HTTP {server.http_url}, metrics {server.metrics_url}"
        )
        if openai_port:
            api = _start_api(server, openai_port, openai_host, model_dir)
        exit_code = _supervise(server, lambda: bool(stop_signals))
        if stop_signals:
            say("stopping tritonserver ...")
        if api is not None:  # first: its open streams are cancelled while Triton still runs
            api.stop()
            api = None
        code = server.stop()
        if exit_code is not None:
            return exit_code
        return 0 if stop_signals else (code or 0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if api is not None:
            api.stop()
        if server.process is not None and server.process.poll() is None:
            server.stop()
