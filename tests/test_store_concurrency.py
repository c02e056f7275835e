"""Concurrent writers and compactors on one thread, on every backend: the log and the context agree.

Eight writers record 200 steps each the way the product does (``record_and_append``
of a message and its episode, with now and then an episode of its own), while
two compactors, each on its own store handle, keep taking the thread's lease
and folding the older half of it into one summary. Afterwards every message
is either in the working context or covered by the latest checkpoint, every
checkpoint was applied, and the context is exactly the latest summary plus the
message episodes recorded after what it covers (:func:`check_agreement`).
"""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold import ConflictError, Message
from contextfold._episodes import EpisodeRecord, RunCompletedEpisode
from contextfold.episodes import SummaryCheckpoint, UserMessageEpisode
from contextfold.messages import SUMMARY_METADATA_KEY
from contextfold.stores import ContextWindow, MemoryStore, SQLiteStore
from contextfold.stores._rows import PressureCounters

pytestmark = pytest.mark.slow

WRITERS = 8
PER_WRITER = 200
THREAD = "busy 'thread' ✓"

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


async def record_step(store: Any, thread: str, messages: Sequence[Message]) -> None:
    """Record a step's messages in the log and the working context, as one call."""
    episodes = [UserMessageEpisode(message=message) for message in messages]
    await store.record_and_append(
        thread, episodes, messages, [2] * len(messages), message_episodes=range(len(messages))
    )


