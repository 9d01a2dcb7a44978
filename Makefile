# attnserve — `make serve` starts the service, `make test` runs the tests (both install what they need).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast lint bench bench-engine loadtest loadtest-compare cluster-up cluster-down clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m model.native_ops || echo "native kernels not built: the Python kernels serve (slower int8)"
	touch $(STAMP)

serve: install
	$(VENV)/bin/attnserve serve

test: install
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null && $(PY) -c "import selenium" 2>/dev/null \
		|| VENV=$(VENV) bash scripts/install_browser.sh
	$(PY) -m pytest -q -ra -n 2 --dist loadfile

test-fast: install
	$(PY) -m pytest -q -m "not slow and not ray and not cluster and not browser"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m benchmarks.bench_cache

bench-engine: install
	$(PY) -m benchmarks.bench_engine

# A short load test against the running service (`make serve` first); see docs/performance.md.
loadtest: install
	$(VENV)/bin/attnserve loadtest --scenario chat-stream --users 4 --duration 30s

# attnserve vs llama.cpp's llama-server on the same GGUF. Not CI: the build takes ~8 min of both cores.
loadtest-compare: install
	BIN=$$(PY=$(PY) bash benchmarks/build_llama_server.sh) && PY=$(PY) bash benchmarks/setup_llama_cpp_python.sh >/dev/null \
	  && $(PY) -m loadtests.compare_llamacpp --llama-server "$$BIN" --users 1,4,16,64 --py-users 16,64 --duration 40s

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

cluster-up: install
	$(VENV)/bin/attnserve cluster up

cluster-down: install
	$(VENV)/bin/attnserve cluster down
