"""`inflight cluster` (`make serve-cluster N=2`): N Triton replicas, a Dynamo worker each, and NVIDIA
Dynamo's frontend (OpenAI API + KV-aware router) in front, all on loopback. Ctrl-C stops everything.

No etcd and no NATS: Dynamo's file discovery (DYN_FILE_KV, a temporary directory), TCP request plane and
ZMQ event plane. Replica i uses ports base+10i (HTTP), +1 (gRPC), +2 (metrics), +3 (its own OpenAI front, with
--replica-openai); its engine publishes KV events on an ipc:// socket its worker subscribes to.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from inflight.launcher.console import say
from inflight.launcher.server import LauncherError, TritonServer

LOOPBACK = "127.0.0.1"
# Every Dynamo listener on loopback (request plane, event plane, system server, response streams).
DYNAMO_HOST_ENV = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "DYN_TCP_RESPONSE_STREAM_HOST")
DYNAMO_PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]


@dataclass
class Replica:
    index: int
    server: TritonServer
    kv_events_endpoint: str
    openai_port: int = 0
    worker: subprocess.Popen | None = None
    openai: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.server.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.server.metrics_port}/metrics"


@dataclass
class Cluster:
    replicas: int = 2
    model: str | None = None  # None: the default model; "demo": the tiny random one
    router_mode: str = "kv"
    http_port: int = 8080
    base_port: int = 18000
    parameters: dict[str, object] = field(default_factory=dict)
    replica_openai: bool = False
    log_dir: Path | None = None
    namespace: str = "inflight"
    # Dynamo's KV router scores a worker by the prompt blocks it would have to prefill (x this) plus its
    # decode load; None = Dynamo's default (1), which lets load win over cached prefixes on a small cache
    # (tests/test_cluster.py uses 10).
    prefill_load_scale: float | None = None
    # In-flight requests of a worker that dies move to another worker (Dynamo's request migration).
    migration_limit: int = 3
    frontend_args: list[str] = field(default_factory=list)
    members: list[Replica] = field(default_factory=list)
    frontend: subprocess.Popen | None = None
    _dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({name: LOOPBACK for name in DYNAMO_HOST_ENV})
        env["DYN_FILE_KV"] = str(self._dir / "discovery")
        env.setdefault("DYN_LOG", "warn")
        # Stopping the cluster stops the frontend first: a worker has nothing left to drain.
        env.setdefault("DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS", "0")
        return env

    def _log(self, name: str):
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = self._log(name)
        return subprocess.Popen(
            argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
        )

    def start(self, timeout_s: float = 600.0) -> Cluster:
        self._dir = Path(tempfile.mkdtemp(prefix="inflight-cluster-"))
        (self._dir / "discovery").mkdir()
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.replicas):
                base = self.base_port + 10 * i
                params = dict(self.parameters)
                if self.model is not None:
                    params["model"] = self.model
                # An ipc:// socket: the engine binds it (a tcp:// address without a wildcard it would connect to),
                # and nothing off this machine can reach it.
                kv_endpoint = f"ipc://{self._dir}/replica{i}-kv-events"
                params["kv_events_config"] = json.dumps(
                    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_endpoint}
                )
                server = TritonServer(
                    None,
                    params,
                    http_port=base,
                    grpc_port=base + 1,
                    metrics_port=base + 2,
                    log=self.log_dir / f"replica{i}.log" if self.log_dir else None,
                    extra_args=[
                        f"--http-address={LOOPBACK}",
                        f"--grpc-address={LOOPBACK}",
                        f"--metrics-address={LOOPBACK}",
                    ],
                )
                self.members.append(Replica(i, server, kv_endpoint, base + 3 if self.replica_openai else 0))
                server.start()
            for r in self.members:
                r.server.wait_ready(timeout_s)
            py = sys.executable
            for r in self.members:
                r.worker = self._spawn(
                    f"worker{r.index}",
                    [
                        py,
                        "-m",
                        "inflight.launcher.cli",
                        "dynamo-worker",
                        "--triton-url",
                        r.grpc_url,
                        "--namespace",
                        self.namespace,
                        "--kv-events-endpoint",
                        r.kv_events_endpoint,
                        *DYNAMO_PLANES,
                    ],
                )
                if r.openai_port:
                    r.openai = self._spawn(
                        f"openai{r.index}",
                        [
                            py,
                            "-m",
                            "inflight.launcher.cli",
                            "openai",
                            "--triton-url",
                            r.grpc_url,
                            "--port",
                            str(r.openai_port),
                            "--host",
                            LOOPBACK,
                        ],
                    )
            self.frontend = self._spawn(
                "frontend",
                [
                    py,
                    "-m",
                    "dynamo.frontend",
                    "--router-mode",
                    self.router_mode,
                    "--http-host",
                    LOOPBACK,
                    "--http-port",
                    str(self.http_port),
                    "--namespace",
                    self.namespace,
                    *DYNAMO_PLANES,
                    "--migration-limit",
                    str(self.migration_limit),
                    *self._router_args(),
                    *self.frontend_args,
                ],
            )
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _router_args(self) -> list[str]:
        if self.router_mode != "kv" or self.prefill_load_scale is None:
            return []
        return ["--router-prefill-load-scale", str(self.prefill_load_scale)]

    def model_name(self) -> str | None:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                data = json.loads(resp.read()).get("data") or []
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return data[0]["id"] if data else None

    def wait_ready(self, timeout_s: float) -> None:
        """Until the frontend lists the model and every worker has had time to register."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if self.model_name() is not None and self._registered() >= len(self.live()):
                return
            time.sleep(0.5)
        raise LauncherError(f"the Dynamo frontend at {self.url} did not list the model within {timeout_s:.0f}s")

    def _registered(self) -> int:
        """Workers in file discovery: one instance record each (v1/instances/<namespace/component/endpoint/id>)."""
        root = self._dir / "discovery" / "v1" / "instances"
        return sum(1 for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0

    def _check_alive(self) -> None:
        for name, proc in [("frontend", self.frontend)] + [(f"worker{r.index}", r.worker) for r in self.members]:
            if proc is not None and proc.poll() is not None:
                raise LauncherError(f"{name} exited with code {proc.returncode} (logs: {self.log_dir})")

    def live(self) -> list[Replica]:
        return [r for r in self.members if r.server.process is not None and r.server.process.poll() is None]

    def kill_replica(self, index: int) -> None:
        """Kill replica `index`'s tritonserver (its whole process group, as a crash); its worker notices
        and leaves the cluster."""
        proc = self.members[index].server.process
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        procs = [self.frontend] + [p for r in self.members for p in (r.worker, r.openai)]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for r in self.members:
            r.server.stop()
        self.frontend = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight cluster", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--replicas", type=int, default=2)
    p.add_argument("--model", default=None, help="as `inflight serve --model` ('demo': the tiny random model)")
    p.add_argument("--router-mode", default="kv", help="Dynamo's: kv | round-robin | random | ...")
    p.add_argument("--http-port", type=int, default=8080, help="the Dynamo frontend's OpenAI API port")
    p.add_argument("--base-port", type=int, default=18000, help="replica i: base+10i .. base+10i+3")
    p.add_argument("--replica-openai", action="store_true", help="also each replica's own OpenAI front (base+10i+4)")
    p.add_argument("--prefill-load-scale", type=float, default=None, help="KV router: weight of blocks to prefill")
    p.add_argument("--frontend-args", default="", help="more `python -m dynamo.frontend` arguments (one string)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a config.pbtxt parameter")
    p.add_argument("--log-dir", default=None, help="one log per process here (default: the terminal)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    params = {}
    for item in ns.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"inflight cluster: --param {item!r} must look like KEY=VALUE")
        params[key] = value
    cluster = Cluster(
        ns.replicas,
        ns.model,
        ns.router_mode,
        ns.http_port,
        ns.base_port,
        params,
        ns.replica_openai,
        Path(ns.log_dir) if ns.log_dir else None,
        prefill_load_scale=ns.prefill_load_scale,
        frontend_args=shlex.split(ns.frontend_args),
    )

    def on_signal(signum, frame):
        raise KeyboardInterrupt  # also where SIGINT was ignored (a background job of a non-interactive shell)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        say(
            f"ready: {cluster.replicas} replicas behind Dynamo's {ns.router_mode} router; "
            f"OpenAI API at {cluster.url}/v1 (model {cluster.model_name()!r}). Ctrl-C stops all.",
            "inflight cluster",
        )
        while True:
            cluster._check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except LauncherError as e:
        say(str(e), "inflight cluster")
        return 1
    finally:
        cluster.stop()
    return 0
