# Set-up in two commands: `make demo` and `make test`. Everything installs into .venv.
# TORCH is installed first so that a CPU build is used where one lies on disk; override it,
# e.g. `make test TORCH=torch==2.5.1`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test lint bench browser install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[report]"

install-dev: $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[dev]"

demo: install
	$(BIN)/hookscope demo

lint: install-dev
	$(BIN)/python -m ruff check src tests bench
	$(BIN)/python -m ruff format --check src tests bench
	$(BIN)/python -m mypy

# Debian's Chromium for the report's browser tests (skipped, with a note, where it cannot be installed).
browser:
	bash .ci/install-browser

test: lint browser
	$(BIN)/python -m pytest

bench: install-dev
	$(BIN)/python bench/bench_hooks.py
	$(BIN)/python bench/bench_capture.py
	$(BIN)/python bench/bench_trace.py
	$(BIN)/python bench/bench_grads.py
	$(BIN)/python bench/bench_edit.py
	$(BIN)/python bench/bench_extract.py --rss --rss-rows 512
	$(BIN)/python bench/bench_diff.py
	$(BIN)/python bench/bench_compile.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis hookscope-demo
