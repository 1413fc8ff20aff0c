#!/usr/bin/env bash
# What a lent GPU machine checks, in as few calls as possible (device time is counted in minutes).
# Stages (default all, in order; pick with STAGES="..."): env, kernels (the Triton kernel tests on the
# GPU), engine (the engine against HF and the torch backend on CUDA), bench_kernels (achieved bandwidth),
# bench_engine (the batching benchmark on CUDA with a ~1B model, vs HF generate on the same GPU),
# decode_step (that model's forward alone against the GPU's floors, and its kernel time vs launch time),
# graphs (the batching trace with CUDA graphs against eager launches, alternating rounds),
# serving (not in the default list: the served path through a real tritonserver vs in-process, on CUDA).
# `serving` needs what that machine lacks, carried in .whl/ (listed in .git/info/exclude; ~60 MB, under the
# device tool's 64 MiB): the nvidia-pytriton 0.7.0 wheel without its Python 3.13 library and the other
# Pythons' stubs, zipped as pytriton_trim.zip; tritonclient 2.73.0, python-rapidjson, msgspec and pyzmq
# (cp312; the engine core process talks over ZMQ), psutil and prometheus-client (the launcher); numpy
# 1.26.4 for Python 3.12 (the launcher gives the backend stub a numpy-1 environment and installs it from
# .whl/ there: no network). Fetch them with `pip download --no-deps --only-binary=:all: --python-version
# 3.12 --platform manylinux_2_17_x86_64 ...`, unzip the pytriton wheel, delete
# nvidia_pytriton.libs/libpython3-*.13.so* and python_backend_stubs/ other than 3.12, zip it again.
# It uses the machine's own python3 and packages (no network there); logs go to $OUT (default
# /tmp/gpu-check) and one tarball of them to $OUT/gpu-check.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
export PYTHONPATH="$PWD/src:$PWD/client:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
STAGES=${STAGES:-"env kernels engine bench_kernels bench_engine decode_step graphs"}
ENGINE_MODEL=${ENGINE_MODEL:-llama1b}  # ENGINE_ARGS: more bench_batching arguments (default: --skip overhead)
status=0
# The engine itself imports msgspec and pyzmq (its KV events, its core process), the launcher psutil and
# prometheus-client: what that machine lacks of them comes from .whl/.
site=/tmp/gpu-check-site
rm -rf "$site" && mkdir -p "$site"
if compgen -G ".whl/msgspec-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$site" .whl/msgspec-*.whl .whl/pyzmq-*.whl
    for extra in .whl/psutil-*.whl .whl/prometheus_client-*.whl; do
        [ -f "$extra" ] && "$PY" -m pip install -q --no-index --no-deps --target "$site" "$extra"
    done
    export PYTHONPATH="$site:$PYTHONPATH"
fi

stage() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-15}" "$LOGS/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || status=1
}

for s in $STAGES; do
    case $s in
    env)
        stage env 60 bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers, tokenizers, safetensors; \
print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, \
\"tokenizers\", tokenizers.__version__); p = torch.cuda.get_device_properties(0); \
print(p.name, p.multi_processor_count, \"SMs\", p.total_memory >> 20, \"MiB\")'" ;;
    kernels)
        stage kernels 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels -k "not cpu" ;;
    engine)
        stage engine 300 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_engine.py \
            tests/test_engine_reference.py tests/test_bf16_reference.py tests/test_prefix_cache.py \
            tests/test_cuda_graphs.py tests/test_spec_decode.py -k "not generated_mix and not metrics" ;;
    bench_kernels)
        stage bench_kernels 200 "$PY" -m benchmarks.kernels.bench_kernels --batches 1 4 16 64 256 --contexts 512 2048 8192 \
            --json "$LOGS/bench_kernels.json" ;;
    bench_engine)
        stage bench_engine 380 "$PY" -m benchmarks.engine.bench_batching --device cuda --model "$ENGINE_MODEL" \
            --dtype bfloat16 --no-progress --out "$LOGS/bench_engine" ${ENGINE_ARGS:---skip overhead} ;;
    decode_step)
        stage decode_step 300 "$PY" -m benchmarks.engine.bench_decode_step --device cuda --model "$ENGINE_MODEL" \
            --dtype bfloat16 --batch 1 16 64 256 --context 1024 --prefill 1024 --profile --profile-batch 64 ;;
    graphs)
        stage graphs 300 "$PY" -m benchmarks.engine.bench_graphs --model "$ENGINE_MODEL" --dtype bfloat16 \
            --rounds "${GRAPH_ROUNDS:-2}" --out "$LOGS/graphs.json" ;;
    serving)
        "$PY" - "$site" <<'PYEOF'
import os, sys, zipfile
site = sys.argv[1]
with zipfile.ZipFile(".whl/pytriton_trim.zip") as z:
    for info in z.infolist():
        path = z.extract(info, site)
        mode = info.external_attr >> 16
        if mode:
            os.chmod(path, mode & 0o7777)
PYEOF
        "$PY" -m pip install -q --no-index --no-deps --target "$site" .whl/tritonclient-*.whl .whl/python_rapidjson-*.whl
        # What an editable install does: the backend stub's Python finds this checkout through a .pth in the
        # environment's site dir (it does not see PYTHONPATH).
        purelib=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
        printf '%s\n' "$site" "$PWD/src" "$PWD/kernels" "$PWD/client" "$PWD" >"$purelib/inflight_gpu_check.pth"
        stage serving 480 env PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.whl" \
            "$PY" -m benchmarks.serving.serving_overhead --device cuda --model "$ENGINE_MODEL" --dtype bfloat16 \
            --max-num-seqs 64 --out "$LOGS/serving"
        tail -n 30 "$LOGS/serving/tritonserver.log" 2>/dev/null ;;
    *) echo "unknown stage $s"; status=1 ;;
    esac
done
tar czf "$OUT/gpu-check.tgz" -C "$OUT" logs
exit $status
