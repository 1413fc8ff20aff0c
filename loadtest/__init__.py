"""Load tests against a running server: the Locust gRPC user and its runner, the hostile-input and core-kill
drivers, AIPerf runs."""

from inflight import omp

omp.apply()  # before any load test imports torch
