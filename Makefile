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

.PHONY: demo test test-fast coverage lint bench browser wheel-check docs install install-dev clean zoo zoo-sample FORCE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Each install leaves a stamp in the venv and runs again only when pyproject.toml, this Makefile
# or TORCH changed since, so `make lint` twice does no pip work the second time.
install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The TORCH last installed; rewritten (and so newer than the stamps) only when it changes.
$(VENV)/.torch: FORCE | $(BIN)/python
	@echo "$(TORCH)" | cmp -s - $@ || echo "$(TORCH)" > $@

# setup.py builds the fused statistics kernel (src/hookscope/_shared/stats/fused_stats.c) in place.
KERNEL := setup.py src/hookscope/_shared/stats/fused_stats.c

$(VENV)/.installed: pyproject.toml Makefile $(KERNEL) $(VENV)/.torch | $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) "$(TORCH)" -e ".[demo]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml Makefile $(KERNEL) $(VENV)/.torch | $(BIN)/python
	$(PIP) "$(TORCH)"
	$(PIP) "$(TORCH)" -e ".[dev]"
	touch $@

demo: install
	$(BIN)/hookscope demo

# The documentation site, built into docs/_build/html; every page's code cells run, warnings are errors.
$(VENV)/.installed-docs: $(VENV)/.installed-dev
	$(PIP) "$(TORCH)" -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	$(BIN)/python -m sphinx -W --keep-going -q -j auto -b html docs docs/_build/html

lint: install-dev
	$(BIN)/python -m ruff check src tests bench zoo
	$(BIN)/python -m ruff format --check src tests bench zoo
	$(BIN)/python -m mypy

# The zoo sweep: every transformers model type built tiny, given hs.sample_input, run once and
# verified, each in a child process under ZOO_TIMEOUT seconds and ZOO_MEMORY GiB; writes
# docs/zoo/ledger.json and the page docs/zoo.md (tens of minutes on 2 cores). `make zoo-sample`
# runs the ~25 architectures of zoo.tiny.SAMPLE_TYPES in a minute, into docs/zoo/sample.json.
ZOO_JOBS ?= 2
ZOO_TIMEOUT ?= 120
ZOO_MEMORY ?= 6
ZOO_ARGS = --jobs $(ZOO_JOBS) --timeout $(ZOO_TIMEOUT) --memory-gib $(ZOO_MEMORY)

zoo: install-dev
	$(BIN)/python -m zoo.sweep $(ZOO_ARGS) --out docs/zoo/ledger.json

zoo-sample: install-dev
	$(BIN)/python -m zoo.sweep $(ZOO_ARGS) --sample --out docs/zoo/sample.json --page docs/zoo/sample.md

# Debian's Chromium for the report's browser tests (skipped, with a note, where it cannot be installed).
browser:
	bash .ci/install-browser

# The wheel as users get it: `python -m build`, a py3-none-<platform> wheel holding the kernel, installed
# and run in fresh venvs with a C compiler and without one (CC=false); a few minutes (two torch installs).
wheel-check: install-dev
	bash .ci/wheel-check $(BIN)/python "$(TORCH)"

# The suite runs in PYTEST_WORKERS processes (pytest-xdist), a test file's tests in one worker, so
# that a module's shared fixture (a server, an engine) starts once.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

test: lint browser wheel-check docs
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

# The edit-test loop: everything but the tests marked slow (compile, distributed, browser, and
# any test of a second or more); under 90 s on 2 cores. `make test` runs them all.
test-fast: install-dev
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow"

# The whole suite under coverage.py; prints the files below 100% and the total line coverage of
# src/hookscope (code run only in a subprocess the tests start is not counted).
coverage: install-dev
	$(BIN)/python -m coverage erase
	$(BIN)/python -m coverage run -m pytest
	$(BIN)/python -m coverage report --skip-covered --sort=cover
	@echo "Line coverage of src/hookscope: $$($(BIN)/python -m coverage report --format=total)%"

# Every bench/bench_*.py in turn (the list and their arguments are in bench/summary.py), then one table of
# every figure with a target and PASS or MISS. A MISS still exits 0; a script that crashed makes it fail.
bench: install-dev
	$(BIN)/python bench/summary.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info src/hookscope/_shared/_fused_stats*.so src/hookscope/_shared/stats/_fused_stats*.so .pytest_cache .mypy_cache .ruff_cache .hypothesis hookscope-demo docs/_build \
		.coverage .coverage.*
