"""The front's side of the engine core process: start it, send it requests and aborts, take its step
messages, and notice at once when it dies.

Two ZMQ sockets over ipc:// in a private temp dir, bound by the core and connected by the front (a
connecting PUSH queues while the peer is away, so a send never blocks on a dead core): PUSH front->core
for `AddRequest`/`Abort`, PUSH core->front for `Ready`/`StepOutputs`/`Broken`. `poll()` waits on the
output socket and the process's sentinel together, so a death is seen within one poll.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

from inflight.engine import core_messages
from inflight.engine.core import CoreSpec, run_core


class CoreError(RuntimeError):
    """The core process died, or could not start."""


class CoreClient:
    def __init__(self, spec: CoreSpec) -> None:
        self.spec = spec
        self.ready: core_messages.Ready | None = None
        self.exit_reason: str | None = None  # set once the process is seen dead
        self._dir = tempfile.mkdtemp(prefix="inflight-core-")
        self._ctx = zmq.Context(io_threads=1)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._send_lock = threading.Lock()  # submit() and the responder both send
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(core_messages.FromCore)
        ctx = multiprocessing.get_context("spawn")
        ctx.set_executable(_python())
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self.process = ctx.Process(
            target=run_core, args=(spec, input_addr, output_addr, os.getpid()), name="inflight-engine-core"
        )
        self._input.connect(input_addr)
        self._output.connect(output_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 900.0, stopping: threading.Event | None = None) -> core_messages.Ready:
        """Start the process and wait for its handshake; CoreError if it dies or the wait ends first."""
        self.process.start()
        self._poller.register(self.process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (stopping is not None and stopping.is_set()):
            for message in self.poll(0.1):
                if isinstance(message, core_messages.Ready):
                    self.ready = message
                    return message
            if self.exit_reason is not None:
                raise CoreError(f"the engine process could not start: it {self.exit_reason}; see the server log")
        self.close()
        if stopping is not None and stopping.is_set():
            raise CoreError("the model is shutting down")
        raise CoreError(f"the engine process did not become ready within {timeout_s:.0f} s")

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def close(self, timeout_s: float = 5.0) -> None:
        """End the process (SIGTERM, then SIGKILL) and release the sockets. Idempotent."""
        if self.process.pid is not None and self.process.exitcode is None:
            self.process.terminate()
            self.process.join(timeout_s)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join(timeout_s)
        with self._send_lock:
            if not self._ctx.closed:
                self._input.close()
                self._output.close()
                self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages ---------------------------------------------------------------------------------------

    def add(self, request: core_messages.AddRequest) -> None:
        self._send(request)

    def lora_admin(self, request: core_messages.LoRAAdmin) -> None:
        self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(core_messages.Abort(request_ids))

    def _send(self, message) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:
            if not self._ctx.closed:
                self._input.send(data, copy=False)

    def poll(self, timeout_s: float) -> list:
        """Every message that has arrived, waiting up to timeout_s for the first. When the process has
        died, returns what it sent before dying and sets `exit_reason`."""
        if self.exit_reason is not None:  # dead: nothing will come (and the caller must not spin)
            time.sleep(timeout_s)
            return []
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        messages = self._drain() if events else []
        if self.process.sentinel in events or (events and not self.process.is_alive()):
            self.process.join(1.0)
            messages += self._drain()
            self.exit_reason = _describe_exit(self.process.exitcode)
        return messages

    def _drain(self) -> list:
        messages = []
        while True:
            try:
                frame = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(self._decoder.decode(frame.buffer))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _python() -> str:
    """The interpreter for the child. Inside Triton's stub, sys.executable may be the stub binary: use the
    Python of the stub's environment (the one whose site-packages it runs with)."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python"):
        return exe
    for name in ("python3", "python"):
        candidate = Path(sys.prefix) / "bin" / name
        if candidate.exists():
            return str(candidate)
    return shutil.which("python3") or exe
