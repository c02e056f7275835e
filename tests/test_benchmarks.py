"""The step and store benchmarks run end to end at small sizes, so they cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType

import pytest

from contextfold.tokens import TiktokenCounter

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"

# The LangChain rows need the bench extra; make test installs only dev.
HAS_LANGCHAIN = find_spec("langchain") is not None
HAS_LANGGRAPH = (
    find_spec("langgraph.checkpoint.sqlite") is not None
    and find_spec("langgraph.checkpoint.postgres") is not None
)


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_step_benchmark_prints_flat_ratios_and_the_whole_session_table(
    capsys: pytest.CaptureFixture[str], postgres_url: str
) -> None:
    """bench_step reports per-size costs, the largest/smallest ratio and a median session row per run."""
    session = ["--session", "60", "--session-repeat", "2"]
    load("bench_step").main(["--sizes", "50,400", "--repeat", "5", *session, "--postgres-url", postgres_url])
    out = capsys.readouterr().out
    assert "ratio 400/50 messages: memory" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("50 ", "400 "))]
    assert len(rows) == 2
    assert "2 runs each, the rows taking turns" in out
    counting = TiktokenCounter().backend  # rs-bpe with the dev extras, but past Python 3.13
    assert f"contextfold counts with {counting} unless the row says otherwise" in out
    with_tiktoken = ["contextfold memory, tiktoken counting", "contextfold sqlite NORMAL, tiktoken counting"]
    assert all((run in out) == (counting == "rs-bpe") for run in with_tiktoken)
    for run in (
        "contextfold memory",
        "contextfold sqlite FULL",
        "contextfold sqlite NORMAL",
        "contextfold postgres",
        *(with_tiktoken if counting == "rs-bpe" else []),
        "langchain, state in memory",
        "langgraph, SqliteSaver",
        "langgraph, PostgresSaver",
    ):
        line = next(line for line in out.splitlines() if line.startswith(run))
        fields = line[len(run) :].split()
        ratio, floor_ms, single = float(fields[0]), float(fields[1]), fields[-1]
        assert ratio > 0 and floor_ms >= 0
        low, high = (float(part) for part in single.split("-"))
        # The row is one of its runs: its ratio lies in their range (all three rounded to 0.1).
        assert 0 < low <= ratio <= high, line


def test_step_benchmark_rows_are_the_run_with_the_median_ratio_to_its_own_floor() -> None:
    """median_of: each run against the floors around it; the middle ratio stands, with the range kept."""
    bench = load("bench_step")
    fastest = bench.SessionRow("r", hook=0.5, append=1.0, context=0.5, folds=3)  # 2.0 s
    middle = bench.SessionRow("r", hook=1.0, append=1.5, context=0.5, folds=3)  # 3.0 s
    slowest = bench.SessionRow("r", hook=1.0, append=2.0, context=1.0, folds=3)  # 4.0 s
    # Each run's floor is the mean of the two around it: 0.4, 1.0 and 2.0 seconds.
    runs = [replace(fastest, floor=0.4), replace(middle, floor=1.0), replace(slowest, floor=2.0)]
    row = bench.median_of(runs)
    # Ratios 5.0, 3.0 and 2.0: the median is the middle run's own, not the fastest run's.
    assert (row.hook, row.append, row.context, row.floor) == (1.0, 1.5, 0.5, 1.0)
    assert row.ratio == pytest.approx(3.0)
    assert row.spread == (pytest.approx(2.0), pytest.approx(5.0))


def test_agents_benchmark_reports_latency_and_loop_lag_per_backend(
    capsys: pytest.CaptureFixture[str], postgres_url: str
) -> None:
    """bench_agents prints steps/s, hook percentiles and loop lag for each backend, with folds run."""
    status = load("bench_agents").main(
        ["--agents", "4", "--steps", "40", "--model-ms", "1", "--postgres-url", postgres_url]
    )
    out = capsys.readouterr().out
    assert status == 0
    for backend in ("memory", "sqlite", "postgres"):
        runs = [(b, load) for b in (backend, f"{backend} +freeze") for load in ("saturated", "paced")]
        for label in (f"{b} {load}" for b, load in runs):
            cells = next(line for line in out.splitlines() if line.startswith(f"{label} ")).split()
            cells = cells[len(label.split()) :]
            assert len(cells) == 8 and float(cells[0]) > 0 and int(cells[7]) > 0


def test_store_benchmark_covers_every_backend(capsys: pytest.CaptureFixture[str], postgres_url: str) -> None:
    """bench_stores measures every backend, prints the size ratios and a fold burst with no errors."""
    argv = ["--sizes", "300,600", "--postgres-url", postgres_url, "--burst", "5", "--burst-sleep", "0.05"]
    status = load("bench_stores").main(argv)
    captured = capsys.readouterr()
    assert status == 0
    assert "skipped" not in captured.err
    for backend in ("memory", "sqlite", "sqlite-normal", "postgres"):
        assert f"{backend} " in captured.out
        assert f"{backend} 600/300 ratio:" in " ".join(captured.out.split())
    bursts = [line for line in captured.out.splitlines() if "burst of 5 folds" in line]
    assert len(bursts) == 4 and all("errors 0," in line for line in bursts)


def test_prefix_benchmark_compares_contextfold_with_langchain(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_prefix prints the reused-prefix share of both runs on the same session."""
    status = load("bench_prefix").main(["--session", "120"])
    out = capsys.readouterr().out
    assert status == 0
    for run in ["contextfold"] + (["langchain SummarizationMiddleware"] if HAS_LANGCHAIN else []):
        line = next(line for line in out.splitlines() if line.startswith(run + " "))
        assert 0 < float(line[len(run) :].split()[0].rstrip("%")) <= 100
