"""A step's own write reads the thread back: the check right after it needs no read of its own.

A bundled store's step write returns the threads row as its transaction left
it (SQLite from the row the step's one UPDATE matched, PostgreSQL from the
upsert's RETURNING, memory from its own stats). For ``_SEEN_STANDS_FOR``,
10 ms, and while no store object of the process writes the thread, that
stands for the check's read, as the check's read stands for ``context()``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import contextfold._compactor as compactor_module
from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.tokens import ApproximateCounter

THREAD = "t-1"
READS = ("stats", "state", "pressure", "tail", "load")


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        async with MemoryStore() as memory:
            yield memory
    elif request.param == "sqlite":
        async with SQLiteStore(tmp_path / "cf.db") as sqlite:
            yield sqlite
    else:
        from contextfold.stores import PostgresStore

        url = request.getfixturevalue("postgres_url")
        async with scratch_schema(url) as schema, PostgresStore(url, schema=schema) as postgres:
            yield postgres


@contextlib.asynccontextmanager
async def scratch_schema(url: str) -> AsyncIterator[str]:
    """A schema name of its own, dropped afterwards."""
    import psycopg

    schema = f"cf_{uuid.uuid4().hex[:12]}"
    try:
        yield schema
    finally:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def counted(store: Any) -> Counter[str]:
    """Count the store's reads of the working context; the store's methods stay what they were."""
    reads: Counter[str] = Counter()
    for name in READS:
        original = getattr(store, name)

        async def read(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            reads[_name] += 1
            return await _original(*args, **kwargs)

        setattr(store, name, read)
    return reads


def settings(budget: int = 100_000) -> RunOptions:
    return RunOptions(
        max_history_tokens=budget * 2,
        compaction=SummarizeOptions(
            trigger_token_budget=budget, max_summary_tokens=60, min_recent_messages=2, min_recent_turns=1
        ),
    )


def step(n: int, size: int = 40) -> list[list[Message]]:
    """A user turn, then its tool step, then the answer: three appends, as an agent makes them."""
    call = ToolCall(id=f"c{n}", name="read", arguments=json.dumps({"n": n}))
    return [
        [Message.user(f"task {n} " + "word " * size)],
        [Message.assistant(None, tool_calls=[call])],
        [Message.tool(f"c{n}", "line\n" * size), Message.assistant(f"done {n}")],
    ]


async def test_the_check_and_context_right_after_a_steps_write_read_nothing(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step: append, check, context. After the first, neither the check nor the context reads."""
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)  # no slow moment of CI decides
    compactor = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
    reads = counted(store)
    per_step: list[dict[str, int]] = []
    for n in range(6):
        for batch in step(n):
            await compactor.append(THREAD, batch)
            reads.clear()
            assert await compactor.maybe_compact(THREAD) is None
            context = await compactor.context(THREAD)
            per_step.append(dict(reads))
            assert context == (await store.load(THREAD)).plain
    # The first context is read whole (nothing is cached yet); no step after it reads the store.
    assert per_step[0] == {"tail": 1}
    assert per_step[1:] == [{}] * (len(per_step) - 1)


async def test_a_check_longer_after_the_write_than_it_stands_for_reads_the_thread_once(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 0.0)
    compactor = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
    await compactor.append(THREAD, [Message.user("first")])
    await compactor.context(THREAD)
    reads = counted(store)
    await compactor.append(THREAD, [Message.user("second")])
    assert await compactor.maybe_compact(THREAD) is None
    assert reads == {"stats": 1}


