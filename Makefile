# Kiln: `make run` runs the whole flow on the bundled sample, `make test` the tests.
# Both set up .venv first. A GPU user picks the torch build:
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
CONFIG     ?= examples/tiny.yaml
PYTEST_ARGS ?= -m "not slow"

BIN   := $(VENV)/bin
STAMP := $(VENV)/.kiln-setup

.PHONY: setup run test test-all bench clean

setup: $(STAMP)

# Re-installs only when the project's requirements change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

run: setup
	$(BIN)/kiln run $(CONFIG)

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m benchmarks

clean:
	rm -rf out .pytest_cache
