# llama_ddp: `make pretrain-small` and `make test` work on a fresh machine.
# torch is installed first, pinned, so a CPU-only machine never downloads CUDA packages.
# Change the pin (or add an index) on the command line: make install TORCH_VERSION=2.6.0
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
# Everything here runs offline unless the user asks for a hub dataset.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

.PHONY: install test lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install --quiet -e ".[dev]"
	touch $@

test: install
	$(OFFLINE) $(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache *.egg-info
