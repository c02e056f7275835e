"""Killing a process in the middle of its writes, many times: no torn thread, nothing lost.

A child process loops: record three user messages, append them, take the
compaction lock and fold the older half of the thread into a summary (record
a ``SummaryCheckpoint``, then ``replace_prefix``). The test SIGKILLs it at a
random moment, reopens the database and checks the thread, then starts the
next child on the same data.

The episode is recorded before the message is appended, as the product does,
so a kill between the two may leave the newest recorded messages out of the
working context: the check allows that only for a tail of the log, once.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import test_store_concurrency as concurrency
from contextfold import Message, SummaryCheckpoint, UserMessageEpisode
from contextfold.stores import SQLiteStore
from test_store_concurrency import COVERS, fold_once, message_id

pytestmark = pytest.mark.slow

ROUNDS = 20
BATCH = 3
THREAD = "crash 'test' ✓"

Target = dict[str, str]


def open_target(target: Target, *, clock_offset: float = 0.0) -> Any:
    if target["backend"] == "sqlite":
        return SQLiteStore(target["path"], clock=lambda: time.time() + clock_offset)
    from contextfold.stores import PostgresStore

    return PostgresStore(target["url"], schema=target["schema"], min_size=1, max_size=3)


target = concurrency.target  # the same fresh SQLite file or PostgreSQL schema per test


async def churn(target: Target, started: Any) -> None:
    async with open_target(target) as store:
        while True:
            batch = [Message.user("hello", metadata={"id": uuid.uuid4().hex}) for _ in range(BATCH)]
            for message in batch:
                await store.record(THREAD, UserMessageEpisode(message=message))
            await store.append(THREAD, batch, [2] * BATCH)
            async with store.compaction_lock(THREAD) as mine:
                if mine:
                    await fold_once(store, THREAD)
            started.set()


def churn_in_process(target: Target, started: Any) -> None:
    anyio.run(churn, target, started)


@dataclass
class Seen:
    """What earlier rounds found, which a later round must still find."""

    log: list[str] = field(default_factory=list)
    present: set[str] = field(default_factory=set)
    orphans: set[str] = field(default_factory=set)
    version: int = 0


async def check_thread(store: Any, seen: Seen) -> None:
    window = await store.load(THREAD)
    stats = await store.stats(THREAD)
    seqs = [m.seq for m in window.messages]
    assert seqs == sorted(set(seqs))
    assert stats.message_count == len(window.messages)
    assert stats.total_tokens == sum(window.tokens) == window.total_tokens
    assert stats.last_seq == (seqs[-1] if seqs else 0)
    assert stats.version >= seen.version
    summaries = [m for m in window.plain if m.is_summary]
    assert len(summaries) <= 1 and (not summaries or window.plain[0].is_summary)

    present = {message_id(m) for m in window.plain if not m.is_summary}
    folded = set(summaries[0].metadata[COVERS]) if summaries else set()
    assert not present & folded
    present |= folded
    assert present >= seen.present, "a message that was in the thread is gone"

    records = [record async for record in store.replay(THREAD)]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    log = [message_id(r.episode.message) for r in records if isinstance(r.episode, UserMessageEpisode)]
    assert log[: len(seen.log)] == seen.log, "the episodic log lost or changed an episode"
    checkpoints = sum(isinstance(r.episode, SummaryCheckpoint) for r in records)
    assert checkpoints >= stats.version, "a prefix was replaced without a recorded checkpoint"

    assert present <= set(log), "a message reached the working context without its episode"
    new_orphans = [key for key in log if key not in present and key not in seen.orphans]
    assert len(new_orphans) <= BATCH
    assert log[len(log) - len(new_orphans) :] == new_orphans, "only the newest episodes may miss the context"
    seen.log, seen.present, seen.version = log, present, stats.version
    seen.orphans.update(new_orphans)


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_sigkill_mid_write_never_tears_a_thread(target: Target) -> None:
    """After each of many SIGKILLs at random points, the thread is whole and nothing recorded is missing."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["contextfold", "test_store_crash"])
    rng = random.Random(20261130)
    seen = Seen()
    async with open_target(target):
        pass  # creates the schema once, before the first child
    for _ in range(ROUNDS):
        started = context.Event()
        child = context.Process(target=churn_in_process, args=(target, started), daemon=True)
        child.start()
        try:
            assert await anyio.to_thread.run_sync(started.wait, 60), "the child never got going"
            # A random moment within the child's next few operations.
            await anyio.sleep(rng.uniform(0, 0.05))
        finally:
            os.kill(child.pid or 0, signal.SIGKILL)
            await anyio.to_thread.run_sync(child.join)
        assert child.exitcode == -signal.SIGKILL

        async with open_target(target) as store:
            await check_thread(store, seen)
        if target["backend"] == "sqlite":
            # The killed child may have held the lease; once it expires another worker takes over.
            async with open_target(target, clock_offset=301) as later, later.compaction_lock(THREAD) as mine:
                assert mine
    assert seen.version > 0, "no prefix replacement ever committed"
