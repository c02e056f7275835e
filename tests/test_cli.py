"""The installed ``contextfold`` command on SQLite and PostgreSQL: demo, threads, inspect, compact."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from contextfold._compactor import CompactionResult, Compactor
from contextfold._episodes import EpisodeRecord, SummaryCheckpoint, UserMessageEpisode, conversation
from contextfold._messages import Message, Role, ToolCall
from contextfold._tokens import TiktokenCounter
from contextfold.cli import CLI_EXTRA_HINT, redact_url
from contextfold.stores import PostgresStore, SQLiteStore

COMMAND = Path(sys.executable).with_name("contextfold")


def cli(*args: str, tmp: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed console script, wide enough that rich cuts no line of a summary."""
    env = {**os.environ, "COLUMNS": "1000", "NO_COLOR": "1"}
    env.pop("OPENAI_API_KEY", None)
    env.pop("ANTHROPIC_API_KEY", None)
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return subprocess.run(
        [str(COMMAND), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def row(output: str, label: str) -> int:
    found = re.search(rf"{label}\s*│\s*([\d,]+)", output)
    assert found, output
    return int(found.group(1).replace(",", ""))


async def records(db: Path, thread: str) -> list[EpisodeRecord]:
    async with SQLiteStore(db) as store:
        return [record async for record in store.replay(thread)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def chat_reply(text: str) -> Response:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "local-model",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 50, "total_tokens": 1050},
    }
    return Response(json.dumps(body), content_type="application/json")


def serve(httpserver: HTTPServer, handler: Callable[[Request], Response]) -> list[dict[str, Any]]:
    """Answer chat completions with ``handler``; return the request bodies as they arrive."""
    seen: list[dict[str, Any]] = []

    def record(request: Request) -> Response:
        seen.append(json.loads(request.get_data(as_text=True)))
        return handler(request)

    httpserver.expect_request("/v1/chat/completions", method="POST").respond_with_handler(record)
    return seen


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 120-step demo thread 't', read by the inspect tests and copied by ``thread_db``."""
    db = tmp_path_factory.mktemp("demo") / "demo.db"
    ok(cli("demo", "--db", str(db), "--thread", "t", "--steps", "120", "--budget", "6000"))
    return db


@pytest.fixture
def thread_db(demo_db: Path, tmp_path: Path) -> Path:
    """A copy of ``demo_db`` of the test's own, to change."""
    for path in demo_db.parent.glob("demo.db*"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / "demo.db"


def test_demo_defaults_to_a_temporary_file_it_names(tmp_path: Path) -> None:
    """demo without --db writes to a new temporary file and prints its path."""
    out = ok(cli("demo", "--steps", "30", "--budget", "3000", tmp=tmp_path))
    db, thread = written(out)
    assert db.parent == tmp_path and db.is_file()
    assert row(out, "compactions") > 0 and row(out, "degraded summaries") == 0
    kinds = [r.episode.kind for r in await_records(db, thread)]
    assert kinds.count("summary_checkpoint") == row(out, "compactions")


def written(output: str) -> tuple[Path, str]:
    """The store and thread a demo run says it wrote."""
    found = re.search(r"inspect it: contextfold inspect (\S+) (\S+)", output)
    assert found, output
    return Path(found.group(1).removeprefix("sqlite:///")), found.group(2)


def await_records(db: Path, thread: str) -> list[EpisodeRecord]:
    import anyio

    return anyio.run(records, db, thread)


def test_two_demo_runs_write_two_threads(tmp_path: Path) -> None:
    """Each demo run on one store writes a thread of its own."""
    db = tmp_path / "d.db"
    first = ok(cli("demo", "--db", f"sqlite:///{db}", "--steps", "5"))
    second = ok(cli("demo", "--db", f"sqlite:///{db}", "--steps", "5"))
    names = [written(out)[1] for out in (first, second)]
    assert names[0] != names[1]
    assert all(await_records(db, name) for name in names)


def test_demo_on_an_existing_thread_continues_it(tmp_path: Path) -> None:
    """A second demo run on one thread follows the first run's messages, with one system prompt, at 0."""
    db = tmp_path / "d.db"
    ok(cli("demo", "--db", str(db), "--thread", "t", "--steps", "5"))
    first = conversation(await_records(db, "t"))
    ok(cli("demo", "--db", str(db), "--thread", "t", "--steps", "5"))
    log = conversation(await_records(db, "t"))
    assert [i for i, m in enumerate(log) if m.role is Role.SYSTEM] == [0]
    assert log[: len(first)] == first and log[len(first)].role is Role.USER
    ids = [call.id for m in log for call in m.tool_calls]
    assert ids and len(set(ids)) == len(ids)  # the second run's calls are numbered after the first's


def test_demo_on_an_existing_thread_counts_its_history_without_compaction(tmp_path: Path) -> None:
    """On a continued thread the 'without' column counts the history the log held, as the table says."""
    db = tmp_path / "d.db"
    ok(cli("demo", "--db", str(db), "--thread", "t", "--steps", "5", "--budget", "100000"))
    earlier = conversation(await_records(db, "t"))
    out = ok(cli("demo", "--db", str(db), "--thread", "t", "--steps", "5", "--budget", "100000"))
    tokens = sum(TiktokenCounter().count(m) for m in earlier)
    assert f"thread t held {len(earlier)} messages ({tokens:,} tokens) before this run" in out
    # No fold: every request as sent was the whole history, and 'without' must say the same.
    assert row(out, "compactions") == 0
    for label in ("peak request tokens", "mean request tokens", "total request tokens"):
        found = re.search(rf"{label}\s*│\s*([\d,]+)\s*│\s*([\d,]+)", out)
        assert found and found.group(1) == found.group(2), out
    assert row(out, "peak request tokens") > tokens


def test_inspect_pages_the_context_and_the_log(demo_db: Path) -> None:
    """inspect shows the newest 20 rows of each by default, --last N the newest N, --full all of them."""
    window, log = anyio_run_load(demo_db, "t")
    default = ok(cli("inspect", str(demo_db), "t"))
    assert f"the last 20 of {len(log)} episodes" in default
    assert _log_seqs(default) == [r.seq for r in log[-20:]]
    three = ok(cli("inspect", str(demo_db), "t", "--last", "3"))
    assert _log_seqs(three) == [r.seq for r in log[-3:]]
    assert f"the last 3 of {len(window)} messages" in three
    full = ok(cli("inspect", str(demo_db), "t", "--full"))
    assert _log_seqs(full) == [r.seq for r in log]
    assert "--full for more" not in full
    assert len(default.splitlines()) * 5 < len(full.splitlines())


def _log_seqs(output: str) -> list[int]:
    log = output[output.index("episodic log of") :]
    return [int(m.group(1)) for m in re.finditer(r"^│\s*(\d+)\s*│ \d{4}-", log, flags=re.M)]


def anyio_run_load(db: Path, thread: str) -> tuple[list[Any], list[EpisodeRecord]]:
    import anyio

    async def read() -> tuple[list[Any], list[EpisodeRecord]]:
        async with SQLiteStore(db) as store:
            window = await store.load(thread)
            return list(window.messages), [r async for r in store.replay(thread)]

    return anyio.run(read)


def test_inspect_json_is_what_the_store_holds(demo_db: Path) -> None:
    """inspect --json --full prints the whole working context and log exactly as stored."""
    window, log = anyio_run_load(demo_db, "t")
    document = json.loads(ok(cli("inspect", str(demo_db), "t", "--json", "--full")))
    assert document["context"]["messages"] == [m.model_dump(mode="json") for m in window]
    assert document["log"]["records"] == [r.model_dump(mode="json") for r in log]
    paged = json.loads(ok(cli("inspect", str(demo_db), "t", "--json", "--last", "2")))
    assert [m["seq"] for m in paged["context"]["messages"]] == [m.seq for m in window[-2:]]
    assert paged["log"]["episodes"] == len(log)


def test_inspect_shows_summaries_whole(demo_db: Path) -> None:
    """The working context's summary and the newest checkpoint's summary appear line for line, uncut."""
    window, log = anyio_run_load(demo_db, "t")
    out = ok(cli("inspect", str(demo_db), "t", "--last", str(len(window))))
    summary = next(m.message for m in window if m.message.is_summary)
    checkpoint = [r.episode for r in log if isinstance(r.episode, SummaryCheckpoint)][-1]
    assert len(summary.text) > 200
    for text in (summary.text, checkpoint.summary):
        for line in filter(None, (line.strip() for line in text.splitlines())):
            assert line in out


async def test_inspect_names_the_log_seqs_a_checkpoint_covers(tmp_path: Path) -> None:
    """A checkpoint row shows the log seqs it covers beside its context seqs, or says they are unknown."""
    db = tmp_path / "c.db"
    async with SQLiteStore(db) as store:
        await store.record("t", UserMessageEpisode(message=Message.user("hello")))
        for log_seqs in ((1, 9), (None, None)):
            checkpoint = SummaryCheckpoint(
                trigger="context_pressure",
                from_seq=2,
                through_seq=7,
                summary="FIRST LINE\nSECOND LINE",
                log_from_seq=log_seqs[0],
                log_through_seq=log_seqs[1],
            )
            await store.record("t", checkpoint)
    out = ok(cli("inspect", str(db), "t"))
    assert "log seqs 1..9 (context seqs 2..7)" in out
    assert "log seqs not recorded (context seqs 2..7)" in out
    assert "FIRST LINE" in out and "SECOND LINE" in out


def test_compact_twice_reports_one_true_stall_and_fails(thread_db: Path) -> None:
    """A second compact of a folded thread fails with one line saying its tokens are within the budget."""
    db = thread_db
    first = cli("compact", str(db), "t", "--manual-recovery")
    assert "manual_recovery" in ok(first)
    kinds = [r.episode.kind for r in await_records(db, "t")]
    assert kinds[-2:] == ["summary_checkpoint", "manual_recovery"]
    second = cli("compact", str(db), "t")
    assert second.returncode == 1
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert "nothing to fold in 't'" in lines[0] and "within the 12,000-token --budget" in lines[0]
    assert "checks skipped" not in second.stderr + second.stdout
    assert [r.episode.kind for r in await_records(db, "t")] == kinds


def test_compact_uses_the_summarizer_options(thread_db: Path, httpserver: HTTPServer) -> None:
    """compact --summarizer openai --model --base-url folds with that server's summary."""
    db = thread_db
    seen = serve(httpserver, lambda request: chat_reply("SERVER-SUMMARY"))
    out = ok(
        cli(
            "compact", str(db), "t", "--manual-recovery", "--summarizer", "openai",
            "--model", "local-model", "--base-url", httpserver.url_for("/v1"),
        )
    )  # fmt: skip
    assert "manual_recovery" in out
    assert [body["model"] for body in seen] == ["local-model"]
    checkpoint = [r.episode for r in await_records(db, "t") if isinstance(r.episode, SummaryCheckpoint)][-1]
    assert checkpoint.summary == "SERVER-SUMMARY" and checkpoint.model == "local-model"


def test_compact_with_a_failing_summarizer_exits_non_zero(thread_db: Path) -> None:
    """compact whose summarizer is unreachable applies a degraded fold and exits 1 saying so."""
    db = thread_db
    result = cli(
        "compact", str(db), "t", "--manual-recovery", "--summarizer", "openai", "--model", "m",
        "--base-url", f"http://127.0.0.1:{free_port()}/v1",
    )  # fmt: skip
    assert result.returncode == 1
    assert "fell back to the offline summarizer" in result.stderr
    checkpoint = [r.episode for r in await_records(db, "t") if isinstance(r.episode, SummaryCheckpoint)][-1]
    assert checkpoint.degraded and checkpoint.trigger == "manual_recovery"


def test_demo_with_nothing_listening_fails_fast(tmp_path: Path) -> None:
    """demo whose summarizer endpoint refuses connections stops at the first fold, in a few lines, exit 1."""
    started = time.monotonic()
    result = cli(
        "demo", "--db", str(tmp_path / "d.db"), "--summarizer", "openai", "--model", "llama3.1",
        "--base-url", f"http://127.0.0.1:{free_port()}/v1",
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert elapsed < 20
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 4, result.stderr
    assert "stopped after" in lines[-1] and "--base-url" in lines[-1]
    assert "Traceback" not in result.stderr


def test_demo_without_db_that_stops_early_names_its_temporary_file(tmp_path: Path) -> None:
    """Stopped at the first fold, demo names the temporary file it wrote: none is left behind unknown."""
    result = cli(
        "demo", "--summarizer", "openai", "--model", "llama3.1",
        "--base-url", f"http://127.0.0.1:{free_port()}/v1", tmp=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith("contextfold-demo-"), left
    last = result.stderr.strip().splitlines()[-1]
    assert "stopped after" in last
    assert last.endswith(f"; its store is the temporary file {left[0]}: delete it when done")
    kinds = [r.episode.kind for r in await_records(left[0], thread_of(left[0]))]
    assert kinds.count("summary_checkpoint") == 1


def test_demo_without_db_stopped_by_ctrl_c_names_its_temporary_file(
    tmp_path: Path, httpserver: HTTPServer
) -> None:
    """Ctrl-C while the first summary is on its way: demo says where its temporary store is."""
    asked = threading.Event()

    def hangs(request: Request) -> Response:
        asked.set()
        time.sleep(5)
        return chat_reply("late")

    serve(httpserver, hangs)
    env = {**os.environ, "COLUMNS": "1000", "NO_COLOR": "1", "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen(
        [str(COMMAND), "demo", "--summarizer", "openai", "--model", "m", "--api-key", "k",
         "--base-url", httpserver.url_for("/v1")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert asked.wait(60)
    demo.send_signal(signal.SIGINT)
    _, stderr = demo.communicate(timeout=30)
    assert demo.returncode != 0
    (left,) = tmp_path.iterdir()
    assert f"contextfold demo: its store is the temporary file {left}: delete it when done" in stderr


def thread_of(db: Path) -> str:
    """The one thread a SQLite store file holds."""
    with sqlite3.connect(db) as conn:
        ((thread,),) = conn.execute("SELECT thread FROM threads").fetchall()
    return str(thread)


def test_demo_counts_degraded_summaries(tmp_path: Path, httpserver: HTTPServer) -> None:
    """A server that answers the first summary and then fails shows the degraded count the log holds."""
    calls: list[int] = []

    def flaky(request: Request) -> Response:
        calls.append(1)
        return chat_reply("SUMMARY-OK") if len(calls) == 1 else Response("bad request", status=400)

    serve(httpserver, flaky)
    db = tmp_path / "d.db"
    result = cli(
        "demo", "--db", str(db), "--thread", "t", "--steps", "60", "--budget", "4000",
        "--summarizer", "openai", "--model", "local-model", "--base-url", httpserver.url_for("/v1"),
    )  # fmt: skip
    out = ok(result)
    degraded = [
        r.episode.degraded for r in await_records(db, "t") if isinstance(r.episode, SummaryCheckpoint)
    ]
    assert degraded[0] is False and sum(degraded) > 0
    assert row(out, "degraded summaries") == sum(degraded)
    assert row(out, "compactions") == len(degraded)
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr


def test_demo_whose_every_summary_degraded_exits_non_zero(tmp_path: Path, httpserver: HTTPServer) -> None:
    """A server that rejects every summary request makes demo exit 1 after the first fold."""
    serve(httpserver, lambda request: Response("no such model", status=404))
    db = tmp_path / "d.db"
    result = cli(
        "demo", "--db", str(db), "--thread", "t", "--summarizer", "openai", "--model", "nope",
        "--base-url", httpserver.url_for("/v1"),
    )  # fmt: skip
    assert result.returncode == 1
    checkpoints = [r.episode for r in await_records(db, "t") if isinstance(r.episode, SummaryCheckpoint)]
    assert [c.degraded for c in checkpoints] == [True]


def test_demo_with_an_openai_compatible_server(tmp_path: Path, httpserver: HTTPServer) -> None:
    """demo --summarizer openai --base-url sends its summaries to that server and counts their tokens."""
    seen = serve(httpserver, lambda request: chat_reply("SUMMARY-OK"))
    db = tmp_path / "d.db"
    out = ok(
        cli(
            "demo", "--db", str(db), "--thread", "t", "--steps", "40", "--budget", "3000",
            "--summarizer", "openai", "--model", "local-model", "--base-url", httpserver.url_for("/v1"),
        )
    )  # fmt: skip
    assert seen and all(body["model"] == "local-model" for body in seen)
    assert row(out, "summarizer tokens") == 1050 * len(seen)
    assert row(out, "degraded summaries") == 0
    assert "SUMMARY-OK" in ok(cli("inspect", str(db), "t", "--no-log"))


@pytest.mark.parametrize(
    ("args", "code", "wanted", "unwanted"),
    [
        (["inspect", "{tmp}/missing.db", "t"], 1, "no database at", ""),
        (["compact", "{tmp}/missing.db", "t"], 1, "no database at", ""),
        (["inspect", "mysql://host/db", "t"], 1, "unsupported scheme 'mysql'", ""),
        (["demo", "--summarizer", "openai"], 2, "--model gpt-4o-mini", "claude"),
        (["demo", "--summarizer", "anthropic"], 2, "--model claude-haiku-4-5", "gpt"),
        (["demo", "--summarizer", "anthropic", "--model", "claude-haiku-4-5"], 2, "--api-key", "api_key="),
        (["demo", "--summarizer", "anthropic", "--model", "claude-haiku-4-5"], 2, "ANTHROPIC_API_KEY", ""),
        (["compact", "x.db", "t", "--summarizer", "openai", "--model", "gpt-4o"], 2, "--api-key", "api_key"),
        (["demo", "--summarizer", "openai", "--model", "m", "--base-url", "x"], 2, "--base-url", "base_url"),
        (["demo", "--model", "gpt-4o-mini"], 2, "--model applies only to --summarizer openai", ""),
        (["compact", "x.db", "t", "--base-url", "http://x"], 2, "--base-url applies only", ""),
    ],
)  # fmt: skip
def test_errors_are_one_line_that_names_the_flag(
    tmp_path: Path, args: list[str], code: int, wanted: str, unwanted: str
) -> None:
    """Bad input exits non-zero with one error line naming the flag to fix, never a traceback."""
    result = cli(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert result.returncode == code, result.stderr
    error = result.stderr.splitlines()
    assert len(error) == 1 and error[0].startswith("Error:") and wanted in error[0], result.stderr
    assert not unwanted or unwanted not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["compact", "x.db", "t", "--summarizer", "anthropic", "--model", "claude-haiku-4-5"],
            "Error: --summarizer anthropic at https://api.anthropic.com needs an API key: pass --api-key or "
            "set ANTHROPIC_API_KEY (a local server given with --base-url may need none)",
        ),
        (
            ["demo", "--summarizer", "openai", "--model", "m", "--base-url", "notaurl"],
            "Error: --base-url 'notaurl' is not an http(s) URL; use one such as http://127.0.0.1:11434/v1 "
            "(a local server) or https://api.openai.com/v1",
        ),
        (
            ["demo", "--summarizer", "anthropic"],
            "Error: --summarizer anthropic needs --model, for example --model claude-haiku-4-5",
        ),
    ],
    ids=["missing-key", "bad-base-url", "missing-model"],
)
def test_a_flag_the_command_cannot_use_is_one_line_without_the_usage_block(
    args: list[str], line: str
) -> None:
    """A missing key, bad --base-url or missing --model is one line naming the flag, exit 2, no usage."""
    result = cli(*args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line]


def test_a_command_line_click_cannot_parse_keeps_the_usage_block() -> None:
    """An unknown option still gets click's usage block and exit 2."""
    result = cli("demo", "--no-such-flag")
    assert result.returncode == 2
    assert result.stderr.startswith("Usage: contextfold demo [OPTIONS]")
    assert result.stderr.splitlines()[-1].startswith("Error: No such option")


_BELOW_THE_LEAST = re.compile(
    r"Error: --budget (\d+) is below (\d+), the least that works: a summary gets a quarter of --budget, "
    r"and the offline summarizer \(which also stands in when openai or anthropic fails\) needs \d+ tokens "
    r"for its section headings; use --budget \2 or more"
)


def least_budget() -> int:
    """The least --budget, as the error for a smaller one offers it."""
    found = _BELOW_THE_LEAST.fullmatch(cli("demo", "--budget", "1").stderr.strip())
    assert found, "no least --budget offered"
    return int(found.group(2))


@pytest.mark.parametrize(
    "summarizer",
    [[], *(["--summarizer", kind, "--model", "m", "--api-key", "k"] for kind in ("openai", "anthropic"))],
    ids=["extractive", "openai", "anthropic"],
)
def test_demo_below_the_least_budget_is_one_line_and_creates_no_store(
    tmp_path: Path, summarizer: list[str]
) -> None:
    """demo --budget under the least that works names --budget, it and that least, exits 2, writes no file."""
    least = least_budget()
    db = tmp_path / "d.db"
    for budget in (4, 100, least - 1):
        result = cli(
            "demo", "--db", str(db), "--steps", "3", "--budget", str(budget), *summarizer, tmp=tmp_path
        )
        assert result.returncode == 2, result.stdout + result.stderr
        found = _BELOW_THE_LEAST.fullmatch(result.stderr.strip())
        assert found and found.group(1) == str(budget) and int(found.group(2)) == least, result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert list(tmp_path.iterdir()) == []
    # Without --db the demo writes to a temporary file of its own: none is left either.
    result = cli("demo", "--steps", "3", "--budget", "100", *summarizer, tmp=tmp_path)
    assert result.returncode == 2 and list(tmp_path.iterdir()) == []
    assert "Traceback" not in result.stderr


def test_compact_below_the_least_budget_is_one_line_and_leaves_the_store_alone(thread_db: Path) -> None:
    """compact --budget under the least that works names both in one line and leaves the store as it was."""
    least = least_budget()
    files = sorted(thread_db.parent.iterdir())
    before = [hashlib.sha256(path.read_bytes()).hexdigest() for path in files]
    result = cli("compact", str(thread_db), "t", "--budget", "100")
    assert result.returncode == 2, result.stdout + result.stderr
    found = _BELOW_THE_LEAST.fullmatch(result.stderr.strip())
    assert found and found.group(1) == "100" and int(found.group(2)) == least, result.stderr
    assert sorted(thread_db.parent.iterdir()) == files
    assert [hashlib.sha256(path.read_bytes()).hexdigest() for path in files] == before


def test_the_least_budget_runs_a_demo_and_a_compact(tmp_path: Path) -> None:
    """The least --budget the help and the error name runs a demo whose folds all succeed, and a compact."""
    least = least_budget()
    assert f"[default: 12000; x>={least}]" in " ".join(ok(cli("demo", "--help")).split())
    assert f"[default: 12000; x>={least}]" in " ".join(ok(cli("compact", "--help")).split())
    db = tmp_path / "d.db"
    out = ok(cli("demo", "--db", str(db), "--thread", "t", "--steps", "80", "--budget", str(least)))
    assert row(out, "compactions") > 0 and row(out, "degraded summaries") == 0
    folded = ok(cli("compact", str(db), "t", "--budget", str(least), "--manual-recovery"))
    assert folded.startswith("compacted 't' (manual_recovery): ")


@pytest.mark.parametrize("given", [True, False], ids=["db", "temporary"])
def test_demo_builds_its_compactor_before_it_creates_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: bool
) -> None:
    """A setting the Compactor refuses fails demo in one line naming --budget before any store file exists."""
    import tempfile

    from click.testing import CliRunner

    from contextfold import RunOptions, SummarizeOptions, _cli

    def refused(budget: int) -> RunOptions:  # a summary too small for the offline summarizer's headings
        compaction = SummarizeOptions(trigger_token_budget=budget, max_summary_tokens=1)
        return RunOptions(max_history_tokens=budget * 2, compaction=compaction)

    monkeypatch.setattr(_cli, "_options", refused)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    db = ["--db", str(tmp_path / "d.db")] if given else []
    result = CliRunner().invoke(_cli.app, ["demo", "--steps", "3", *db])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: --budget 12000: compaction.max_summary_tokens=1: ")
    assert len(result.output.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_unknown_thread_is_an_error(demo_db: Path) -> None:
    """inspect of a thread the store does not hold says so, points at threads, and exits 1."""
    result = cli("inspect", str(demo_db), "no-such-thread")
    assert result.returncode == 1
    assert "no thread 'no-such-thread'" in result.stderr and "contextfold threads" in result.stderr


def test_summarizer_option_has_help() -> None:
    """demo --help describes --summarizer and each of its choices."""
    out = ok(cli("demo", "--help"))
    text = " ".join(out.split())
    assert "--summarizer [extractive|openai|anthropic]" in text
    assert "Who writes the summaries" in text


def test_without_the_cli_extra_the_command_prints_the_install_hint() -> None:
    """The entry point without click installed prints one line naming contextfold[cli] and exits 1."""
    code = "import sys; sys.modules['click'] = None; from contextfold.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == CLI_EXTRA_HINT
    assert "pip install 'contextfold[cli]'" in CLI_EXTRA_HINT


def test_demo_plot_uses_a_log_axis_and_marks_each_fold(tmp_path: Path) -> None:
    """demo --plot writes a PNG whose y axis is logarithmic with one marker line per fold."""
    import anyio
    import matplotlib

    from contextfold._cli import _options, _plot
    from contextfold._compactor import Compactor
    from contextfold._demo import run_session
    from contextfold._loop import StepLoop
    from contextfold._tokens import TiktokenCounter
    from contextfold.stores import MemoryStore

    plot = tmp_path / "tokens.png"
    ok(cli("demo", "--db", str(tmp_path / "d.db"), "--steps", "30", "--budget", "3000", "--plot", str(plot)))
    assert plot.read_bytes().startswith(b"\x89PNG")

    async def session() -> Any:
        counter = TiktokenCounter()
        async with MemoryStore() as store:
            loop = StepLoop(Compactor(store, options=_options(3000), counter=counter))
            return await run_session(loop, "t", steps=30, counter=counter)

    stats = anyio.run(session)
    matplotlib.use("Agg")
    axes = _plot(stats, tmp_path / "again.png", 3000)
    folds = [step for step, c in zip(stats.compaction_steps, stats.compactions, strict=True) if not c.stalled]
    vertical = [line for line in axes.get_lines() if list(line.get_xdata()) == [line.get_xdata()[0]] * 2]
    assert axes.get_yscale() == "log"
    assert folds and sorted(line.get_xdata()[0] for line in vertical) == folds


_LONG = "a" * 300


@pytest.mark.parametrize(
    ("plot", "line"),
    [
        ("missing/x.png",
         "--plot {tmp}/missing/x.png: {tmp}/missing does not exist; pass a file in a folder that exists"),
        ("x.txt", "--plot {tmp}/x.txt: cannot draw a .txt file; name a .png file (or .svg, .pdf)"),
        (f"{_LONG}.png",
         f"--plot {{tmp}}/{_LONG}.png cannot be written (File name too long); pass a file you can write to"),
        ("plots", "--plot {tmp}/plots is a folder; name a file in it, such as {tmp}/plots/tokens.png"),
    ],
    ids=["missing-folder", "unknown-format", "name-too-long", "a-folder"],
)  # fmt: skip
def test_demo_refuses_a_plot_it_could_not_save_before_it_runs(tmp_path: Path, plot: str, line: str) -> None:
    """demo --plot to a path it cannot write exits 1 with one line before simulating a step."""
    db = tmp_path / "d.db"
    (tmp_path / "plots").mkdir()
    result = cli("demo", "--db", str(db), "--steps", "5", "--plot", str(tmp_path / plot))
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["Error: " + line.replace("{tmp}", str(tmp_path))]
    assert not db.exists()


def test_demo_whose_plot_fails_to_save_says_so_in_one_line(tmp_path: Path, httpserver: HTTPServer) -> None:
    """A plot whose folder is gone by the time it is saved is one error line and exit 1, never a traceback."""
    folder = tmp_path / "plots"
    folder.mkdir()

    def remove_folder(request: Request) -> Response:
        shutil.rmtree(folder, ignore_errors=True)
        return chat_reply("SUMMARY-OK")

    serve(httpserver, remove_folder)
    plot, db = folder / "tokens.png", tmp_path / "d.db"
    result = cli(
        "demo", "--db", str(db), "--steps", "40", "--budget", "3000", "--plot", str(plot),
        "--summarizer", "openai", "--model", "local-model", "--base-url", httpserver.url_for("/v1"),
    )  # fmt: skip
    assert result.returncode == 1
    assert not folder.exists() and "inspect it: contextfold inspect" in result.stdout
    *warnings, error = [line for line in result.stderr.splitlines() if line]  # the session's own, once each
    assert error == (
        f"Error: --plot {plot} could not be written (No such file or directory); the session is saved in {db}"
    )
    assert all(line.startswith("warning: ") for line in warnings), result.stderr


def test_threads_lists_each_thread_with_its_figures(tmp_path: Path) -> None:
    """threads prints every thread with its messages, tokens, episodes and last activity, newest first."""
    db = tmp_path / "d.db"
    for name, steps in (("older", "10"), ("newer", "20")):
        ok(cli("demo", "--db", str(db), "--thread", name, "--steps", steps))
    listed = json.loads(ok(cli("threads", str(db), "--json")))
    assert [info["thread"] for info in listed] == ["newer", "older"]
    window, log = anyio_run_load(db, "newer")
    assert listed[0]["message_count"] == len(window) and listed[0]["episodes"] == len(log)
    assert listed[0]["total_tokens"] == sum(m.tokens for m in window)
    table = ok(cli("threads", f"sqlite:///{db}"))
    assert re.search(rf"newer\s*│\s*{len(window)}\s*│", table)


@pytest.fixture
async def pg_url(postgres_url: str) -> AsyncIterator[str]:
    """A store URL on the test server with a schema of the test's own, dropped afterwards."""
    schema = f"cf_cli_{uuid.uuid4().hex[:10]}"
    yield f"{postgres_url}?schema={schema}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.postgres
async def test_demo_inspect_and_compact_on_postgres(pg_url: str) -> None:
    """The commands take a postgresql:// URL: demo writes there, inspect reads it, compact folds it."""
    ok(cli("demo", "--db", pg_url, "--thread", "pg", "--steps", "40", "--budget", "4000"))
    base, schema = pg_url.split("?schema=")
    async with PostgresStore(base, schema=schema) as store:
        window = await store.load("pg")
        log = [r async for r in store.replay("pg")]
    shown = json.loads(ok(cli("inspect", pg_url, "pg", "--json", "--full")))
    assert shown["context"]["messages"] == [m.model_dump(mode="json") for m in window.messages]
    assert shown["log"]["episodes"] == len(log)
    assert "manual_recovery" in ok(cli("compact", pg_url, "pg", "--manual-recovery"))
    async with PostgresStore(base, schema=schema) as store:
        latest = await store.latest_checkpoint("pg")
        after = await store.load("pg")
    assert latest is not None and latest.episode.kind == "manual_recovery"
    assert after.total_tokens < window.total_tokens
    listed = json.loads(ok(cli("threads", pg_url, "--json")))
    assert [info["thread"] for info in listed] == ["pg"]
    assert listed[0]["message_count"] == len(after.messages)


def test_demo_stops_at_the_first_summary_after_a_fold_that_only_cut_tool_outputs(tmp_path: Path) -> None:
    """A first fold that only cut tool outputs asked no summarizer: demo still stops at the first summary."""
    db = tmp_path / "d.db"
    result = cli(
        "demo", "--db", str(db), "--thread", "t", "--steps", "40", "--budget", "2000",
        "--summarizer", "openai", "--model", "m", "--base-url", f"http://127.0.0.1:{free_port()}/v1",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stopped after" in result.stderr.strip().splitlines()[-1]
    checkpoints = [r.episode for r in await_records(db, "t") if isinstance(r.episode, SummaryCheckpoint)]
    assert [(c.dropped_messages > 0, c.degraded) for c in checkpoints] == [(False, False), (True, True)]


async def recovered_thread(db: Path, *, waiting: bool = False) -> None:
    """A thread of six short question-and-answer turns, the last left waiting for a tool's result if asked."""
    async with SQLiteStore(db) as store:
        compactor = Compactor(store)
        for n in range(6):
            await compactor.append("t", [Message.user(f"question {n}"), Message.assistant(f"answer {n}")])
        if waiting:
            call = ToolCall(id="call_1", name="run_tests", arguments="{}")
            await compactor.append(
                "t", [Message.user("run them"), Message.assistant("", tool_calls=[call])], started=[call]
            )


@pytest.mark.parametrize("waiting", [False, True], ids=["settled", "tool-waiting"])
async def test_manual_recovery_with_nothing_left_says_so(tmp_path: Path, waiting: bool) -> None:
    """A second --manual-recovery says every turn is already folded, and does not suggest the flag again."""
    db = tmp_path / "t.db"
    await recovered_thread(db, waiting=waiting)
    first = ok(cli("compact", str(db), "t", "--manual-recovery"))
    assert "manual_recovery" in first
    second = cli("compact", str(db), "t", "--manual-recovery")
    assert second.returncode == 1
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert "nothing to fold in 't': --manual-recovery folds every turn, and none is left" in lines[0]
    assert (
        "--manual-recovery folds every turn into" not in lines[0] and "use --manual-recovery" not in lines[0]
    )
    assert ("a tool step still waiting for its result" in lines[0]) is waiting


async def test_compact_says_when_the_summary_outgrew_what_it_replaced(tmp_path: Path) -> None:
    """A manual recovery whose summary outweighs the turns it folded says so beside the token figures."""
    db = tmp_path / "t.db"
    await recovered_thread(db)
    out = ok(cli("compact", str(db), "t", "--manual-recovery"))
    found = re.search(r"([\d,]+) -> ([\d,]+) tokens", out)
    assert found and int(found.group(2)) > int(found.group(1)), out
    assert "(the summary is longer than the 12 messages it replaced)" in out


async def schema_exists(postgres_url: str, schema: str) -> tuple[bool, int]:
    """Whether ``schema`` exists, and how many tables it holds."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = %s), "
            "(SELECT count(*) FROM pg_tables WHERE schemaname = %s)",
            (schema, schema),
        )
        found = await cur.fetchone()
    assert found is not None
    return bool(found[0]), int(found[1])


def foreign_db(path: Path, kind: str) -> None:
    """Write a file that holds no contextfold store: an application's database, an empty file, or text."""
    if kind == "app":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
            conn.execute("INSERT INTO users (name) VALUES ('ada')")
            conn.execute("PRAGMA user_version = 7")  # its own schema version: not contextfold's
        conn.close()
    elif kind == "empty":
        path.touch()
    else:
        path.write_text("name,email\nada,ada@example.com\n" * 50)


_NOT_A_STORE = {
    "app": "it is a SQLite database without contextfold's tables",
    "empty": "it is an empty file",
    "text": "it is not a SQLite database",
}


@pytest.mark.parametrize("kind", list(_NOT_A_STORE))
@pytest.mark.parametrize(
    "command", [["threads"], ["inspect", "t"], ["compact", "t"]], ids=["threads", "inspect", "compact"]
)
def test_read_only_commands_refuse_a_sqlite_file_without_a_store(
    tmp_path: Path, command: list[str], kind: str
) -> None:
    """threads, inspect and compact on a file that holds no store exit 1 naming it, and leave it unchanged."""
    db = tmp_path / "app.db"
    foreign_db(db, kind)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    result = cli(command[0], str(db), *command[1:])
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"Error: {db} holds no contextfold store: {_NOT_A_STORE[kind]}; pass the SQLite file a contextfold "
        "run wrote (only `contextfold demo` creates one)"
    ]
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert [p.name for p in tmp_path.iterdir()] == ["app.db"]


def test_a_sqlite_url_without_a_store_is_refused_too(tmp_path: Path) -> None:
    """threads on sqlite:///PATH of an application's database exits 1 and writes nothing into it."""
    db = tmp_path / "app.db"
    foreign_db(db, "app")
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    result = cli("threads", f"sqlite:///{db}")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: STORE 'sqlite:///{db}': holds no contextfold store: {_NOT_A_STORE['app']}; pass the SQLite "
        "file a contextfold run wrote (only `contextfold demo` creates one)"
    ]
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("form", ["path", "url"])
def test_demo_refuses_a_db_that_is_not_a_sqlite_database_and_leaves_it_alone(
    tmp_path: Path, form: str
) -> None:
    """demo --db on a text file exits 1 in one line naming --db, the value and the fix; the file is unchanged.

    Before, it printed the store's "SQLite database 'notes.txt': file is not a
    database", which names neither --db nor what to pass instead.
    """
    notes = tmp_path / "notes.txt"
    foreign_db(notes, "text")
    before = hashlib.sha256(notes.read_bytes()).hexdigest()
    db = str(notes) if form == "path" else f"sqlite:///{notes}"
    result = cli("demo", "--db", db, "--steps", "3", tmp=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"Error: --db {db} is not a SQLite database, so the demo cannot write its store there (the file is "
        "left as it is); pass a new file, such as demo.db, or the SQLite file of an earlier demo, or leave "
        "--db out for a new temporary file"
    ]
    assert hashlib.sha256(notes.read_bytes()).hexdigest() == before
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_demo_refuses_a_db_that_is_a_folder_or_in_a_missing_one(tmp_path: Path) -> None:
    """demo --db naming a folder, or a file in a missing folder, exits 1 in one line with the fix."""
    folder = tmp_path / "runs"
    folder.mkdir()
    result = cli("demo", "--db", str(folder), "--steps", "3", tmp=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"Error: --db {folder} is a folder; name a file in it, such as {folder / 'demo.db'} (created if "
        "missing), or leave --db out for a new temporary file"
    ]
    assert list(folder.iterdir()) == []
    missing = tmp_path / "nowhere" / "d.db"
    result = cli("demo", "--db", str(missing), "--steps", "3", tmp=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"Error: --db {missing}: {missing.parent} does not exist; pass a file in a folder that exists"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]


def test_a_store_of_a_newer_schema_gives_the_stores_own_error(thread_db: Path) -> None:
    """threads on a store a newer contextfold wrote names the schema version, not a missing store."""
    with sqlite3.connect(thread_db) as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    result = cli("threads", str(thread_db))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: SQLite database '{thread_db}' has schema version 99, newer than version 4 this contextfold "
        "understands; upgrade contextfold to the release that wrote it, or open a different file"
    ]


@pytest.mark.postgres
@pytest.mark.parametrize("precreate", [False, True], ids=["missing", "empty"])
@pytest.mark.parametrize(
    "command",
    [["threads"], ["inspect", "{url}", "t"], ["compact", "{url}", "t"]],
    ids=["threads", "inspect", "compact"],
)
async def test_read_only_commands_refuse_a_schema_without_a_store(
    postgres_url: str, pg_url: str, command: list[str], precreate: bool
) -> None:
    """threads, inspect and compact on a schema that holds no store exit 1 naming it, and create nothing."""
    schema = pg_url.split("?schema=")[1]
    if precreate:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    args = [a.replace("{url}", pg_url) for a in command]
    result = cli(*args) if len(args) > 1 else cli(args[0], pg_url)
    assert result.returncode == 1, result.stdout + result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, result.stderr
    what = "holds no contextfold store" if precreate else "does not exist"
    assert f"schema {schema!r} {what}" in error[0] and "?schema=NAME" in error[0]
    assert await schema_exists(postgres_url, schema) == (precreate, 0)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:hunter2@db.internal/agents", "postgresql://app:***@db.internal/agents"),
        ("postgresql://app:hunt@r2@db/agents?schema=s", "postgresql://app:***@db/agents?schema=s"),
        ("postgresql://app@db/agents?password=hunter2&schema=s", "postgresql://app@db/agents?password=***&schema=s"),
        ("host=db password='hunter 2' user=app", "host=db password=*** user=app"),
        ("postgresql://app@db:5432/agents", "postgresql://app@db:5432/agents"),
        ("sqlite:///runs/agent.db", "sqlite:///runs/agent.db"),
        # libpq reads the user info up to the last '@': these are passwords, not a path or a query
        ("postgresql://app:s3c#ret@db/agents", "postgresql://app:***@db/agents"),
        ("postgresql://app:s3c/ret@db/agents", "postgresql://app:***@db/agents"),
        ("postgresql://app:s3c?ret@db/agents", "postgresql://app:***@db/agents"),
    ],
)  # fmt: skip
def test_redact_url_masks_only_the_password(url: str, shown: str) -> None:
    """redact_url replaces a URL's password, in its user info or its query, with *** and keeps the rest."""
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["threads", "postgresql+psycopg://app:hunter2@127.0.0.1/test"], "'postgresql+psycopg://app:***@127.0.0.1/test'"),
        (["inspect", "postgresql://app:hunter2@[::1/test", "t"], "'postgresql://app:***@[::1/test'"),
        (["threads", "postgresql://app:hunter2@127.0.0.1:{port}/test"], "127.0.0.1"),
        (["threads", "postgresql://app:hunter2@[::1]x/test"], "app:***@[::1]x"),  # quoted by psycopg
    ],
)  # fmt: skip
def test_errors_never_print_the_store_password(args: list[str], shown: str) -> None:
    """An error about a store URL shows it with the password masked, in one line and never a traceback."""
    result = cli(*(a.replace("{port}", str(free_port())) for a in args))
    assert result.returncode == 1
    assert "hunter2" not in result.stdout + result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and shown in error[0], result.stderr
    assert "Traceback" not in result.stderr


