# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs by itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
CLI_STAMP := $(VENV)/.installed-cli

.PHONY: test demo lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The demo needs only the command's own extra and the fast counter, not the development tools.
$(CLI_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[cli,fast]'
	touch $(CLI_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

# The suite includes tests/test_wheel.py: it builds the wheel and sdist, installs the
# wheel into a fresh virtual environment and runs the command from there.
test: lint typecheck
	$(BIN)/pytest --cov=contextfold --cov-branch --cov-report=term:skip-covered

demo: $(CLI_STAMP)
	$(BIN)/contextfold demo

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/bench_tokens.py
	$(BIN)/python benchmarks/bench_stores.py
	$(BIN)/python benchmarks/bench_summary_retention.py
	$(BIN)/python benchmarks/bench_step.py
	$(BIN)/python benchmarks/bench_agents.py
	$(BIN)/python benchmarks/bench_policy.py
	$(BIN)/python benchmarks/bench_background.py
	$(BIN)/python benchmarks/bench_prefix.py
	$(BIN)/python benchmarks/bench_import.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
