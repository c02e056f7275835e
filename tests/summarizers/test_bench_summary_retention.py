"""The retention benchmark runs small, plants every fact once, and folds each message at most once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_summary_retention.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_summary_retention", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_session_is_deterministic_and_sized_as_asked() -> None:
    """The same seed builds the same session, of exactly the requested messages and facts."""
    bench = load()
    first = bench.build_session(240, 12)
    assert len(first.messages) == 240
    assert len(first.facts) == 12
    assert first.messages == bench.build_session(240, 12).messages
    kinds = {
        ("tool" if m.role.value == "tool" else "arguments" if m.tool_calls else m.role.value)
        for m in first.messages
        for f in first.facts
        if f in bench._visible(m)
    }
    assert {"user", "tool", "arguments"} <= kinds
    assert len(first.image_urls) == 3
    assert all(any(url.endswith(f"/{fact}.png") for fact in first.facts) for url in first.image_urls)


def test_a_small_run_reports_retention_and_incremental_input(capsys: pytest.CaptureFixture[str]) -> None:
    """Summarizing keeps most facts, far more than the window, and no message reaches the summarizer twice."""
    outcomes = load().main(
        ["--messages", "300", "--facts", "30", "--budget", "4000", "--summary-tokens", "600"]
    )
    summarize, drop = outcomes["summarize"], outcomes["drop"]
    assert summarize.facts == drop.facts == 30
    assert summarize.compactions > 1 and drop.compactions > 1
    assert summarize.retained >= 0.8 * summarize.facts
    assert summarize.retained > 2 * drop.retained
    assert summarize.images == 7 and summarize.images_retained >= 6 > drop.images_retained
    counting = summarize.summarizer
    assert max(counting.sent.values()) == 1
    assert summarize.from_scratch_tokens > counting.message_tokens
    out = capsys.readouterr().out
    assert "compaction + ExtractiveSummarizer" in out and "sliding window (drop)" in out
    assert "summarizer input:" in out
