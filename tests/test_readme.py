"""Every Python block of the README is a complete program that runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from contextfold.episodes import SummaryCheckpoint, SystemMessageEpisode, UserMessageEpisode
from contextfold.stores import SQLiteStore

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def block(containing: str) -> str:
    found = [b for b in BLOCKS if containing in b]
    assert len(found) == 1, f"expected one README python block with {containing!r}"
    return found[0]


def run_program(code: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``code`` as a script in the current directory and return what it printed."""
    capsys.readouterr()
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory, and provider keys so that the summarizers can be built."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-readme-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-readme-test")
    return tmp_path


QUICKSTART = block('anyio.run(main, "user-42"')
REPLAY = block("conversation([record async for record")
BUDGETS = block("max_history_tokens alone enforces nothing")


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{n}" for n in range(len(BLOCKS))])
def test_every_python_block_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each Python block of the README runs to the end on its own, in an empty directory."""
    run_program(code, capsys)


async def _log(db: Path, thread: str) -> list[object]:
    async with SQLiteStore(db) as store:
        return [record.episode async for record in store.replay(thread)]


async def _context(db: Path, thread: str) -> list[str]:
    async with SQLiteStore(db) as store:
        return [m.role.value for m in (await store.load(thread)).plain]


def test_running_the_quickstart_twice_resumes_the_thread(
    sandbox: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second run continues the same thread: one system prompt at its head, both questions after it."""
    first = run_program(QUICKSTART, capsys)
    second = run_program(QUICKSTART, capsys)
    assert first == second == "The folder holds: README.md, agent.py\n"
    log = anyio.run(_log, sandbox / "agent.db", "user-42")
    assert sum(isinstance(e, SystemMessageEpisode) for e in log) == 1
    assert sum(isinstance(e, UserMessageEpisode) for e in log) == 2
    roles = anyio.run(_context, sandbox / "agent.db", "user-42")
    assert roles[0] == "system" and roles.count("system") == 1 and roles.count("user") == 2
    assert run_program(REPLAY, capsys) == "9 messages in the log, 9 in the working context\n"


def test_the_quickstart_folds_once_the_budget_is_reached(
    sandbox: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a small budget the quickstart folds older runs into a summary; its system prompt stays first."""
    small = QUICKSTART.replace("max_history_tokens=100_000", "max_history_tokens=1_200").replace(
        "trigger_token_budget=60_000", "trigger_token_budget=300"
    )
    assert small != QUICKSTART
    for _ in range(8):
        run_program(small, capsys)
    log = anyio.run(_log, sandbox / "agent.db", "user-42")
    assert any(isinstance(e, SummaryCheckpoint) for e in log)
    assert sum(isinstance(e, SystemMessageEpisode) for e in log) == 1
    roles = anyio.run(_context, sandbox / "agent.db", "user-42")
    assert roles[0] == "system" and len(roles) < 1 + 8 * 4
    replayed = run_program(REPLAY, capsys)
    assert replayed.startswith(f"{1 + 8 * 4} messages in the log, {len(roles)} in")


def test_the_budget_rules_print_what_the_readme_says(capsys: pytest.CaptureFixture[str]) -> None:
    """The budget program prints exactly the text block the README shows after it."""
    shown = README.split(BUDGETS, 1)[1]
    expected = re.search(r"```text\n(.*?)```", shown, flags=re.S)
    assert expected
    assert run_program(BUDGETS, capsys) == expected.group(1)


def test_the_summarizer_block_prints_no_key(capsys: pytest.CaptureFixture[str]) -> None:
    """The summarizer block builds every provider's summarizer and no repr shows a key."""
    out = run_program(block("async with (\n        MemoryStore() as store"), capsys)
    assert out.count("Summarizer(") == 3
    assert "sk-" not in out


def test_the_readme_names_every_warning_the_compactor_logs() -> None:
    """The warnings table explains the compaction window and the stall the compactor warns about."""
    section = README.split("## Warnings and what they mean", 1)[1].split("\n## ", 1)[0]
    for words in ("compaction window", "nothing can be folded", "summarizer failed", "stopped at the limit"):
        assert words in section
