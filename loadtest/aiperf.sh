#!/usr/bin/env bash
# NVIDIA AIPerf (genai-perf's successor) against `inflight serve`, through Triton's HTTP generate_stream
# endpoint with AIPerf's `template` endpoint type. AIPerf lives in a virtualenv of its own. Not part of CI.
#
#   bash loadtest/aiperf.sh [CONCURRENCY] [REQUESTS] [aiperf profile options...]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${AIPERF_VENV:-.cache/aiperf-venv}  # .cache/ is gitignored
CONCURRENCY=${1:-16}
REQUESTS=${2:-128}
shift 2 || shift $# || true
OUT=loadtest/results/aiperf
mkdir -p "$OUT"

if [ ! -f "$VENV/bin/aiperf-installed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet aiperf==0.13.0
  touch "$VENV/bin/aiperf-installed"
fi

MODEL_DIR=$(.venv/bin/python -c "from inflight.demo_model import cached_demo_model; print(cached_demo_model())")
HTTP_PORT=$(.venv/bin/python -c "from inflight.launcher.server import free_port; print(free_port())")
export OMP_WAIT_POLICY=PASSIVE
.venv/bin/inflight serve --http-port "$HTTP_PORT" --grpc-port 0 --metrics-port 0 --openai-port 0 --max-num-seqs 32 \
  > "$OUT/tritonserver.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://localhost:$HTTP_PORT/v2/models/llm/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/tritonserver.log"; exit 1; }
  sleep 0.5
done

"$VENV/bin/aiperf" profile \
  --model llm --tokenizer "$MODEL_DIR" --url "http://localhost:$HTTP_PORT" \
  --endpoint /v2/models/llm/generate_stream --endpoint-type template --streaming \
  --extra-inputs payload_template:loadtest/aiperf/generate_stream.json.j2 \
  --extra-inputs response_field:text_output \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 32 \
  --output-tokens-mean 128 --output-tokens-stddev 32 \
  --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count 4 \
  --artifact-dir "$OUT" --ui-type simple --no-server-metrics "$@"
