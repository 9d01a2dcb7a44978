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
	touch $(STAMP)

serve: install
	$(VENV)/bin/attnserve serve

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -m "not slow and not ray and not cluster and not browser"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m loadtests.bench_cache

bench-engine: install
	$(PY) -m loadtests.bench_engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

cluster-up: install
	$(VENV)/bin/attnserve cluster up

cluster-down: install
	$(VENV)/bin/attnserve cluster down
