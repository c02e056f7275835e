"""Concurrent writers and compactors on one thread, on every backend: no message is ever lost.

Eight writers append 500 messages each, the way the product does (episode
first, then the working context), while two compactors keep folding the
older half of the thread into one summary message after recording a
``SummaryCheckpoint``. Each summary lists, in its metadata, every message id
it stands for (carried over from the summary it folds), so afterwards each
id can be found either in the working context or in the summary's list.
"""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold import (
    SUMMARY_METADATA_KEY,
    ConflictError,
    Message,
    SummaryCheckpoint,
    UserMessageEpisode,
)
from contextfold.stores import MemoryStore, SQLiteStore

pytestmark = pytest.mark.slow

WRITERS = 8
PER_WRITER = 500
THREAD = "busy 'thread' ✓"
COVERS = "covers"

Target = dict[str, str]


def open_target(target: Target) -> Any:
    """A new, unopened store handle on the target's database."""
    if target["backend"] == "sqlite":
        # NORMAL survives a crashed process, which is all this test needs, and keeps it fast.
        return SQLiteStore(target["path"], synchronous="NORMAL")
    from contextfold.stores import PostgresStore

    return PostgresStore(target["url"], schema=target["schema"], min_size=1, max_size=3)


@pytest.fixture
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Target]:
    """The database named by the test's parameter: a new SQLite file, or a PostgreSQL schema of its own."""
    backend = request.param
    if backend == "postgres":
        url = request.getfixturevalue("postgres_url")
        schema = f"cf_test_{uuid.uuid4().hex[:12]}"
        yield {"backend": backend, "url": url, "schema": schema}
        import psycopg

        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    else:
        yield {"backend": backend, "path": str(tmp_path / "store.db")}


def message_id(message: Message) -> str:
    return str(message.metadata["id"])


async def write(store: Any, writer: int) -> dict[str, int]:
    """Append this writer's messages one by one; the seq each one got, by id."""
    seqs: dict[str, int] = {}
    for n in range(PER_WRITER):
        message = Message.user(f"writer {writer} says {n}", metadata={"id": f"{writer}:{n}"})
        await store.record(THREAD, UserMessageEpisode(message=message))
        (stored,) = await store.append(THREAD, [message], [1 + n % 7])
        seqs[message_id(message)] = stored.seq
    return seqs


def write_in_process(target: Target, writer: int) -> dict[str, int]:
    """A writer in its own OS process, with its own store on the shared database."""

    async def main() -> dict[str, int]:
        async with open_target(target) as store:
            return await write(store, writer)

    return anyio.run(main)


async def fold_once(store: Any, thread: str = THREAD) -> bool:
    """Fold the older half of the thread into one summary; whether a fold was applied."""
    while True:
        window = await store.load(thread)
        if len(window.messages) < 4:
            return False
        cut = window.messages[: len(window.messages) // 2]
        covered: list[str] = []
        for stored in cut:
            message = stored.message
            covered += message.metadata[COVERS] if message.is_summary else [message_id(message)]
        summary = Message.system(
            f"{len(covered)} messages so far", metadata={SUMMARY_METADATA_KEY: True, COVERS: covered}
        )
        await store.record(
            thread,
            SummaryCheckpoint(
                trigger="test", from_seq=cut[0].seq, through_seq=cut[-1].seq, summary=summary.text
            ),
        )
        try:
            await store.replace_prefix(
                thread,
                through_seq=cut[-1].seq,
                expected_version=window.version,
                replacement=[summary],
                tokens=[1],
            )
        except ConflictError:
            continue
        return True


async def compact_until(store: Any, done: anyio.Event) -> int:
    folds = 0
    while not done.is_set():
        async with store.compaction_lock(THREAD) as mine:
            if mine and await fold_once(store):
                folds += 1
        await anyio.sleep(0.002)  # back off between attempts instead of spinning on the lock
    return folds


async def check_nothing_lost(store: Any, seqs: dict[str, int], folds: int) -> None:
    assert folds > 0, "no compaction ran, so the test proved nothing"
    assert len(seqs) == WRITERS * PER_WRITER
    for writer in range(WRITERS):
        own = [seqs[f"{writer}:{n}"] for n in range(PER_WRITER)]
        assert own == sorted(own), f"writer {writer}'s messages were numbered out of order"

    window = await store.load(THREAD)
    stats = await store.stats(THREAD)
    assert window.complete
    assert stats.message_count == len(window.messages)
    assert stats.total_tokens == sum(window.tokens) == window.total_tokens
    assert stats.last_seq == WRITERS * PER_WRITER
    assert [m.seq for m in window.messages] == sorted({m.seq for m in window.messages})
    summaries = [m for m in window.plain if m.is_summary]
    assert len(summaries) == 1 and window.plain[0].is_summary, "folds must chain into one leading summary"
    assert stats.version >= folds

    in_context = {message_id(m) for m in window.plain if not m.is_summary}
    folded = set(summaries[0].metadata[COVERS])
    assert not in_context & folded
    assert in_context | folded == set(seqs)

    records = [record async for record in store.replay(THREAD)]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    logged = [message_id(r.episode.message) for r in records if isinstance(r.episode, UserMessageEpisode)]
    assert sorted(logged) == sorted(seqs)
    ranges = [
        (r.episode.from_seq, r.episode.through_seq)
        for r in records
        if isinstance(r.episode, SummaryCheckpoint)
    ]
    assert len(ranges) >= folds
    for key in folded:
        assert any(low <= seqs[key] <= high for low, high in ranges), f"{key} folded outside any checkpoint"


@pytest.mark.parametrize(
    "target",
    ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True,
)
async def test_concurrent_writers_and_compactors_lose_nothing(target: Target) -> None:
    """With 8 writers and 2 compactors on one thread, every message stays in context or in a summary."""
    memory = MemoryStore()
    stores = [memory if target["backend"] == "memory" else open_target(target) for _ in range(WRITERS + 2)]
    for store in stores:
        await store.__aenter__()
    seqs: dict[str, int] = {}
    folds: list[int] = []
    done = anyio.Event()
    try:

        async def writer(n: int) -> None:
            seqs.update(await write(stores[n], n))

        async def compactor(store: Any) -> None:
            folds.append(await compact_until(store, done))

        async with anyio.create_task_group() as compactors:
            for store in stores[WRITERS:]:
                compactors.start_soon(compactor, store)
            async with anyio.create_task_group() as writers:
                for n in range(WRITERS):
                    writers.start_soon(writer, n)
            done.set()
        await check_nothing_lost(stores[0], seqs, sum(folds))
    finally:
        for store in stores:
            await store.aclose()


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_writer_processes_and_compactors_lose_nothing(target: Target) -> None:
    """With 8 writer processes and 2 compactors, every message stays in context or in a summary."""
    compactors = [open_target(target) for _ in range(2)]
    for store in compactors:
        await store.__aenter__()  # creates the schema before the writers start
    seqs: dict[str, int] = {}
    folds: list[int] = []
    done = anyio.Event()
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=WRITERS, mp_context=spawn) as pool:
            futures = [pool.submit(write_in_process, target, n) for n in range(WRITERS)]

            async def compactor(store: Any) -> None:
                folds.append(await compact_until(store, done))

            async with anyio.create_task_group() as group:
                for store in compactors:
                    group.start_soon(compactor, store)
                for future in futures:
                    seqs.update(await anyio.to_thread.run_sync(future.result))
                done.set()
        await check_nothing_lost(compactors[0], seqs, sum(folds))
    finally:
        for store in compactors:
            await store.aclose()
