"""Where tritonserver comes from, and what its Python-backend stub needs to run our model.

- NVIDIA's tritonserver image: `/opt/tritonserver` (or `tritonserver` on PATH) with its own backends.
- A bare machine: the `nvidia-pytriton` wheel, which ships the binary, the Python backend, a backend
  stub per CPython version and the libraries they link. Its files assume pytriton's own start-up, so
  we do the same set-up ourselves: a backends dir we own with the stub for *this* Python copied in,
  the wheel's libraries on LD_LIBRARY_PATH (copied files lose their relative rpath), and this
  interpreter's environment first on PATH (the stub embeds Python and finds its prefix, hence its
  site-packages, by looking `python3` up on PATH).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from inflight import omp

# The wheel's tritonserver (2.51) has a Python-backend stub built with pybind11 2.10, which reads
# numpy's dtype struct with the numpy-1 layout: under numpy 2 every STRING tensor arrives garbled and
# the stub dies (fixed by python_backend PR #384, Oct 2024, after 24.10). Its stub therefore runs in an overlay
# environment whose numpy is 1.x; everything else comes from this environment.
STUB_NUMPY = "numpy==1.26.4"


class LauncherError(RuntimeError):
    """The server could not be found, prepared or started: the message says what to do."""


@dataclass
class ServerDist:
    executable: Path
    backends: Path  # the dist's backend directory (contains python/)
    stub: Path | None  # the wheel's stub for this Python; None when the backends dir already has one
    lib_dirs: list[Path] = field(default_factory=list)

    @property
    def from_wheel(self) -> bool:
        return self.stub is not None


def find_server(executable: str | Path | None = None) -> ServerDist:
    """An explicit binary, else the nvidia-pytriton wheel, else the container's /opt/tritonserver."""
    explicit = executable or os.environ.get("INFLIGHT_TRITONSERVER")
    if explicit:
        exe = Path(explicit).resolve()
        if not exe.is_file():
            raise LauncherError(f"tritonserver binary {exe} does not exist")
        return ServerDist(exe, exe.parent.parent / "backends", None)
    wheel = _wheel_dist()
    if wheel is not None:
        return wheel
    on_path = shutil.which("tritonserver")
    for candidate in (Path("/opt/tritonserver/bin/tritonserver"), Path(on_path) if on_path else None):
        if candidate is not None and candidate.is_file():
            return ServerDist(candidate, candidate.parent.parent / "backends", None)
    raise LauncherError(
        "no tritonserver found: install the project with `make install` (it adds the nvidia-pytriton wheel "
        "that ships the server), run inside NVIDIA's tritonserver image, or pass --tritonserver PATH"
    )


def _wheel_dist() -> ServerDist | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    exe = root / "bin" / "tritonserver"
    if not exe.is_file():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise LauncherError(f"the nvidia-pytriton wheel has no Python-backend stub for Python {version} ({stub})")
    libs = [root.parent.parent / "nvidia_pytriton.libs", root / "external_libs"]
    return ServerDist(exe, root / "backends", stub, [d for d in libs if d.is_dir()])


def prepare_backends(dist: ServerDist, run_dir: Path) -> Path:
    if not dist.from_wheel:
        return dist.backends
    backends = run_dir / "backends"
    shutil.copytree(dist.backends, backends, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(dist.stub, backends / "python" / "triton_python_backend_stub")
    return backends


def stub_python_bin(dist: ServerDist) -> Path:
    """The bin dir whose `python3` the backend stub will find first on PATH."""
    here = Path(sys.executable).parent
    if not dist.from_wheel or _numpy_major() < 2:
        return here
    return ensure_stub_overlay() / "bin"


def _numpy_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("numpy").split(".")[0])
    except Exception:  # no numpy here: the stub brings no constraint of its own
        return 0


def overlay_dir() -> Path:
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{STUB_NUMPY.replace('==', '')}"
    return Path(sys.prefix) / "share" / "inflight" / f"stub-env-{tag}"


def ensure_stub_overlay() -> Path:
    """A venv with numpy 1.x whose site dir chains to this environment's (built once, atomically)."""
    target = overlay_dir()
    if (target / "pyvenv.cfg").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".stub-env-", dir=target.parent))
    try:
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", "--without-pip", str(tmp)], "create the stub's overlay environment")
        site_dir = Path(
            subprocess.check_output(
                [str(tmp / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                text=True,
            ).strip()
        )
        _run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--target", str(site_dir), STUB_NUMPY],
            f"install {STUB_NUMPY} for the tritonserver Python-backend stub (needs PyPI once)",
        )  # fmt: skip
        # addsitedir (not a bare path line) so this environment's own .pth files run too: that is how the
        # editable install of this project is found.
        dirs = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
        lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
        (site_dir / "zz_inflight_parent_env.pth").write_text("\n".join(lines) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another launcher built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LauncherError(f"could not {what}: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def server_env(dist: ServerDist, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = omp.environment(dict(os.environ if base is None else base))
    env["PATH"] = os.pathsep.join([str(stub_python_bin(dist)), env.get("PATH", "")])
    libs = [str(d) for d in dist.lib_dirs]
    # The stub links libpython3.X.so; prefer the one of this interpreter over whatever the system has.
    libdir = sysconfig.get_config_var("LIBDIR")
    if dist.from_wheel and libdir and Path(libdir).is_dir():
        libs.insert(0, libdir)
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env


def prepare() -> None:
    """Do the one-time set-up ahead of the first serve (for install scripts): the stub's environment."""
    dist = find_server()
    print(f"tritonserver: {dist.executable}")
    print(f"python for the backend stub: {stub_python_bin(dist)}")


if __name__ == "__main__":  # python -m inflight.launcher.triton_dist  (what scripts/install.sh may call once)
    try:
        prepare()
    except LauncherError as e:
        sys.exit(f"inflight.launcher.triton_dist: {e}")
