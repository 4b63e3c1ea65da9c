# Two entry points: `make demo` and `make test`. Both create .venv from scratch if needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The one torch build the project is tested with (a CPU wheel available locally).
TORCH_PIN := torch==2.13.0

.PHONY: demo test check lint bench clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install -q $(TORCH_PIN) -e '.[test]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/trainguard demo

# The browser tests need Debian's chromium: installed here when missing and allowed, else one line.
test: $(VENV)/.test
	@sh .ci/ensure-chromium
	$(VENV)/bin/ruff check trainguard tests benchmarks examples
	$(PY) -m trainguard.capture._native   # builds the native recorder core (cached), or says why not
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30   # two workers, a test file each, slowest files first (tests/conftest.py); the 30 slowest tests listed: see DEVELOPERS.md

lint: $(VENV)/.test
	$(VENV)/bin/ruff check trainguard tests benchmarks examples

bench: $(VENV)/.test
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
