"""Run a real `tritonserver` (found by triton_dist.py) on a model repository; stop it cleanly. The process
plumbing only: supervisor.py watches a running one.

The model repository is always served from a generated copy in a temp dir: engine settings given on
the command line are written into that copy's config.pbtxt `parameters`, LoRA adapters into its version
directory's `multi_lora.json` (as Triton's vLLM backend reads them), and the source tree stays free of
Triton's __pycache__ and per-run edits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import psutil
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from inflight.launcher.triton_dist import LauncherError, find_server, prepare_backends, server_env
from inflight.serving.health import HEALTH_MODEL_PARAMETER, answers, health_model_name

__all__ = ["LauncherError", "TritonServer", "free_port", "free_ports", "write_model_repository", "write_multi_lora"]

MODEL_NAME = "llm"
STUB_RELOAD_TIMEOUT_S = 600.0
_SHM_DIR = Path("/dev/shm")
_REPOSITORY_KEY = "inflight-repository-key"
_ADMIN_APIS = "model-repository,shared-memory,logging,trace"
# The Triton model's LoRA admin key (inflight.serving.codec.LORA_ADMIN_KEY_ENV): load/unload need it.
LORA_ADMIN_KEY_ENV = "INFLIGHT_LORA_ADMIN_KEY"
MULTI_LORA_FILE = "multi_lora.json"


def default_model_repository() -> Path:
    # src/inflight/launcher/server.py -> repository root; the package is installed editable (scripts/install.sh).
    return Path(__file__).resolve().parents[3] / "model_repository"


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each is held until all are picked (a port released by one pick may come back
    from the next)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


# ---- preparing the run directory --------------------------------------------------------------------


def write_model_repository(
    source: Path,
    dest: Path,
    parameters: Mapping[str, object] | None = None,
    model: str = MODEL_NAME,
    lora_modules: Mapping[str, str] | None = None,
) -> Path:
    """Copy `source` to `dest`, setting `parameters` in `model`'s config.pbtxt and adding `lora_modules`
    (adapter name -> PEFT adapter directory) to its multi_lora.json."""
    if not (source / model / "config.pbtxt").is_file():
        raise LauncherError(f"{source} is not a model repository with a '{model}' model (no {model}/config.pbtxt)")
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config = dest / model / "config.pbtxt"
    config.write_text(set_parameters(config.read_text(), parameters or {}))
    write_multi_lora(source / model, dest / model, lora_modules or {})
    return dest


def _version_dir(model_dir: Path) -> str:
    """The version Triton serves (its default policy: the highest number); "1" when there is none yet."""
    versions = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return str(max(versions)) if versions else "1"


def write_multi_lora(source_model: Path, dest_model: Path, lora_modules: Mapping[str, str]) -> Path | None:
    """Write the copy's `<version>/multi_lora.json`: the source's adapters and `lora_modules`, every directory
    absolute (a relative one is taken from the source file's directory, or from here for `lora_modules`: the
    copy lives elsewhere). The file written, or None when there are no adapters."""
    version = _version_dir(dest_model)
    source_file = source_model / version / MULTI_LORA_FILE
    modules: dict[str, str] = {}
    if source_file.is_file():
        try:
            found = json.loads(source_file.read_text())
        except (OSError, ValueError) as e:
            raise LauncherError(f"{source_file}: not a JSON object of adapter names to directories ({e})") from None
        if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
            raise LauncherError(f'{source_file}: must map adapter names to adapter directories: {{"name": "/path"}}')
        modules = {name: str((source_file.parent / path).resolve()) for name, path in found.items()}
    both = sorted(set(modules) & set(lora_modules))
    if both:
        raise LauncherError(f"LoRA adapter(s) {both} are named both by --lora-modules and in {source_file}")
    for name, path in lora_modules.items():
        adapter = Path(path).expanduser().resolve()
        if not adapter.is_dir():
            raise LauncherError(f"LoRA adapter {name!r}: {path} is not a directory (a PEFT adapter's)")
        modules[name] = str(adapter)
    if not modules:
        return None
    target = dest_model / version / MULTI_LORA_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(modules, indent=2) + "\n")
    return target


def set_parameters(pbtxt: str, parameters: Mapping[str, object]) -> str:
    """config.pbtxt text with `parameters[key].string_value` set for each item (None -> ""), parsed and
    written by protobuf against Triton's ModelConfig schema."""
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(pbtxt, config)
    except text_format.ParseError as e:
        raise LauncherError(f"config.pbtxt does not parse as a Triton ModelConfig: {e}") from None
    for key, value in parameters.items():
        config.parameters[key].string_value = "" if value is None else str(value)
    return text_format.MessageToString(config)


# ---- the server process -----------------------------------------------------------------------------


