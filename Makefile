VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test serve lint bench

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV) test
	touch $@

install: $(VENV)/.installed

## Run the whole test suite (unit, kernels under TRITON_INTERPRET=1, engine vs HF, end-to-end tritonserver).
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

## Serve the embedded demo model from a real tritonserver (gRPC 8001, HTTP 8000, metrics 8002).
serve: install
	$(VENV)/bin/inflight serve $(SERVE_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m loadtest.bench_batching $(BENCH_ARGS)
