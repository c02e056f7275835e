"""One store used by several event loops in several OS threads at once, on every backend.

What a sync framework does in a threaded server: LangChain's sync ``invoke``
runs each of contextfold's calls in a fresh event loop in the caller's thread
(``integrations.langchain._run_blocking``), so two requests served at once are
two loops, in two threads, on one store, opened beforehand in the app's own
loop (here the test's). Every call must complete (a primitive of one loop
waited for from another is never woken: the call hangs, with no error), and
what they wrote must be all there, once each.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import anyio
import pytest

from contextfold import Compactor, Message
from contextfold.episodes import RunCompletedEpisode, UserMessageEpisode
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.tokens import ApproximateCounter

LOOPS = 3
STEPS = 6
LIMIT = 10.0
"""Seconds for all the steps of every thread (they take well under one): past it, a call hung."""

SHARED = "shared"


def asks(who: int, n: int) -> str:
    return f"loop {who} asks {n}"


def answers(who: int, n: int) -> str:
    return f"loop {who} answers {n}"


async def step(store: Any, who: int, n: int, *, shared: bool) -> None:
    """One agent step of thread ``who``: records, reads back what it wrote, and takes the lease."""
    own = f"loop {who}"
    user = Message.user(asks(who, n))
    await store.record_and_append(own, [UserMessageEpisode(message=user)], [user], [3], message_episodes=[0])
    await store.append(own, [Message.assistant(answers(who, n))], [2])
    await store.record(own, RunCompletedEpisode())
    stats = await store.stats(own)
    assert (stats.message_count, stats.total_tokens, stats.last_seq) == (2 * n + 2, 5 * n + 5, 2 * n + 2)
    assert (await store.state(own)).stats == stats
    await store.pressure(own)
    window = await store.load(own)
    assert [stored.message.text for stored in window.messages[-2:]] == [asks(who, n), answers(who, n)]
    tail = await store.tail(own, after_seq=stats.last_seq - 2)
    assert [stored.seq for stored in tail.messages] == [stats.last_seq - 1, stats.last_seq]
    assert len([record async for record in store.replay(own)]) == 2 * n + 2
    async with store.compaction_lock(own) as held:
        assert held  # no other thread asks for this one
    if shared:
        await store.append(SHARED, [Message.user(f"loop {who} says {n}")], [1])


async def test_calls_from_event_loops_in_other_threads_all_complete(
    store: Any, backend: str, anyio_backend: str
) -> None:
    # MemoryStore makes each call atomic on one event loop; two threads writing one thread's
    # context at the same moment are outside what it promises (see its docstring).
    shared = backend != "memory"
    deadline = time.monotonic() + LIMIT
    errors: list[BaseException] = []

    async def within_limit(who: int, n: int) -> None:
        with anyio.fail_after(max(0.1, deadline - time.monotonic())):
            await step(store, who, n, shared=shared)

    def serve(who: int) -> None:
        try:
            for n in range(STEPS):  # a fresh event loop per call, as _run_blocking makes them
                anyio.run(partial(within_limit, who, n), backend=anyio_backend)
        except BaseException as exc:  # reported below, by the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(who,), daemon=True) for who in range(LOOPS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        await anyio.to_thread.run_sync(thread.join, max(0.0, deadline + 5.0 - time.monotonic()))
    stuck = [n for n, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"the event loops of threads {stuck} never finished their calls: a call hung"
    assert not errors, errors

    for who in range(LOOPS):
        window = await store.load(f"loop {who}")
        expected = [text for n in range(STEPS) for text in (asks(who, n), answers(who, n))]
        assert [stored.message.text for stored in window.messages] == expected
        assert [stored.seq for stored in window.messages] == list(range(1, 2 * STEPS + 1))
        records = [record async for record in store.replay(f"loop {who}")]
        assert [record.seq for record in records] == list(range(1, 2 * STEPS + 1))
        assert [record.episode.kind for record in records] == ["user_message", "run_completed"] * STEPS
    if shared:
        window = await store.load(SHARED)
        said = sorted(stored.message.text for stored in window.messages)
        assert said == sorted(f"loop {who} says {n}" for who in range(LOOPS) for n in range(STEPS))
        assert [stored.seq for stored in window.messages] == list(range(1, LOOPS * STEPS + 1))
        assert (await store.stats(SHARED)).message_count == LOOPS * STEPS


def run_blocking(fn: Callable[[], Any], backend: str) -> Any:
    """As ``integrations.langchain._run_blocking``: ``fn`` in a new loop, in a thread if a loop runs here."""
    try:
        anyio.get_current_task()
    except RuntimeError:
        return anyio.run(fn, backend=backend)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(anyio.run, fn, backend=backend).result()


async def test_a_sync_call_made_on_the_loop_that_opened_the_store_completes(
    store: Any, backend: str, anyio_backend: str
) -> None:
    """A sync call made on the store's own loop blocks that loop while another loop makes its calls.

    What a sync ``invoke`` made inside async code does: no call may need the
    blocked loop (PostgresStore's pool belongs to it) to complete.
    """
    for n in range(3):
        run_blocking(partial(step, store, 0, n, shared=backend != "memory"), anyio_backend)
    assert (await store.stats("loop 0")).message_count == 6


@pytest.fixture
def unopened(backend: str, database: dict[str, str]) -> Iterator[Any]:
    """A new store handle on the test's database, opened by the test in loops of its own."""
    if backend == "memory":
        yield MemoryStore()
    elif backend.startswith("sqlite"):
        yield SQLiteStore(database["path"], synchronous="NORMAL" if backend == "sqlite-normal" else "FULL")
    else:
        from contextfold.stores import PostgresStore

        yield PostgresStore(database["url"], schema=database["schema"], min_size=1, max_size=2)
        import psycopg

        with psycopg.connect(database["url"], autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{database["schema"]}" CASCADE')


def test_a_store_opened_and_closed_by_loops_that_ended_serves_the_loops_in_between(
    unopened: Any, backend: str, database: dict[str, str], anyio_backend: str
) -> None:
    """A sync program: a loop opens the store and ends, loops in three threads use it at once, one closes it.

    The loop that opened it is gone by the time the others call (PostgresStore's
    pool was opened there), and the one that closes it is another still.
    """
    store = unopened
    anyio.run(store.__aenter__, backend=anyio_backend)
    errors: list[BaseException] = []
    deadline = time.monotonic() + LIMIT

    async def within_limit(who: int, n: int) -> None:
        with anyio.fail_after(max(0.1, deadline - time.monotonic())):
            await step(store, who, n, shared=backend != "memory")

    def serve(who: int) -> None:
        try:
            for n in range(STEPS):
                anyio.run(partial(within_limit, who, n), backend=anyio_backend)
        except BaseException as exc:  # reported below, by the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(who,), daemon=True) for who in range(LOOPS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline + 5.0 - time.monotonic()))
    stuck = [n for n, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"the event loops of threads {stuck} never finished their calls: a call hung"
    assert not errors, errors

    async def read_back() -> list[int]:
        return [(await store.stats(f"loop {who}")).message_count for who in range(LOOPS)]

    assert anyio.run(read_back, backend=anyio_backend) == [2 * STEPS] * LOOPS
    anyio.run(store.aclose, backend=anyio_backend)
    # The store's own threads (SQLite's worker, PostgreSQL's pool of the other loops) ended with it.
    own = {f"contextfold-sqlite {database.get('path')}", f"contextfold-postgres {database.get('schema')}"}
    assert not [thread.name for thread in threading.enumerate() if thread.name in own]


def test_memory_store_keeps_two_threads_writing_one_conversation_apart() -> None:
    """Two OS threads, each with its own event loop, appending to one conversation: every seq once.

    Before, each write's read of the last seq and its write could interleave with the other thread's
    (forced here by a tiny switch interval), and rows were written with the same seq.
    """
    store = MemoryStore()
    compactor = Compactor(store, counter=ApproximateCounter())

    async def write(name: str) -> None:
        for n in range(400):
            await compactor.append("shared", [Message.user(f"{name} {n}")])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=anyio.run, args=(write, name)) for name in ("a", "b")]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
            assert not worker.is_alive()
    finally:
        sys.setswitchinterval(interval)

    async def check() -> None:
        window = await store.load("shared")
        seqs = [stored.seq for stored in window.messages]
        assert seqs == list(range(1, 801))
        assert window.total_tokens == sum(stored.tokens for stored in window.messages)
        records = [record async for record in store.replay("shared")]
        assert [record.seq for record in records] == list(range(1, 801))

    anyio.run(check)