def with_password(url: str) -> tuple[str, str]:
    """``url`` with a password (the server trusts the test user, so any will do), and that password."""
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    netloc = parts.netloc.replace("@", ":hunter2@", 1) if "@" in parts.netloc else f"u:hunter2@{parts.netloc}"
    return urlunsplit(parts._replace(netloc=netloc)), "hunter2"


@pytest.mark.postgres
async def test_demo_and_threads_on_postgres_mask_the_password(pg_url: str) -> None:
    """demo's table and inspect hint and the threads title show a store URL with its password masked."""
    url, password = with_password(pg_url)
    outputs = [
        cli("demo", "--db", url, "--thread", "pw", "--steps", "3"),
        cli("threads", url),
        cli("inspect", url, "pw"),
    ]
    for result in outputs:
        assert password not in ok(result) + result.stderr
    masked = urlsplit(redact_url(url)).netloc
    assert ":***@" in masked
    assert masked in outputs[0].stdout.split("inspect it:")[0] and masked in outputs[1].stdout
    assert f"contextfold inspect {redact_url(url)} pw" in outputs[0].stdout


def test_a_postgres_server_it_cannot_reach_is_named_by_the_argument_that_gave_it(tmp_path: Path) -> None:
    """The fix names STORE (or --db for demo), not the Python class a library user would pass it to."""
    url = f"postgresql://postgres:hunter2@127.0.0.1:{free_port()}/test"
    listed = cli("threads", url)
    demo = cli("demo", "--db", url, "--steps", "3")
    assert listed.returncode == 1 and demo.returncode == 1
    assert "cannot connect to PostgreSQL" in listed.stderr
    assert "pass STORE the URL of one that does" in listed.stderr
    assert "pass --db the URL of one that does" in demo.stderr
    for result in (listed, demo):
        assert "PostgresStore" not in result.stderr and "hunter2" not in result.stderr