async def test_the_writes_read_folds_at_the_same_steps_as_a_check_that_reads(
    store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same session, the check reading the store each step or using the write's read: the same folds.

    The SQLite store computes the row a step leaves from the one its last step
    left (a conditional UPDATE without RETURNING); every step here compares
    that with the row the store then reads, through folds, tool steps and
    two-message batches.
    """
    runs: list[list[tuple[bool, list[Message]]]] = []
    for stands_for in (0.0, 60.0):
        monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", stands_for)
        thread = f"{THREAD}-{stands_for}"
        compactor = Compactor(
            store, options=settings(budget=600), counter=ApproximateCounter(), log_events=False
        )
        run: list[tuple[bool, list[Message]]] = []
        for n in range(20):
            for batch in step(n):
                await compactor.append(thread, batch)
                seen = compactor._seen.get(thread)
                assert seen is not None and seen[0] == await store.stats(thread)
                result = await compactor.maybe_compact(thread)
                run.append((result is not None and result.compacted, await compactor.context(thread)))
                assert run[-1][1] == (await store.load(thread)).plain
        runs.append(run)
    assert sum(folded for folded, _ in runs[0]) >= 3
    assert runs[0] == runs[1]


PREFIX_SWAP = """\
import anyio
from contextfold import Message
from contextfold.stores import {kind}

async def main():
    async with {kind}({where}) as store:
        stats = await store.stats({thread!r})
        first = (await store.load({thread!r})).messages[0].seq
        await store.replace_prefix(
            {thread!r},
            through_seq=first,
            expected_version=stats.version,
            replacement=[Message.user("swapped by another process")],
            tokens=[5],
        )

anyio.run(main)
"""


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_another_processs_prefix_swap_before_a_steps_write_is_seen_by_the_check_after_it(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Another process swaps the context's first message (no episode: only the version moves), then this
    worker appends: the write's read carries the new version, so the context after the check is the store's.

    Within the time the write's read stands for, the check reads nothing: had
    the write reported the version its last step left, the check would have
    kept the cache of the context before the swap.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    async with contextlib.AsyncExitStack() as stack:
        if backend == "sqlite":
            path = tmp_path / "cf.db"
            script = PREFIX_SWAP.format(kind="SQLiteStore", where=repr(str(path)), thread=THREAD)
            store: Any = await stack.enter_async_context(SQLiteStore(path))
        else:
            from contextfold.stores import PostgresStore

            url = request.getfixturevalue("postgres_url")
            schema = await stack.enter_async_context(scratch_schema(url))
            where = f"{url!r}, schema={schema!r}"
            script = PREFIX_SWAP.format(kind="PostgresStore", where=where, thread=THREAD)
            store = await stack.enter_async_context(PostgresStore(url, schema=schema))
        worker = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
        for n in range(3):
            await worker.append(THREAD, [Message.user(f"message {n}")])
            assert await worker.maybe_compact(THREAD) is None
            await worker.context(THREAD)
        await anyio.run_process([sys.executable, "-c", script])
        await worker.append(THREAD, [Message.user("after the swap")])
        reads = counted(store)
        assert await worker.maybe_compact(THREAD) is None
        context = await worker.context(THREAD)
        assert context == (await store.load(THREAD)).plain
        assert [m.text for m in context] == [
            "swapped by another process",
            "message 1",
            "message 2",
            "after the swap",
        ]
        assert reads["stats"] == 0  # the write's read, not the check's, saw the swap


@pytest.mark.parametrize("right_after", [True, False], ids=["right-after", "after-a-pause"])
async def test_a_tool_result_right_after_the_steps_context_reads_nothing_before_its_write(
    store: Any, right_after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A result for a call of the context is checked against the store first (another worker may have
    closed the call): the check's read, or the write's, stands for that read a moment later.

    After a pause longer than that the stats are read once, before the write.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0 if right_after else 0.05)
    compactor = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
    for n in range(3):
        user, reply, (result, answer) = step(n)
        await compactor.append(THREAD, user + reply)
        assert await compactor.maybe_compact(THREAD) is None
        await compactor.context(THREAD)
        if not right_after:
            await anyio.sleep(0.06)  # the tool ran a while
        reads = counted(store)
        await compactor.append(THREAD, [result])
        assert reads == ({} if right_after else {"stats": 1})
        for name in READS:  # the store's own methods again
            vars(store).pop(name)
        await compactor.append(THREAD, [answer])
    context = await compactor.context(THREAD)
    assert context == (await store.load(THREAD)).plain
    assert [m.role.value for m in context] == ["user", "assistant", "tool", "assistant"] * 3
