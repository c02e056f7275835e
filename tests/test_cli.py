"""The contextfold command: demo, inspect, compact, and one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from contextfold.cli import main


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def demo_thread(output: str) -> str:
    found = re.search(r"thread (demo-\d+)", output)
    assert found, output
    return found.group(1)


def test_demo_runs_a_session_and_prints_the_table(runner: CliRunner, tmp_path: Path) -> None:
    """demo simulates a session on SQLite and prints requests, compactions and token figures."""
    db = tmp_path / "demo.db"
    result = runner.invoke(main, ["demo", "--db", str(db), "--steps", "80", "--budget", "4000"])
    assert result.exit_code == 0, result.output
    for label in (
        "requests",
        "compactions",
        "peak request tokens",
        "mean request tokens",
        "summarizer tokens",
    ):
        assert label in result.output
    assert db.is_file()
    row = re.search(r"compactions\s*│\s*(\d+)", result.output)
    assert row and int(row.group(1)) > 0


def test_demo_draws_a_plot(runner: CliRunner, tmp_path: Path) -> None:
    """demo --plot writes a PNG of request tokens per step."""
    plot = tmp_path / "tokens.png"
    result = runner.invoke(
        main,
        ["demo", "--db", str(tmp_path / "d.db"), "--steps", "30", "--budget", "3000", "--plot", str(plot)],
    )
    assert result.exit_code == 0, result.output
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_inspect_and_manual_recovery(runner: CliRunner, tmp_path: Path) -> None:
    """inspect shows the context and the log; compact --manual-recovery folds the thread to its summary."""
    db = tmp_path / "demo.db"
    thread = demo_thread(runner.invoke(main, ["demo", "--db", str(db), "--steps", "40"]).output)
    shown = runner.invoke(main, ["inspect", str(db), thread])
    assert shown.exit_code == 0, shown.output
    assert "working context" in shown.output and "episodic log" in shown.output
    folded = runner.invoke(main, ["compact", str(db), thread, "--manual-recovery"])
    assert folded.exit_code == 0, folded.output
    assert "manual_recovery" in folded.output
    after = runner.invoke(main, ["inspect", str(db), thread])
    assert "manual_recovery" in after.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "{tmp}/missing.db", "t"], "no database at"),
        (["compact", "{tmp}/missing.db", "t", "--manual-recovery"], "no database at"),
        (["demo", "--summarizer", "openai", "--model", "m", "--base-url", "notaurl"], "base_url"),
        (["demo", "--summarizer", "openai"], "--model"),
    ],
)
def test_errors_are_one_clear_line(runner: CliRunner, tmp_path: Path, args: list[str], message: str) -> None:
    """Bad input exits non-zero with one line that names the problem."""
    result = runner.invoke(main, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_unknown_thread_is_an_error(runner: CliRunner, tmp_path: Path) -> None:
    """inspect of a thread the database does not hold says so and exits non-zero."""
    db = tmp_path / "demo.db"
    runner.invoke(main, ["demo", "--db", str(db), "--steps", "5"])
    result = runner.invoke(main, ["inspect", str(db), "no-such-thread"])
    assert result.exit_code == 1
    assert "no thread 'no-such-thread'" in result.output


def test_missing_provider_key_is_an_error(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official Anthropic endpoint without a key is refused with the variable to set."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    result = runner.invoke(main, ["demo", "--summarizer", "anthropic", "--model", "claude-x"])
    assert result.exit_code == 1
    assert "ANTHROPIC_API_KEY" in result.output


def test_demo_with_an_openai_compatible_server(runner: CliRunner, tmp_path: Path, httpserver: Any) -> None:
    """demo --summarizer openai --base-url sends its summaries to that server and uses its replies."""
    requests: list[dict[str, Any]] = []

    def reply(request: Any) -> Any:
        from werkzeug import Response

        requests.append(json.loads(request.get_data(as_text=True)))
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "local-model",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "SUMMARY-OK"},
                }
            ],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050},
        }
        return Response(json.dumps(body), content_type="application/json")

    httpserver.expect_request("/v1/chat/completions", method="POST").respond_with_handler(reply)
    db = tmp_path / "demo.db"
    args = ["demo", "--db", str(db), "--steps", "40", "--budget", "3000", "--summarizer", "openai"]
    args += ["--model", "local-model", "--base-url", httpserver.url_for("/v1")]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert requests and all(r["model"] == "local-model" for r in requests)
    row = re.search(r"summarizer tokens\s*│\s*([\d,]+)", result.output)
    assert row and int(row.group(1).replace(",", "")) == 1050 * len(requests)
    thread = demo_thread(result.output)
    shown = runner.invoke(main, ["inspect", str(db), thread, "--no-replay"])
    assert "SUMMARY-OK" in shown.output
