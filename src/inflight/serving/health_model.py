"""The `<model>_health` model's whole code, sent as its `1/model.py` by `inflight.serving.health`: it exists only
while the engine serves, so its readiness is the answer; an inference to it answers `ready` = true."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        ready = pb_utils.Tensor("ready", np.array([True]))
        return [pb_utils.InferenceResponse([ready]) for _ in requests]
