"""The step and store benchmarks run end to end at small sizes, so they cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_step_benchmark_prints_flat_ratios_and_the_session_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_step reports per-size costs, the largest/smallest ratio and the session's hook time."""
    load("bench_step").main(["--sizes", "50,400", "--repeat", "5", "--session", "120"])
    out = capsys.readouterr().out
    assert "ratio 400/50 messages: memory" in out
    assert "hook time / tokenize-once floor" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("50 ", "400 "))]
    assert len(rows) == 2


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
