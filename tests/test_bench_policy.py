"""The policy benchmark runs end to end at a quarter of its size, so it cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "bench_policy.py"


def test_policy_benchmark_reports_calls_per_100_steps_within_the_amortization_bound() -> None:
    """bench_policy prints summarizer calls per 100 steps and its fold-count assertions hold."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| pinned", "| big_tools"))]
    assert len(rows) == 2
    assert "-> 0 |" in rows[0]  # a head over the target never reaches the summarizer
