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

.PHONY: demo test test-fast coverage lint bench browser install install-dev clean FORCE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Each install leaves a stamp in the venv and runs again only when pyproject.toml, this Makefile
# or TORCH changed since, so `make lint` twice does no pip work the second time.
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The TORCH last installed; rewritten (and so newer than the stamps) only when it changes.
$(VENV)/.torch: FORCE | $(BIN)/python
	@echo "$(TORCH)" | cmp -s - $@ || echo "$(TORCH)" > $@

$(VENV)/.installed: pyproject.toml Makefile $(VENV)/.torch | $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) "$(TORCH)" -e ".[demo]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml Makefile $(VENV)/.torch | $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) "$(TORCH)" -e ".[dev]"
	touch $@

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

# The edit-test loop: everything but the tests marked slow (compile, distributed, browser, and
# any test of a second or more); under 90 s on 2 cores. `make test` runs them all.
test-fast: install-dev
	$(BIN)/python -m pytest -m "not slow"

# The whole suite under coverage.py; prints the files below 100% and the total line coverage of
# src/hookscope (code run only in a subprocess the tests start is not counted).
coverage: install-dev
	$(BIN)/python -m coverage erase
	$(BIN)/python -m coverage run -m pytest
	$(BIN)/python -m coverage report --skip-covered --sort=cover
	@echo "Line coverage of src/hookscope: $$($(BIN)/python -m coverage report --format=total)%"

bench: install-dev
	$(BIN)/python bench/bench_hooks.py
	$(BIN)/python bench/bench_capture.py
	$(BIN)/python bench/bench_trace.py
	$(BIN)/python bench/bench_grads.py
	$(BIN)/python bench/bench_edit.py
	$(BIN)/python bench/bench_extract.py --rss --rss-rows 512
	$(BIN)/python bench/bench_diff.py
	$(BIN)/python bench/bench_compile.py
	$(BIN)/python bench/bench_ops.py
	$(BIN)/python bench/bench_methods.py
	$(BIN)/python bench/bench_monitor.py
	$(BIN)/python bench/bench_store.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis hookscope-demo \
		.coverage .coverage.*