def plan_fold(window: ContextWindow) -> dict[str, Any]:
    """The fold of the older half of ``window``: its arguments to ``Store.fold``."""
    cut = window.messages[: len(window.messages) // 2]
    originals = [stored.episode_seq or 0 for stored in cut if not stored.message.is_summary]
    text = f"{len(cut)} messages through seq {cut[-1].seq}"
    return {
        "checkpoint": SummaryCheckpoint(
            trigger="test",
            from_seq=cut[0].seq,
            through_seq=cut[-1].seq,
            summary=text,
            log_from_seq=min(originals),
            log_through_seq=max(originals),
        ),
        "through_seq": cut[-1].seq,
        "expected_version": window.version,
        "replacement": [Message.system(text, metadata={SUMMARY_METADATA_KEY: True})],
        "tokens": [1],
    }


@dataclass
class Snapshot:
    """A thread as read back: its working context, its log and its state."""

    window: ContextWindow
    records: list[EpisodeRecord]
    state: Any


async def snapshot(store: Any, thread: str) -> Snapshot:
    return Snapshot(
        window=await store.load(thread),
        records=[record async for record in store.replay(thread)],
        state=await store.state(thread),
    )


def check_agreement(seen: Snapshot) -> None:
    """The thread is whole, and its working context is what its log says, message for message."""
    window, records, state = seen.window, seen.records, seen.state
    seqs = [m.seq for m in window.messages]
    assert seqs == sorted(set(seqs))
    assert state.stats.message_count == len(window.messages)
    assert state.stats.total_tokens == sum(window.tokens) == window.total_tokens
    assert state.stats.version == window.version
    assert [r.seq for r in records] == list(range(1, len(records) + 1))

    counters = PressureCounters()
    for record in records:
        counters = counters.after(record.episode, record.at)
    now = datetime.now(UTC)
    assert state.pressure == counters.pressure(now, state.stats.total_tokens), "torn pressure counters"

    checkpoints = [r for r in records if isinstance(r.episode, SummaryCheckpoint)]
    assert len(checkpoints) == window.version, "a checkpoint in the log was not applied, or a fold lacks one"
    rows = list(window.messages)
    through = 0
    if checkpoints:
        latest = checkpoints[-1]
        assert isinstance(latest.episode, SummaryCheckpoint)
        summary = rows.pop(0)
        assert summary.message.is_summary and summary.message.text == latest.episode.summary
        assert summary.episode_seq == latest.seq
        assert latest.episode.log_through_seq is not None
        through = latest.episode.log_through_seq
    logged = [r for r in records if isinstance(r.episode, UserMessageEpisode) and r.seq > through]
    assert [(m.episode_seq, m.message) for m in rows] == [
        (r.seq, r.episode.message)  # type: ignore[union-attr]
        for r in logged
    ], "the working context and the log disagree"


async def write(store: Any, writer: int) -> list[str]:
    """Record this writer's steps one by one; the texts it wrote, in order."""
    texts = []
    for n in range(PER_WRITER):
        text = f"writer {writer} says {n}"
        await record_step(store, THREAD, [Message.user(text)])
        texts.append(text)
        if n % 10 == 9:
            # An episode of its own locks only the log's counters: no lock-order cycle with a fold.
            await store.record(THREAD, RunCompletedEpisode(clean=n % 20 == 19))
    return texts


def write_in_process(target: Target, writer: int) -> list[str]:
    """A writer in its own OS process, with its own store on the shared database."""

    async def main() -> list[str]:
        async with open_target(target) as store:
            return await write(store, writer)

    return anyio.run(main)


async def compact_until(store: Any, done: anyio.Event) -> int:
    """Take the lease and fold the older half, until ``done``; the folds applied."""
    folds = 0
    while not done.is_set():
        async with store.compaction_lock(THREAD) as mine:
            if mine:
                window = await store.load(THREAD)
                if len(window.messages) >= 4:
                    try:
                        await store.fold(THREAD, **plan_fold(window))
                        folds += 1
                    except ConflictError:
                        pytest.fail("a fold under the lease met another fold")
        await anyio.sleep(0.002)  # back off between attempts instead of spinning on the lease
    return folds


async def check_nothing_lost(store: Any, texts: list[list[str]], folds: int) -> None:
    assert folds > 0, "no compaction ran, so the test proved nothing"
    seen = await snapshot(store, THREAD)
    check_agreement(seen)
    assert seen.window.version == folds
    logged = [r.episode.message.text for r in seen.records if isinstance(r.episode, UserMessageEpisode)]
    for own in texts:
        assert [text for text in logged if text in set(own)] == own, "a writer's steps were lost or reordered"
    assert len(logged) == WRITERS * PER_WRITER
    assert seen.state.stats.last_seq == WRITERS * PER_WRITER, "a fold renumbers only what it replaces"


@pytest.mark.parametrize(
    "target",
    ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True,
)
async def test_concurrent_writers_and_compactors_agree_with_the_log(target: Target) -> None:
    """With 8 writers and 2 compactors on one thread, the context ends exactly as the log says."""
    memory = MemoryStore()
    stores = [memory if target["backend"] == "memory" else open_target(target) for _ in range(WRITERS + 2)]
    for store in stores:
        await store.__aenter__()
    texts: list[list[str]] = []
    folds: list[int] = []
    done = anyio.Event()
    try:

        async def writer(n: int) -> None:
            texts.append(await write(stores[n], n))

        async def compactor(store: Any) -> None:
            folds.append(await compact_until(store, done))

        async with anyio.create_task_group() as compactors:
            for store in stores[WRITERS:]:
                compactors.start_soon(compactor, store)
            async with anyio.create_task_group() as writers:
                for n in range(WRITERS):
                    writers.start_soon(writer, n)
            done.set()
        await check_nothing_lost(stores[0], texts, sum(folds))
    finally:
        for store in stores:
            await store.aclose()


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_writer_processes_and_compactors_agree_with_the_log(target: Target) -> None:
    """With 8 writer processes and 2 compactors, the context ends exactly as the log says."""
    compactors = [open_target(target) for _ in range(2)]
    for store in compactors:
        await store.__aenter__()  # creates the schema before the writers start
    texts: list[list[str]] = []
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
                    texts.append(await anyio.to_thread.run_sync(future.result))
                done.set()
        await check_nothing_lost(compactors[0], texts, sum(folds))
    finally:
        for store in compactors:
            await store.aclose()


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_handles_folding_without_a_lease_apply_each_prefix_once(target: Target) -> None:
    """Four handles folding the same reads at once, while a writer appends, apply one fold per read."""
    stores = [open_target(target) for _ in range(5)]
    for store in stores:
        await store.__aenter__()
    try:
        for _ in range(4):
            await record_step(stores[0], THREAD, [Message.user(f"m{n}") for n in range(8)])
        applied = 0
        for _ in range(10):
            plan = plan_fold(await stores[0].load(THREAD))
            outcomes: list[str] = []

            async def fold(store: Any, plan: dict[str, Any] = plan, outcomes: list[str] = outcomes) -> None:
                try:
                    await store.fold(THREAD, **plan)
                    outcomes.append("applied")
                except ConflictError:
                    outcomes.append("conflict")

            async with anyio.create_task_group() as tg:
                tg.start_soon(record_step, stores[4], THREAD, [Message.user("meanwhile")])
                for store in stores[:4]:
                    tg.start_soon(fold, store)
            assert sorted(outcomes) == ["applied", "conflict", "conflict", "conflict"]
            applied += 1
        seen = await snapshot(stores[0], THREAD)
        check_agreement(seen)
        assert seen.window.version == applied
    finally:
        for store in stores:
            await store.aclose()