@pytest.mark.parametrize(
    ("rules", "questions"), [(2_800, 12), (1_400, 0)], ids=["over-the-budget", "within-the-budget"]
)
async def test_compact_names_a_pinned_head_over_the_target_not_the_newest_turns(
    tmp_path: Path, rules: int, questions: int
) -> None:
    """A system prompt alone over the target is what compact names, with its tokens, whatever the budget."""
    db = tmp_path / "t.db"
    async with SQLiteStore(db) as store:
        compactor = Compactor(store)
        await compactor.append("t", [Message.system(" ".join(f"rule{i} must hold" for i in range(rules)))])
        for n in range(questions):
            await compactor.append(
                "t", [Message.user(f"question {n}: " + " ".join(f"w{j}" for j in range(200)))]
            )
        window = await store.load("t")
    head = window.messages[0].tokens
    assert head > 6_000 and (window.total_tokens > 12_000) is (questions > 0)
    before = [r.episode.kind for r in await records(db, "t")]
    result = cli("compact", str(db), "t")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: nothing folded in 't': the pinned head alone holds {head} tokens, at or over the "
        "6000-token target, so no fold can get under it; shorten the system prompt, lower keep_first, or "
        "raise --budget (the target is half of it)"
    ]
    assert [r.episode.kind for r in await records(db, "t")] == before


