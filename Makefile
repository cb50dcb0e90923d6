# The README's two commands:  `make demo` (run the main job) and `make test`.
# Both set up everything they need in ./.venv first, once (re-done when
# pyproject.toml or this file changes). Run them as root: the emulated
# cluster is made of network namespaces and qdiscs.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch is installed before gradlane's own requirements, so
# that the shim extra's torch range is already satisfied and pip never pulls a
# multi-GB CUDA build. On a machine that has no CPU wheel at hand, point pip
# at PyTorch's CPU wheel index with TORCH_PIP_ARGS='--index-url <url>'.
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.gradlane-installed

.PHONY: help setup demo test lint sysdeps clean-testbed

help:
	@echo "make demo           run the main job (needs root)"
	@echo "make test           lint and run the whole test suite (needs root for namespace tests)"
	@echo "make setup          only create .venv and install gradlane with its extras"
	@echo "make clean-testbed  remove emulated clusters left by a crashed run"

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile | sysdeps
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "gradlane needs Python >= 3.11, found " + sys.version.split()[0]'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[shim,control,bench,dev]'
	touch $@

# iproute2 gives tests an independent look at the kernel (`ip`, `tc`);
# procps gives `pgrep`. Installed with apt when missing and possible.
sysdeps:
	@missing=""; for tool in ip tc pgrep systemd-analyze; do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing iproute2 procps systemd (missing:$$missing)"; \
	    apt-get update -qq && apt-get install -y -qq iproute2 procps systemd >/dev/null; \
	  else \
	    echo "missing commands:$$missing; install iproute2, procps and systemd"; exit 1; \
	  fi; \
	fi

demo: $(STAMP)
	$(BIN)/gradlane demo

# The tests in two runs: those that need no namespace share the cores (pytest-xdist, a
# worker per core up to 4); then the namespace tests, one at a time and alone on the
# machine, as their emulated links and their speed checks need. Both runs always run; the
# target fails if either did.
test: $(STAMP)
	$(BIN)/ruff check .
	PYTHON=$(BIN)/python scripts/typecheck
	@status=0; \
	echo "== the tests without namespaces, in parallel"; \
	$(BIN)/python -m pytest -m 'not netns' -n auto --maxprocesses 4 --dist worksteal || status=1; \
	echo "== the namespace tests, one at a time"; \
	$(BIN)/python -m pytest -m netns || status=1; \
	exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	PYTHON=$(BIN)/python scripts/typecheck

clean-testbed: $(STAMP)
	$(BIN)/gradlane testbed clean
