# Every target sets up its own virtual environment from pyproject.toml, so the
# two README commands work on a fresh machine with nothing installed by hand.
# The versions are constraints.txt's exact ones (pyproject.toml has ranges), and
# every extra: Spark for `make run`, the tools for `make test`, the peers for bench.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-stamp
BIN    := $(VENV)/bin

.PHONY: setup run test lint typecheck unit bench clean

$(STAMP): pyproject.toml constraints.txt setup.py src/headgate/log/_frame_writer.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,bench,spark]'
	touch $(STAMP)

setup: $(STAMP)

# The main job on its embedded defaults (see README).
run: $(STAMP)
	$(BIN)/headgate run

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

# The whole suite: lint, types, tests.
test: lint typecheck unit

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
