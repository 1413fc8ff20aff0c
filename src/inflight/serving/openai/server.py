"""Run the OpenAI app with uvicorn: in a background thread next to tritonserver (`inflight serve`, tests)
or in the foreground (`inflight openai`)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import uvicorn

from inflight.serving.openai.app import create_app
from inflight.serving.openai.guard import FrontLimits


def _config(triton_url: str, host: str, port: int, **app_kwargs) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(triton_url, **app_kwargs),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,  # streams still open then are closed, which cancels their Triton requests
        # uvicorn's own bounds on slow clients: an idle keep-alive connection closes after 5 s (its default
        # timeout_keep_alive); a request line + headers may not pass 16 KiB (h11); their read time is not
        # bounded (a reverse proxy's job). The body's size and read time are the Guard's (guard.py).
        timeout_keep_alive=5,
    )


class OpenAIServer:
    """uvicorn serving the app in a daemon thread; `start()` returns once it listens, `stop()` waits for it.

    with OpenAIServer("localhost:8001", port=9000) as api:
        ... api.url ...
    """

    def __init__(
        self,
        triton_url: str,
        port: int = 9000,
        host: str = "127.0.0.1",
        model: str = "llm",
        served_model_name: str | None = None,
        model_dir: str | Path | None = None,
        limits: FrontLimits | None = None,
        api_key: str | None = None,
        lora_admin_key: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        kwargs = dict(model=model, served_model_name=served_model_name, model_dir=model_dir, limits=limits,
                      api_key=api_key, lora_admin_key=lora_admin_key)  # fmt: skip
        self._server = uvicorn.Server(_config(triton_url, host, port, **kwargs))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "localhost" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        # uvicorn installs no signal handlers outside the main thread: the caller owns Ctrl-C.
        self._thread = threading.Thread(target=self._server.run, name="openai-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI API could not start on {self.host}:{self.port} (port in use?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI API did not start within {timeout_s:.0f} s")
            time.sleep(0.02)
        if self.port == 0:  # the port the OS picked
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Stopped(Exception):
    pass


def _stopped(signum, _frame) -> None:
    raise _Stopped


def run(triton_url: str, port: int = 9000, host: str = "127.0.0.1", **app_kwargs) -> None:
    """Serve in the foreground until Ctrl-C / SIGTERM, then return."""
    # uvicorn shuts down on the signal, restores the handlers it found and raises the signal again so
    # that the process ends "by" it; with these handlers that ends here, as a clean stop.
    previous = {s: signal.signal(s, _stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(_config(triton_url, host, port, **app_kwargs)).run()
    except _Stopped:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
