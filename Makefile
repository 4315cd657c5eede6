# Two commands do all set-up on a fresh machine with only Python 3.10+:
#   make demo   runs the built-in example end to end (CPU when there is no GPU)
#   make test   checks the code with ruff and the typed modules with mypy, and runs the whole test suite (two
#               pytest workers)
# Each creates ./.venv on first use and installs cryorefine into it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) demo_out