class TritonServer:
    """A tritonserver subprocess serving a generated copy of a model repository.

    with TritonServer(parameters={"max_num_seqs": 8}, grpc_port=0) as server:
        server.wait_ready()
        ... server.grpc_url ...

    A port of 0 picks a free one. `log` is a path to write the server's output to; None inherits the
    terminal.
    """

    def __init__(
        self,
        model_repository: str | Path | None = None,
        parameters: Mapping[str, object] | None = None,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log: str | Path | None = None,
        log_verbose: int = 0,
        tritonserver: str | Path | None = None,
        exit_timeout_s: int = 10,
        extra_args: list[str] | None = None,
        lora_modules: Mapping[str, str] | None = None,
        lora_admin_key: str | None = None,
    ) -> None:
        self.source = Path(model_repository) if model_repository else default_model_repository()
        self.parameters = dict(parameters or {})
        self.lora_modules = dict(lora_modules or {})  # written to the copy's multi_lora.json
        # Given to tritonserver's environment: the model's LoRA load/unload take it (None: they are refused).
        self.lora_admin_key = lora_admin_key
        picked = iter(free_ports(sum(not p for p in (http_port, grpc_port, metrics_port))))  # those not given, together
        self.http_port = http_port or next(picked)
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
        self.log_path = Path(log) if log else None
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args or [])
        self._repository_secret = secrets.token_hex(16)
        # The Python backend's shared-memory regions carry this launch's prefix, so that the ones a dead stub
        # leaves behind can be removed when the server stops (and no other server's).
        self.shm_prefix = f"triton_python_backend_shm_region_inflight{secrets.token_hex(4)}_"
        self.dist = find_server(tritonserver)
        self.process: subprocess.Popen | None = None
        self.run_dir: Path | None = None
        self._log_file = None
        self.health_model: str | None = None  # the readiness companion of MODEL_NAME (serving/health.py), once started
        self._stub_argv: dict[int, tuple[str, ...]] = {}  # stub pid -> its command line, as seen alive

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://localhost:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self, repository: Path, backends: Path) -> list[str]:
        return [
            str(self.dist.executable),
            f"--model-repository={repository}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            # Explicit control (loading every model at start) lets a model whose engine broke unload itself,
            # which is how it reports not ready (serving/triton_model.py).
            "--model-control-mode=explicit",
            "--load-model=*",
            # ...but explicit mode also opens the model-repository API (load/unload, even model file overrides)
            # to anyone who reaches the ports: restrict it, and the other operator APIs (shared-memory
            # registration, log and trace settings), to a header only this launch knows.
            f"--http-restricted-api={_ADMIN_APIS}:{_REPOSITORY_KEY}={self._repository_secret}",
            f"--grpc-restricted-protocol={_ADMIN_APIS}:{_REPOSITORY_KEY}={self._repository_secret}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            *self.extra_args,
        ]

    def _prepare_run_dir(self) -> tuple[Path, Path, dict[str, str]]:
        """A fresh run directory with the model repository's copy and the backends: (repository, backends, env)."""
        self.run_dir = Path(tempfile.mkdtemp(prefix="inflight-serve-"))
        try:
            repository = write_model_repository(
                self.source, self.run_dir / "model_repository", self.parameters, lora_modules=self.lora_modules
            )
            self.health_model = health_model_name(MODEL_NAME, _parameter(repository, HEALTH_MODEL_PARAMETER))
            env = server_env(self.dist)
            env.pop(LORA_ADMIN_KEY_ENV, None)  # only this launch's key, never one inherited
            if self.lora_admin_key:
                env[LORA_ADMIN_KEY_ENV] = self.lora_admin_key
            return repository, prepare_backends(self.dist, self.run_dir), env
        except BaseException:
            self._cleanup()
            raise

    def start(self) -> TritonServer:
        repository, backends, env = self._prepare_run_dir()
        out = None
        if self.log_path is not None:
            self._log_file = out = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        # Own session: a terminal's Ctrl-C must reach only us, so that we stop tritonserver in order. A
        # SIGINT to the whole group would also hit the backend stub, and tritonserver then waits its full
        # exit timeout for a model that can no longer unload.
        self.process = subprocess.Popen(
            self.command(repository, backends),
            env=env,
            cwd=self.run_dir,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        return self

    def wait_ready(self, timeout_s: float = 300.0, model: str = MODEL_NAME) -> None:
        """Block until the model is ready, its health model too (the engine serves), and the metrics endpoint
        answers (tritonserver starts it after the HTTP one); raise with the log's tail if the server dies first."""
        deadline = time.monotonic() + timeout_s
        health = [self.health_model] if model == MODEL_NAME and self.health_model else []
        for url in [f"{self.http_url}/v2/models/{m}/ready" for m in (model, *health)] + [self.metrics_url]:
            while not self._answers(url):
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    why = f"tritonserver exited with code {code} before '{model}' was ready"
                    raise LauncherError(why + self._tail())
                if time.monotonic() >= deadline:
                    raise LauncherError(f"'{model}' not ready after {timeout_s:.0f}s{self._tail()}")
                time.sleep(0.25)

    def model_ready(self, model: str = MODEL_NAME) -> bool:
        """Whether `/v2/models/{model}/ready` says yes now."""
        return self._answers(f"{self.http_url}/v2/models/{model}/ready")

    def serving(self) -> bool:
        """Whether the readiness probe says yes now: the health model's (it exists only while the engine serves),
        or the model's own where it has none."""
        return self.model_ready(self.health_model or MODEL_NAME)

    @staticmethod
    def _answers(url: str) -> bool:
        return answers(url)

    def _repository_post(self, path: str) -> urllib.request.Request:
        """A POST to the repository API at /v2/repository/`path`, with this launch's secret."""
        return urllib.request.Request(
            f"{self.http_url}/v2/repository/{path}",
            data=b"{}",
            headers={_REPOSITORY_KEY: self._repository_secret, "Content-Type": "application/json"},
            method="POST",
        )

    def model_state(self, model: str = MODEL_NAME) -> str | None:
        """The model's state in the repository index (READY, LOADING, UNLOADING, UNAVAILABLE), None if unknown."""
        index = self._index()
        return None if index is None else index.get(model, "UNAVAILABLE")

    def _index(self) -> dict[str, str] | None:
        """{model: state} of the repository index (the models of the repository's directory); None if the server
        does not answer."""
        try:
            with urllib.request.urlopen(self._repository_post("index"), timeout=2) as resp:
                return {m.get("name"): m.get("state") for m in json.loads(resp.read())}
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _settle_companion(self, wait_s: float = 8.0) -> None:
        """Before the server stops, give the readiness companion's load time to finish while its model is ready
        and it is not (the front loads it then; a load takes a second or two): a model's stub that calls into the
        server while the server unloads that model can crash, and the server then aborts (python_backend). The
        index does not list the companion (it is loaded with its files), so its probe is asked."""
        deadline = time.monotonic() + wait_s
        while self.health_model is not None and time.monotonic() < deadline and self.process.poll() is None:
            if not self.model_ready() or self.model_ready(self.health_model):
                return
            time.sleep(0.1)

    def unload_model(self, model: str) -> str | None:
        """Unload `model` through the repository API; None on success, else the error."""
        try:
            with urllib.request.urlopen(self._repository_post(f"models/{model}/unload"), timeout=30):
                return None
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
        except (urllib.error.URLError, OSError) as e:
            return str(e)

    def load_model(self, model: str = MODEL_NAME, timeout_s: float = STUB_RELOAD_TIMEOUT_S) -> str | None:
        """(Re)load `model` through the repository API (a loaded model is replaced by a fresh copy once the
        new one is ready); None on success, else the error."""
        try:
            with urllib.request.urlopen(self._repository_post(f"models/{model}/load"), timeout=timeout_s):
                return None
        except urllib.error.HTTPError as e:
            return f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
        except (urllib.error.URLError, OSError) as e:
            return str(e)

    def stub_pids(self, model: str = MODEL_NAME) -> dict[int, bool]:
        """`model`'s Python backend stubs: {pid: alive}. A killed stub stays a zombie child (tritonserver does not
        reap it), so it is found dead rather than gone. A stub's model is read from its command line (its
        instance name, `<model>_<group>_<n>`) while it is alive: a zombie has none, so only stubs seen alive
        are known (the health model's stubs come and go)."""
        if self.process is None:
            return {}
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.Error:  # the server is gone
            return {}
        stubs = {}
        for child in children:
            try:
                if not child.name().startswith("triton_python"):
                    continue
                alive = child.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                if alive and child.pid not in self._stub_argv:
                    self._stub_argv[child.pid] = tuple(child.cmdline())
            except psutil.Error:  # gone meanwhile
                continue
            if any(re.fullmatch(rf"{re.escape(model)}_\d+_\d+", arg) for arg in self._stub_argv.get(child.pid, ())):
                stubs[child.pid] = alive
        return stubs

    def shm_regions(self) -> list[Path]:
        """This launch's Python-backend shared-memory regions in /dev/shm."""
        try:
            return sorted(_SHM_DIR.glob(self.shm_prefix + "*"))
        except OSError:
            return []

    def _tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n--- tritonserver log (tail) ---\n" + "\n".join(text)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (graceful: in-flight requests finish, models finalize), then SIGKILL the group."""
        proc = self.process
        code = None
        if proc is not None:
            if proc.poll() is None:
                self._settle_companion()
                proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=timeout_s if timeout_s is not None else self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                code = None
            # The stub lives in the server's session; kill whatever is left of it either way.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if code is None:
                code = proc.wait()
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        if self.process is None or self.process.poll() is not None:
            # A stub killed with SIGKILL cannot unlink its region (hundreds of MB of /dev/shm); the server is
            # gone now, so whatever carries this launch's prefix is garbage.
            for region in self.shm_regions():
                with contextlib.suppress(OSError):
                    region.unlink()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    def __enter__(self) -> TritonServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _parameter(repository: Path, key: str, model: str = MODEL_NAME) -> str | None:
    """A `parameters` value of `model`'s config.pbtxt in `repository` (None when it has none)."""
    config = model_config_pb2.ModelConfig()
    text_format.Parse((repository / model / "config.pbtxt").read_text(), config)
    return config.parameters[key].string_value if key in config.parameters else None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the launching thread dies without stopping it (Linux).

    (The kernel ties this to the thread that forked: start servers from a long-lived thread.)
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
