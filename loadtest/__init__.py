"""Load tests against a running server: the Locust gRPC user and its runner, the hostile-input driver, AIPerf runs."""

import os

# Spinning OpenMP threads collapse when another process takes a core; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
