# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs by itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: test demo lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

test: lint typecheck
	$(BIN)/pytest --cov=contextfold --cov-branch --cov-report=term:skip-covered

demo: $(STAMP)
	$(BIN)/contextfold demo

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/bench_tokens.py
	$(BIN)/python benchmarks/bench_stores.py
	$(BIN)/python benchmarks/bench_summary_retention.py
	$(BIN)/python benchmarks/bench_step.py
	$(BIN)/python benchmarks/bench_agents.py
	$(BIN)/python benchmarks/bench_prefix.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
