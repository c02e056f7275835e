"""The README's code runs as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from contextfold import Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import MemoryStore, SQLiteStore

README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def block(containing: str) -> str:
    found = [b for b in BLOCKS if containing in b]
    assert len(found) == 1, f"expected one README python block with {containing!r}"
    return found[0]


async def run_async(code: str, names: dict[str, Any]) -> dict[str, Any]:
    source = "async def __readme__():\n" + textwrap.indent(code, "    ") + "\n    return locals()\n"
    exec(compile(source, "README.md", "exec"), names)
    result: dict[str, Any] = await names["__readme__"]()
    return result


async def test_quickstart_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quickstart wraps a loop, compacts on the way, and finishes the run."""
    monkeypatch.chdir(tmp_path)
    code = (
        block("async with loop.step(thread) as step:")
        .replace("trigger_token_budget=60_000", "trigger_token_budget=400, max_summary_tokens=100")
        .replace("max_history_tokens=100_000", "max_history_tokens=1_600")
    )
    asked: list[int] = []

    async def my_llm(messages: list[Message]) -> Message:
        asked.append(len(messages))
        if len(asked) % 3:
            return Message.assistant(
                None, tool_calls=[ToolCall(id=f"c{len(asked)}", name="ls", arguments="{}")]
            )
        return Message.assistant("all done")

    async def run_tool(call: ToolCall) -> str:
        return "file.txt\n" * 200

    names: dict[str, Any] = {
        "thread": "readme",
        "SYSTEM_PROMPT": "Be brief.",
        "my_llm": my_llm,
        "run_tool": run_tool,
    }
    for n in range(3):
        names["question"] = f"question {n}"
        scope = await run_async(code, dict(names))
    assert scope["reply"].text == "all done"
    assert (tmp_path / "agent.db").is_file()
    assert len(asked) == 9
    async with SQLiteStore(tmp_path / "agent.db") as store:
        kinds = [record.episode.kind async for record in store.replay("readme")]
    assert "summary_checkpoint" in kinds
    assert kinds.count("user_message") == 3


async def test_summarizer_swaps_construct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every summarizer line of the README builds a Compactor (keys from the environment)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    async with MemoryStore() as store:
        options = RunOptions(compaction=SummarizeOptions(trigger_token_budget=40_000))
        await run_async(block("summarizer=AnthropicSummarizer"), {"store": store, "options": options})


async def test_store_lines_construct() -> None:
    """Every store line of the README builds a store without connecting."""
    await run_async(block('PostgresStore("postgresql://app@db/agents")'), {})
