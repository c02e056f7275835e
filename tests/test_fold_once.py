"""Each original message reaches the summarizer at most once (invariant 6), on every backend.

Two ways a paid summary used to be thrown away and the same messages sent again:
a step cancelled between the summary's arrival and the fold's write, and a
second worker that took the lease just after another worker's fold and planned
over what it had read before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold import Compactor, Message, RunOptions, SummarizeOptions
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import ApproximateCounter

THREAD = "t"
OPTIONS = RunOptions(
    max_history_tokens=4_000,
    compaction=SummarizeOptions(trigger_token_budget=2_000, min_recent_messages=2),
)

Handles = Callable[[], AbstractAsyncContextManager[tuple[Any, Any]]]
"""Two handles on one database (the same object for memory), opened and closed together."""


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def handles(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Handles]:
    if request.param == "postgres":
        import psycopg

        from contextfold.stores import PostgresStore

        url = request.getfixturevalue("postgres_url")
        schema = f"cf_once_{uuid.uuid4().hex[:12]}"

        @asynccontextmanager
        async def postgres() -> AsyncIterator[tuple[Any, Any]]:
            async with PostgresStore(url, schema=schema) as a, PostgresStore(url, schema=schema) as b:
                yield a, b

        yield postgres
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    elif request.param == "sqlite":

        @asynccontextmanager
        async def sqlite() -> AsyncIterator[tuple[Any, Any]]:
            path = tmp_path / "cf.db"
            async with SQLiteStore(path) as a, SQLiteStore(path) as b:
                yield a, b

        yield sqlite
    else:

        @asynccontextmanager
        async def memory() -> AsyncIterator[tuple[Any, Any]]:
            async with MemoryStore() as store:
                yield store, store

        yield memory


class Recording(FunctionSummarizer):
    """Records the first word of every message it is sent; ``on_summary`` runs as each summary returns."""

    def __init__(self, sent: list[str], on_summary: Callable[[], None] = lambda: None) -> None:
        async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
            await anyio.sleep(0.005)  # the provider's round trip
            sent.extend(m.text.split()[0] for m in messages)
            on_summary()
            return f"summary of {len(messages)} messages"

        super().__init__(summarize)


async def grow_past_the_trigger(compactor: Compactor, store: Any) -> None:
    await compactor.append(THREAD, [Message.system("sys")])
    n = 0
    while (await store.stats(THREAD)).total_tokens <= 2_000:
        await compactor.append(THREAD, [Message.user(f"m{n} " + "word " * 40)])
        n += 1


async def test_a_step_cancelled_as_its_summary_arrives_still_writes_the_fold(handles: Handles) -> None:
    """The cancellation waits for the short write; before, the summary was lost and paid for again."""
    sent: list[str] = []
    scope = anyio.CancelScope()
    async with handles() as (store, _):
        compactor = Compactor(
            store, options=OPTIONS, summarizer=Recording(sent, scope.cancel), counter=ApproximateCounter()
        )
        await grow_past_the_trigger(compactor, store)
        with scope:  # e.g. the request's deadline, just as the summary arrives
            await compactor.maybe_compact(THREAD)
        assert scope.cancel_called
        summarized = list(sent)
        assert summarized
        context = await compactor.context(THREAD)
        assert context[1].is_summary and context[1].text.endswith(f"summary of {len(summarized)} messages")
        assert context == (await store.load(THREAD)).plain
        await compactor.maybe_compact(THREAD)
        assert sent == summarized  # nothing was sent to the summarizer again


async def test_a_worker_leased_just_after_another_workers_fold_summarizes_nothing_again(
    handles: Handles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B checked before A folded and got the lease after: it reads the thread again and does not fold."""
    sent: list[str] = []
    async with handles() as (store_a, store_b):
        a = Compactor(store_a, options=OPTIONS, summarizer=Recording(sent), counter=ApproximateCounter())
        b = Compactor(store_b, options=OPTIONS, summarizer=Recording(sent), counter=ApproximateCounter())
        await grow_past_the_trigger(a, store_a)
        await b.context(THREAD)  # B has served this thread before: its cache holds the rows
        leased, checked = anyio.Event(), anyio.Event()
        lock = store_b.compaction_lock

        @asynccontextmanager
        async def late_lease(thread: str) -> AsyncIterator[bool]:
            if anyio.get_current_task().name == "worker b":  # one store object on memory
                checked.set()
                await leased.wait()  # B's lease lands just after A's fold
            async with lock(thread) as held:
                yield held

        monkeypatch.setattr(store_b, "compaction_lock", late_lease)
        async with anyio.create_task_group() as group:
            results: list[Any] = []

            async def worker_b() -> None:
                results.append(await b.maybe_compact(THREAD))

            group.start_soon(worker_b, name="worker b")
            with anyio.fail_after(10):
                await checked.wait()
            folded = await a.maybe_compact(THREAD)
            assert folded is not None and folded.compacted
            leased.set()
        assert results == [None]
        assert len(sent) == folded.dropped_messages  # A's summary alone; B sent nothing
        assert len(set(sent)) == len(sent)
        assert await b.context(THREAD) == (await store_a.load(THREAD)).plain


async def test_a_slow_subscriber_does_not_make_the_fold_uncancellable(handles: Handles) -> None:
    """Only the write is shielded: a deadline ends the step while a subscriber hangs, the fold stands."""
    sent: list[str] = []
    heard = anyio.Event()

    async def hanging_webhook(event: object) -> None:
        heard.set()
        await anyio.sleep(10)  # a webhook post that hangs

    async with handles() as (store, _):
        compactor = Compactor(
            store,
            options=OPTIONS,
            summarizer=Recording(sent),
            counter=ApproximateCounter(),
            subscribers=[hanging_webhook],
        )
        await grow_past_the_trigger(compactor, store)
        started = time.monotonic()
        with anyio.move_on_after(0.5) as deadline:
            await compactor.compact_now(THREAD)
        assert heard.is_set() and deadline.cancelled_caught
        assert time.monotonic() - started < 5  # at the deadline, not when the webhook gave up
        context = await compactor.context(THREAD)
        assert context[1].is_summary and context == (await store.load(THREAD)).plain
