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
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger("inflight.serving.health")

HEALTH_MODEL_PARAMETER = "health_model"  # config.pbtxt: the companion's name; "" = `<model>_health`
NO_HEALTH_MODEL = "none"
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

    def __init__(self, pb_utils: ModuleType, model: str, name: str, poll_s: float = 0.2) -> None:
        self._pb = pb_utils
        self.model, self.name = model, name
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._wanted: bool | None = None
        self._loaded: bool | None = None  # None: unknown (not touched yet, or a load failed)
        self._failed = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inflight-health", daemon=True)
        self._thread.start()

    def serving(self) -> None:
        self._want(True)

    def unavailable(self, wait_s: float = 2.0) -> bool:
        """Unload the companion; True once it is gone (or will never be loaded), False if `wait_s` ran out."""
        self._want(False)
        with self._cond:
            return self._cond.wait_for(lambda: self._loaded is False or self._failed or self._stopping, wait_s)

    def stop(self) -> None:
        """Stop the thread (it may be inside a Triton call: it is a daemon, nobody waits for it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

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
            with self._cond:
                self._loaded = wanted if done else None
                self._failed = not done  # a failed load is not retried
                self._cond.notify_all()

    def _due(self) -> bool:
        return self._stopping or (not self._failed and self._wanted not in (None, self._loaded))

    def _own_model_ready(self) -> bool:
        """Wait until our own model is READY (the server runs: the loading API may be used), unless the wish
        changes first."""
        while True:
            try:
                if self._pb.is_model_ready(self.model):
                    return True
            except Exception:  # the server is still starting
                pass
            with self._cond:
                if self._cond.wait_for(lambda: self._stopping or self._wanted is not True, self._poll_s):
                    return False

    def _load(self) -> bool:
        try:
            self._pb.load_model(self.name, config=json.dumps(_CONFIG), files={"file:1/model.py": _SOURCE.read_bytes()})
        except Exception as e:
            log.error("could not load %r, the readiness probe of %r (it stays not ready): %s", self.name, self.model, e)
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
