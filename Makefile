# Kiln: `make run` runs the whole flow on the bundled sample, `make test` the tests.
# `make run` sets up .venv with Kiln's core dependencies only; `make test` adds the dev extras (every optional
# backend, pytest, ruff). A GPU user picks the torch build:
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
CONFIG     ?= examples/tiny.yaml
PYTEST_ARGS ?= -m "not slow"

BIN  := $(VENV)/bin
CORE := $(VENV)/.kiln-core
DEV  := $(VENV)/.kiln-dev

.PHONY: setup setup-dev run test test-all bench wheel clean

setup: $(CORE)
setup-dev: $(DEV)

# Each stamp re-installs only when the project's requirements change. torch first, pinned: an unpinned torch
# would pull a multi-GB CUDA build.
$(CORE): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $@

$(DEV): $(CORE)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt ai2-olmo-core cached-path dataclass-extensions bettermap
	touch $@

run: setup
	$(BIN)/kiln run $(CONFIG)

test: setup-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: setup-dev
	$(BIN)/python -m pytest

bench: setup-dev
	$(BIN)/python -m benchmarks

# dist/kiln_lm-VERSION-py3-none-any.whl: `pip install dist/kiln_lm-*.whl` (after torch) anywhere.
wheel: setup
	$(BIN)/python -m pip wheel -q --no-deps -w dist .

clean:
	rm -rf out .pytest_cache
