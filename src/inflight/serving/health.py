"""Readiness that tells the truth while the engine core restarts: a companion model, `<model>_health`.

Triton 2.51 reports a model ready from its load state alone, and a Python model leaves READY only by unloading
itself, which would end the front that restarts the core. So the front keeps a tiny companion model loaded
while its engine serves and unloads it as soon as the engine cannot serve (the core died, the engine broke):
`/v2/models/<model>_health/ready` is the probe for a load balancer. The companion is not in the model
repository (`--load-model=*` would make it ready before the engine is): the front sends its files with the
load (the model loading API), once its own model is ready. Needs `--model-control-mode=explicit`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

log = logging.getLogger("inflight.serving.health")

HEALTH_MODEL_PARAMETER = "health_model"  # config.pbtxt: the companion's name; "" = `<model>_health`
NO_HEALTH_MODEL = "none"
_STARTING = "Server not ready"  # what the loading API answers until the server has started
_RETRY_S = 0.2


def server_ready_url(pid: int | None = None) -> str | None:
    """Triton's own readiness endpoint, from the HTTP port on the command line of the server that started this
    stub (its parent); None where it serves no HTTP."""
    try:
        with open(f"/proc/{pid or os.getppid()}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    given = {"--http-port": "8000", "--http-address": "0.0.0.0", "--allow-http": "true"}
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in given:
            given[name] = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    if given["--allow-http"].lower() in ("false", "0"):
        return None
    host = given["--http-address"]
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host
    return f"http://{host}:{given['--http-port']}/v2/health/ready"


def _server_started() -> bool:
    url = server_ready_url()
    return url is None or answers(url)


def answers(url: str) -> bool:
    """Whether a GET of `url` says 200 now (2 s at most)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


_SOURCE = Path(__file__).with_name("health_model.py")
_CONFIG = {
    "backend": "python",
    "max_batch_size": 0,
    "input": [],
    "output": [{"name": "ready", "data_type": "TYPE_BOOL", "dims": [1]}],
    "instance_group": [{"kind": "KIND_CPU", "count": 1}],
}


def health_model_name(model: str, parameter: str | None) -> str | None:
    """The companion's name from the `health_model` parameter: empty = `<model>_health`, "none" = no companion."""
    value = (parameter or "").strip()
    if value == NO_HEALTH_MODEL:
        return None
    return value or f"{model}_health"


class HealthModel:
    """Loads and unloads the companion from a thread of its own (a load takes a second or two: Triton starts a
    stub process for it). `serving()` asks for it loaded, `unavailable()` for it gone and waits until it is.
    A load that fails (e.g. no explicit model control) is logged and not retried: the probe then stays false."""

    def __init__(
        self, pb_utils: ModuleType, model: str, name: str, server_started: Callable[[], bool] | None = None
    ) -> None:
        """`server_started()`: whether the server has started (default: its HTTP readiness endpoint says so, where
        it serves HTTP)."""
        self._pb = pb_utils
        self.model, self.name = model, name
        self._cond = threading.Condition()
        self._wanted: bool | None = None
        self._loaded: bool | None = None  # None: unknown (not touched yet, or a load failed)
        self._failed = False
        self._stopping = False
        self._initialized = False
        self._server_started = server_started or _server_started
        self._thread = threading.Thread(target=self._run, name="inflight-health", daemon=True)
        self._thread.start()

    def serving(self) -> None:
        self._want(True)

    def unavailable(self, wait_s: float = 2.0) -> bool:
        """Unload the companion; True once it is gone (or will never be loaded), False if `wait_s` ran out."""
        self._want(False)
        with self._cond:
            return self._cond.wait_for(lambda: self._loaded is False or self._failed or self._stopping, wait_s)

    def stop(self, wait_s: float = 10.0) -> bool:
        """Stop the thread and wait until it has (True) or `wait_s` ran out (False): nothing of ours calls into
        the server once the model finalizes."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _want(self, loaded: bool) -> None:
        with self._cond:
            self._wanted = loaded
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._due)
                if self._stopping:
                    return
                wanted = self._wanted
            if wanted and not self._own_model_ready():
                continue  # asked otherwise meanwhile, or stopping
            done = self._load() if wanted else self._unload()
            if done is None:
                continue  # a load given up: asked otherwise meanwhile, or stopping
            with self._cond:
                self._loaded = wanted if done else None
                self._failed = not done  # a failed load is not retried
                self._cond.notify_all()
                late = self._stopping and wanted and done
            if late:  # loaded after the server began to unload every model: it would outlive that, and the server
                self._unload()  # would wait out its exit timeout for it

    def _due(self) -> bool:
        return self._stopping or (not self._failed and self._wanted not in (None, self._loaded))

    def initialized(self) -> None:
        """Our own model's `initialize` has returned: Triton makes it READY, and the loading API may be used."""
        with self._cond:
            self._initialized = True
            self._cond.notify_all()

    def _own_model_ready(self) -> bool:
        """Wait until our own model has initialized and the server has started (it refuses loads before), unless
        the wish changes first. The server is asked over HTTP, not through the stub: a stub's call into the server
        that fails (the server starting or stopping) can crash the stub, and the server then aborts
        (python_backend)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._initialized or self._stopping or self._wanted is not True)
                if not (self._initialized and not self._stopping and self._wanted is True):
                    return False
            if self._server_started():
                return True
            with self._cond:
                if self._cond.wait_for(lambda: self._stopping or self._wanted is not True, _RETRY_S):
                    return False

    def _load(self) -> bool | None:
        """True once loaded, False if the load failed, None if given up (the wish changed, or stopping) while the
        server was still starting (it refuses loads until every model of the repository has loaded)."""
        files = {"file:1/model.py": _SOURCE.read_bytes()}
        while True:
            try:
                self._pb.load_model(self.name, config=json.dumps(_CONFIG), files=files)
            except Exception as e:
                if _STARTING in str(e):
                    with self._cond:
                        if self._cond.wait_for(lambda: self._stopping or self._wanted is not True, _RETRY_S):
                            return None
                    continue
                log.error("could not load %r, the probe of %r (it stays not ready): %s", self.name, self.model, e)
                return False
            log.info("%r loaded: %r serves", self.name, self.model)
            return True

    def _unload(self) -> bool:
        try:
            self._pb.unload_model(self.name)
        except Exception as e:  # e.g. it was never loaded
            log.warning("unloading %r: %s", self.name, e)
        log.info("%r unloaded: %r does not serve", self.name, self.model)
        return True
