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
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import contextfold._compactor as compactor_module
from contextfold import Compactor, ConfigError, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import ContextWindow, MemoryStore, SQLiteStore, StoredMessage, ThreadStats
from contextfold.stores._rows import writes_to
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


def settings(budget: int = 100_000, **extra: Any) -> RunOptions:
    return RunOptions(
        max_history_tokens=budget * 2,
        compaction=SummarizeOptions(
            trigger_token_budget=budget,
            max_summary_tokens=60,
            min_recent_messages=2,
            min_recent_turns=1,
            **extra,
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


class DictShortTerm:
    """A user's own ShortTermStore (the protocol contextfold.stores exports), e.g. one over Redis.

    It knows nothing of contextfold's private per-process write counter.
    """

    def __init__(self) -> None:
        self.rows: dict[str, list[StoredMessage]] = {}
        self.version: dict[str, int] = {}
        self.last: dict[str, int] = {}

    async def __aenter__(self) -> DictShortTerm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def _stats(self, thread: str) -> ThreadStats:
        rows = self.rows.get(thread, [])
        return ThreadStats(
            message_count=len(rows),
            total_tokens=sum(r.tokens for r in rows),
            version=self.version.get(thread, 0),
            last_seq=self.last.get(thread, 0),
        )

    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        rows = self.rows.setdefault(thread, [])
        out = []
        for message, count in zip(messages, tokens, strict=True):
            self.last[thread] = self.last.get(thread, 0) + 1
            stored = StoredMessage(seq=self.last[thread], message=message, tokens=count)
            rows.append(stored)
            out.append(stored)
        return out

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        rows = list(self.rows.get(thread, []))
        complete = True
        if max_tokens is not None:
            kept: list[StoredMessage] = []
            used = 0
            for row in reversed(rows):
                if used + row.tokens > max_tokens:
                    complete = False
                    break
                kept.append(row)
                used += row.tokens
            rows = kept[::-1]
        stats = self._stats(thread)
        return ContextWindow(
            thread=thread,
            messages=tuple(rows),
            version=stats.version,
            total_tokens=stats.total_tokens,
            complete=complete,
            last_seq=stats.last_seq,
        )

    async def stats(self, thread: str) -> ThreadStats:
        return self._stats(thread)

    async def replace_prefix(
        self,
        thread: str,
        *,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
    ) -> ThreadStats:
        from contextfold import ConflictError

        if self.version.get(thread, 0) != expected_version:
            raise ConflictError(f"{thread}: version moved")
        rows = self.rows.get(thread, [])
        if through_seq not in {r.seq for r in rows}:
            raise ConflictError(f"{thread}: no seq {through_seq}")
        kept = [r for r in rows if r.seq > through_seq]
        first = through_seq - len(replacement) + 1
        new = [
            StoredMessage(seq=first + i, message=m, tokens=t)
            for i, (m, t) in enumerate(zip(replacement, tokens, strict=True))
        ]
        self.rows[thread] = new + kept
        self.version[thread] = self.version.get(thread, 0) + 1
        return self._stats(thread)

    @contextlib.asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        yield True


async def test_a_user_short_term_store_append_is_seen_by_the_next_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a user's own ShortTermStore, whose writes no count sees, every check reads the store.

    Append, check, context, append a paste far over the trigger, check: the
    second check folds. It was handed the first check's read (no count had
    moved), and sent a context over the budget.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    short = DictShortTerm()
    async with MemoryStore() as log:
        compactor = Compactor(
            short_term=short,
            episodic=log,
            options=settings(400),
            counter=ApproximateCounter(),
            log_events=False,
        )
        for n in range(3):
            await compactor.append(THREAD, [Message.user(f"question {n}")])
            await compactor.append(THREAD, [Message.assistant(f"answer {n}")])
        assert await compactor.maybe_compact(THREAD) is None  # small: no fold, and it read the stats
        await compactor.context(THREAD)
        await compactor.append(THREAD, [Message.user("paste: " + "word " * 1200)])  # ~1500 tokens
        assert (await short.stats(THREAD)).total_tokens > 800  # over budget and max_history_tokens
        result = await compactor.maybe_compact(THREAD)
        assert result is not None and result.compacted, "the check used stats read before the append"


async def test_another_store_objects_write_committed_after_ours_is_seen_by_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers of one process, each with its own SQLiteStore on one file.

    B's large batch is under way (encoded in its worker thread) when A's step
    write begins; A commits first, B next, and then A checks. A write under
    way when a read is made may commit after it, so that read stands for
    nothing: A's check and context have B's row. The count was taken after B's
    write began and never moved again, so A sent its context without B's row.
    """
    from contextfold.episodes import UserMessageEpisode

    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    path = tmp_path / "cf.db"
    async with SQLiteStore(path) as a, SQLiteStore(path) as b:
        worker = Compactor(a, options=settings(1_000_000), counter=ApproximateCounter(), log_events=False)
        for n in range(3):
            await worker.append(THREAD, [Message.user(f"message {n}")])
            assert await worker.maybe_compact(THREAD) is None
            await worker.context(THREAD)
        big = Message.user("pasted " + "x" * 30_000_000)  # heavy: B encodes it in its worker thread
        before = writes_to(THREAD)
        done = anyio.Event()

        async def other_worker() -> None:
            await b.record_and_append(
                THREAD, [UserMessageEpisode(message=big)], [big], [7], message_episodes=[0]
            )
            done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(other_worker)
            while writes_to(THREAD) == before:  # B began its write (the count moved)
                await anyio.sleep(0)
            await worker.append(THREAD, [Message.user("from A")])
            assert not done.is_set(), "setup: B must still be encoding when A commits"
        assert done.is_set()  # B committed, before A's check below
        stored = (await a.load(THREAD)).plain
        assert [m.text[:7] for m in stored][-2:] == ["from A", "pasted "]
        assert await worker.maybe_compact(THREAD) is None
        context = await worker.context(THREAD)
        assert [m.text[:7] for m in context] == [m.text[:7] for m in stored], "B's committed row is missing"


@pytest.mark.postgres
async def test_another_compactors_postgres_write_committed_after_ours_is_seen_by_the_check(
    monkeypatch: pytest.MonkeyPatch, postgres_url: str
) -> None:
    """Two compactors of one process on PostgreSQL, each with its own PostgresStore (B's pool idle at 0).

    B's step write begins and waits for a connection; A's step write begins
    after it and commits first; B commits next, both before A's check. A's
    check and context show B's message.
    """
    from contextfold.stores import PostgresStore

    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    async with (
        scratch_schema(postgres_url) as schema,
        PostgresStore(postgres_url, schema=schema) as a,
        PostgresStore(postgres_url, schema=schema, min_size=0) as b,
    ):
        worker_a = Compactor(a, options=settings(1_000_000), counter=ApproximateCounter(), log_events=False)
        worker_b = Compactor(b, options=settings(1_000_000), counter=ApproximateCounter(), log_events=False)
        for n in range(3):
            await worker_a.append(THREAD, [Message.user(f"message {n}")])
            assert await worker_a.maybe_compact(THREAD) is None
            await worker_a.context(THREAD)
        before = writes_to(THREAD)
        done = anyio.Event()

        async def other_worker() -> None:
            await worker_b.append(THREAD, [Message.user("from B")])
            done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(other_worker)
            while writes_to(THREAD) == before:
                await anyio.sleep(0)
            await worker_a.append(THREAD, [Message.user("from A")])
            assert not done.is_set(), "setup: B must still be connecting when A commits"
        stored = [m.text for m in (await a.load(THREAD)).plain]
        assert stored[-2:] == ["from A", "from B"]
        assert await worker_a.maybe_compact(THREAD) is None
        context = await worker_a.context(THREAD)
        assert [m.text for m in context] == stored, "B's committed row is missing from A's context"


def held_summarizer(started: anyio.Event, release: anyio.Event) -> Any:
    """A summarizer that says it started, then waits to be released."""
    from contextfold.summarizers import FunctionSummarizer, Summary

    async def fn(messages: Any, previous: Any, limit: int) -> Summary:
        started.set()
        await release.wait()
        return Summary(text="summary", model="s")

    return FunctionSummarizer(fn)


async def test_the_compactors_own_background_fold_is_seen_by_the_next_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check whose read fell while this compactor's own background fold was being written.

    The fold's ``store.fold`` begins, and commits a moment later (SQLite's
    pacer yields in between). A check in that gap reads the row before the
    fold; the check after the commit must not be handed that read again (it
    was: the old version, token total and message count). Observed through
    the stats the check is handed (``_observe`` wrapped on the instance).
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    async with SQLiteStore(tmp_path / "cf.db") as store:
        for trial in range(10):
            thread = f"t{trial}"
            started, release = anyio.Event(), anyio.Event()

            opts = settings(1000, background_at=0.6)
            compactor = Compactor(
                store,
                options=opts,
                summarizer=held_summarizer(started, release),
                counter=ApproximateCounter(),
                log_events=False,
            )
            handed: list[ThreadStats] = []
            observe = compactor._observe

            async def spy(*args: Any, _observe: Any = observe, _handed: Any = handed) -> Any:
                stats, episodic = await _observe(*args)
                _handed.append(stats)
                return stats, episodic

            compactor._observe = spy  # type: ignore[method-assign]
            async with compactor:
                n = 0
                while not started.is_set():  # grow until the background summary starts
                    await compactor.append(thread, [Message.user(f"q{n} " + "w " * 40)])
                    await compactor.append(thread, [Message.assistant(f"a{n} " + "w " * 40)])
                    assert await compactor.maybe_compact(thread) is None
                    await compactor.context(thread)
                    n += 1
                    await anyio.sleep(0)
                version = (await store.stats(thread)).version
                before = writes_to(thread)
                release.set()
                while writes_to(thread) == before:  # the background fold's write began
                    await anyio.sleep(0)
                if (await store.stats(thread)).version != version:
                    continue  # it committed at once: not the interleaving looked for
                await compactor.maybe_compact(thread)  # reads the row while the fold is in flight
                for _ in range(1000):
                    if (await store.stats(thread)).version != version:
                        break
                    await anyio.sleep(0)
                else:
                    continue
                handed.clear()
                await compactor.maybe_compact(thread)  # the fold has committed: this check must know it
                assert handed == [await store.stats(thread)], "the check was handed the row before the fold"
                return
    pytest.skip("the interleaving did not occur")


class UncountedStore:
    """A custom ``Store`` (say, a Redis or DynamoDB backend a user wrote).

    It keeps its rows in a ``MemoryStore`` for brevity, but its writes go to
    that store's undecorated methods, as a user's own backend would: they call
    no ``begin_write``/``end_write`` (those are private to the bundled stores),
    so ``writes_to`` never sees them.
    """

    def __init__(self) -> None:
        self.inner = MemoryStore()

    async def __aenter__(self) -> UncountedStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.inner.aclose()

    # reads
    async def load(self, thread: str, *, max_tokens: int | None = None) -> Any:
        return await self.inner.load(thread, max_tokens=max_tokens)

    async def tail(self, thread: str, *, after_seq: int) -> Any:
        return await self.inner.tail(thread, after_seq=after_seq)

    async def stats(self, thread: str) -> Any:
        return await self.inner.stats(thread)

    async def state(self, thread: str, *, now: Any = None) -> Any:
        return await self.inner.state(thread, now=now)

    def replay(self, thread: str, *, from_seq: int = 0) -> Any:
        return self.inner.replay(thread, from_seq=from_seq)

    async def pressure(self, thread: str, **kwargs: Any) -> Any:
        return await self.inner.pressure(thread, **kwargs)

    async def latest_checkpoint(self, thread: str) -> Any:
        return await self.inner.latest_checkpoint(thread)

    async def tombstones(self, thread: str) -> Any:
        return await self.inner.tombstones(thread)

    async def threads(self) -> Any:
        return await self.inner.threads()

    def compaction_lock(self, thread: str) -> Any:
        return self.inner.compaction_lock(thread)

    async def record(self, thread: str, episode: Any, *, at: Any = None) -> Any:
        return await self.inner.record(thread, episode, at=at)

    # writes: not counted, as no custom store's are
    async def append(self, thread: str, messages: Any, tokens: Any) -> Any:
        return await _raw(MemoryStore.append)(self.inner, thread, messages, tokens)

    async def record_and_append(
        self, thread: str, episodes: Any, messages: Any, tokens: Any, *, message_episodes: Any = None
    ) -> Any:
        for episode in episodes:
            await self.inner.record(thread, episode)
        return await _raw(MemoryStore.append)(self.inner, thread, messages, tokens)

    async def replace_prefix(self, thread: str, **kwargs: Any) -> Any:
        return await _raw(MemoryStore.replace_prefix)(self.inner, thread, **kwargs)

    async def fold(self, thread: str, **kwargs: Any) -> Any:
        return await _raw(MemoryStore.fold)(self.inner, thread, **kwargs)

    async def record_and_replace(self, thread: str, *args: Any, **kwargs: Any) -> Any:
        return await _raw(MemoryStore.record_and_replace)(self.inner, thread, *args, **kwargs)

    async def forget(self, thread: str) -> Any:
        return await _raw(MemoryStore.forget)(self.inner, thread)


def _raw(method: Any) -> Any:
    """A bundled store's method without its write count: a custom backend's write, which no count sees."""
    return getattr(method, "__wrapped__", method)


async def test_custom_store_second_context_sees_another_workers_append(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a custom store, a second ``context()`` after a check must see what another worker appended.

    Two workers of one process share a custom store. A checks, sends its
    context, then B appends a message; A's next ``context()`` (``context_tokens``
    for a request, a hook, a framework adapter asking again) must hold it: a
    write by any store object of the process, committed before the read is
    used, is never missed, and a custom store's writes reach no write count,
    so nothing but a read can tell A about B's message.

    The check's read stood for every ``context()`` for 10 ms, since no count
    moves for a custom store: B's committed message was missing.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    thread = "custom-second-context"
    async with UncountedStore() as store:
        a = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
        b = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
        await a.append(thread, [Message.user("first")])
        assert await a.maybe_compact(thread) is None
        assert [m.text for m in await a.context(thread)] == ["first"]
        await b.append(thread, [Message.user("from B")])
        again = [m.text for m in await a.context(thread)]
        assert again == [m.text for m in (await store.load(thread)).plain] == ["first", "from B"]


async def test_seen_stays_bounded_across_many_threads() -> None:
    """A long-lived compactor serving many threads keeps a bounded ``_seen``, as it bounds its caches.

    ``_cache`` holds at most ``_CACHED_THREADS`` (1024) threads and the two-store
    bookkeeping (``_reckoned``) as many. Every step's write keeps a read for
    its thread: a server with a conversation per user kept one for every
    thread it ever wrote, for the life of the process.
    """
    threads = 3 * compactor_module._CACHED_THREADS
    async with MemoryStore() as store:
        compactor = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
        for n in range(threads):
            thread = f"user-{n}"
            await compactor.append(thread, [Message.user("hello")])
            assert await compactor.maybe_compact(thread) is None
            await compactor.context(thread)
        assert len(compactor._cache) <= compactor_module._CACHED_THREADS
        assert len(compactor._seen) <= compactor_module._CACHED_THREADS, len(compactor._seen)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_check_after_a_whole_tool_step_reads_nothing(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check right after a step's ``append`` reads nothing on a bundled store, tool steps included.

    ``append(thread, [reply, *results], started=reply.tool_calls)`` is the
    documented way to record a whole step at once, and the one ``StepLoop``
    uses for every tool step. It went through ``store.record_and_append``,
    which returns no stats, so every tool step's check read them.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0)
    thread = f"tool-step-{kind}"
    store: Any = MemoryStore() if kind == "memory" else SQLiteStore(tmp_path / "cf.db")
    async with store:
        compactor = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
        await compactor.append(thread, [Message.user("task")])
        assert await compactor.maybe_compact(thread) is None
        await compactor.context(thread)
        reads = counted(store)
        per_step = []
        for n in range(3):
            call = ToolCall(id=f"c{n}", name="read", arguments="{}")
            reply = Message.assistant(None, tool_calls=[call])
            await compactor.append(thread, [reply, Message.tool(f"c{n}", f"out {n}")], started=[call])
            reads.clear()
            assert await compactor.maybe_compact(thread) is None
            await compactor.context(thread)
            per_step.append(dict(reads))
        # A plain append (no tool call ran) reads nothing after it, as promised.
        await compactor.append(thread, [Message.assistant("done")])
        reads.clear()
        assert await compactor.maybe_compact(thread) is None
        assert dict(reads) == {}
        assert per_step == [{}, {}, {}]


async def fetch(url: str) -> str:
    return f"{url}\n" + "payload line\n" * 20


def fetching_agent(messages: list[Message]) -> Message:
    from contextfold.testing import tool_step

    if messages[-1].role.value == "tool":
        return Message.assistant("answered")
    return tool_step("fetch", '{"url": "https://example.org/a"}', call_id=f"c{len(messages)}")


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_record_and_append_replaced_after_the_compactor_gets_every_tool_step(
    kind: str, tmp_path: Path
) -> None:
    """A wrapper put on ``store.record_and_append`` after the compactor was built sees StepLoop's tool steps.

    The tool step (``append(..., started=reply.tool_calls)``) went through the
    store's step write that the compactor picked when it was built, past the
    wrapper.
    """
    from contextfold import StepLoop
    from contextfold.testing import ScriptedModel

    store: Any = MemoryStore() if kind == "memory" else SQLiteStore(tmp_path / "cf.db")
    async with store:
        loop = StepLoop(Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False))
        original = store.record_and_append
        seen: list[list[str]] = []

        async def spy(thread: str, episodes: Any, messages: Any, tokens: Any, **kw: Any) -> Any:
            seen.append([episode.kind for episode in episodes])
            return await original(thread, episodes, messages, tokens, **kw)

        store.record_and_append = spy
        await loop.run(THREAD, "hi", llm=ScriptedModel(fetching_agent), tools={"fetch": fetch})
        assert ["tool_call", "tool_result"] in [kinds[-2:] for kinds in seen], seen


async def test_a_tool_result_on_a_store_of_ones_own_reads_the_thread_once() -> None:
    """A store of the user's own: a tool result's look at the store is one stats read, which it uses.

    The read was kept but not used (no count sees such a store's writes), and
    the context's tail was read as well.
    """
    async with UncountedStore() as store:
        compactor = Compactor(store, options=settings(), counter=ApproximateCounter(), log_events=False)
        await compactor.append(THREAD, [Message.user("task")])
        call = ToolCall(id="c1", name="read", arguments="{}")
        await compactor.append(THREAD, [Message.assistant(None, tool_calls=[call])])
        assert await compactor.maybe_compact(THREAD) is None
        await compactor.context(THREAD)
        reads = counted(store)
        await compactor.append(THREAD, [Message.tool("c1", "out")])
        assert reads == {"stats": 1}
        assert [m.text for m in await compactor.context(THREAD)] == ["task", "", "out"]


class ForwardingProxy:
    """A store wrapper that forwards every attribute (``__getattr__``), for logging or metrics, say."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_forwarding_proxy_around_a_bundled_store_builds_a_compactor() -> None:
    """``Compactor(proxy)`` raised ``StopIteration``: the proxy forwards ``_write_recording``, no class of it
    defines it. It is a store of the user's own: every write through its ``record_and_append``."""
    async with MemoryStore() as inner:
        proxy = ForwardingProxy(inner)
        compactor = Compactor(proxy, options=settings(), counter=ApproximateCounter(), log_events=False)
        stored = await compactor.append(THREAD, [Message.user("hi")])
        assert [row.message.text for row in stored] == ["hi"]
        assert await compactor.maybe_compact(THREAD) is None
        assert [m.text for m in await compactor.context(THREAD)] == ["hi"]


class WithdrawnMethods:
    """A wrapper whose every attribute is ``None``: it names a store's methods and has none of them."""

    def __getattr__(self, name: str) -> Any:
        return None


def test_a_wrapper_whose_methods_are_none_is_refused_as_a_store() -> None:
    """Refused when built, naming the store, as ``isinstance`` refuses it, on every Python.

    On Python 3.12+ the check for forwarding wrappers accepted it, and the first
    call failed with ``TypeError: 'NoneType' object is not callable``.
    """
    with pytest.raises(ConfigError, match="must implement ShortTermStore"):
        Compactor(WithdrawnMethods(), options=settings(), counter=ApproximateCounter())
