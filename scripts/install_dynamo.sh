#!/usr/bin/env bash
# NVIDIA Dynamo 1.6.1 (frontend, KV router, worker runtime) into an existing venv, for `inflight dynamo-worker`,
# `make serve-cluster` and `make test-cluster`. Not needed by `make test`.
#   scripts/install_dynamo.sh [VENV]      (default .venv, made by scripts/install.sh; `system`: the image's Python)
# `pip install ai-dynamo` fails: it requires `aisimulate`, a placeholder on PyPI that downloads from NVIDIA's
# index. So: the `dynamo` extra (ai-dynamo-runtime and ai-dynamo's other requirements, pinned), then ai-dynamo
# itself with --no-deps. Its `vllm`/`sglang`/`trtllm` extras are not needed: inflight is the engine.
set -euo pipefail
venv=${1:-.venv}
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$venv" = system ]; then  # the Dockerfile (INFLIGHT_DYNAMO=1): the image's Python, the project installed
  py=python3
  spec="$root[dynamo]"
else
  py="$venv/bin/python"
  [ -x "$py" ] || { echo "no $py: run scripts/install.sh $venv first" >&2; exit 1; }
  spec="-e $root[dynamo]"
fi
pip=("$py" -m pip install --quiet --disable-pip-version-check)
# shellcheck disable=SC2086  # spec is "-e PATH[extra]" or "PATH[extra]"
"${pip[@]}" $spec
"${pip[@]}" --no-deps "ai-dynamo==1.6.1"
"$py" -c "import dynamo.frontend, dynamo.common.backend.engine, dynamo.llm"
echo "NVIDIA Dynamo installed into $venv"