def test_a_stall_after_a_failed_summarizer_says_the_summarizer_failed() -> None:
    """A stall whose summarizer failed says so with its cause, not that the newest turns are too big."""
    from contextfold._cli import _options, _stall_line

    result = CompactionResult(
        thread="t",
        reason="manual",
        dropped_messages=0,
        dropped_turns=0,
        tokens_before=20_000,
        tokens_after=20_000,
        stalled=True,
        detail="the summarizer failed (SummarizerError: HTTP 503); nothing folded",
    )
    assert _stall_line(result, _options(12_000)) == (
        "nothing folded in 't': the summarizer failed (SummarizerError: HTTP 503)"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["threads", "mysql://x"],
            "Error: STORE 'mysql://x': has the unsupported scheme 'mysql'; use sqlite:///PATH, a file path, "
            "or postgresql://USER@HOST/DB",
        ),
        (
            ["demo", "--db", "mysql://x", "--steps", "2"],
            "Error: --db 'mysql://x': has the unsupported scheme 'mysql'; use sqlite:///PATH, a file path, "
            "or postgresql://USER@HOST/DB",
        ),
        (
            ["threads", ""],
            "Error: STORE '': must name a store: sqlite:///PATH, a file path, or postgresql://USER@HOST/DB",
        ),
        (
            ["threads", "postgresql://u:secretpw@127.0.0.1:1/x?bogus=1"],
            "Error: STORE 'postgresql://u:***@127.0.0.1:1/x?bogus=1': is not a valid PostgreSQL connection "
            'string (invalid URI query parameter: "bogus"); use a postgresql:// (or postgres://) URL such as '
            "postgresql://user:password@host:5432/dbname",
        ),
    ],
)
def test_a_store_it_cannot_open_is_named_by_the_argument_that_gave_it(args: list[str], said: str) -> None:
    """The library's ``url=``/``dsn=`` in a store error is the command's STORE (or demo's --db).

    ``demo --db mysql://x`` said "url='mysql://x'", a keyword the command has
    none of, and an empty STORE said "no database at : ...".
    """
    result = cli(*args)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [said]
