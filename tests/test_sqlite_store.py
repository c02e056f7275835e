"""What only the SQLite backend does: its file, schema version, leases and worker threads."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from contextfold import ConfigError, Message, StoreError
from contextfold._errors import StoreClosedError
from contextfold._pacing import PACE_SECONDS
from contextfold.episodes import SummaryCheckpoint, UserMessageEpisode, episode_for
from contextfold.stores import SQLiteStore, ThreadStats
from contextfold.stores._sqlite import _BODY, _ENDS_KEPT, _MIGRATIONS, _WITH_EPISODES, SCHEMA_VERSION, _Worker


def query(path: Path, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path, timeout=30)
    try:
        with conn:
            return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


async def test_a_new_file_is_in_wal_mode_at_the_current_schema(tmp_path: Path) -> None:
    """Opening creates the file in WAL mode with ``PRAGMA user_version`` at the schema version."""
    path = tmp_path / "new.db"
    async with SQLiteStore(path):
        pass
    assert query(path, "PRAGMA journal_mode") == [("wal",)]
    assert query(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]


async def test_a_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A file at a newer schema version raises StoreError naming the version and the fix, untouched."""
    path = tmp_path / "future.db"
    query(path, "PRAGMA user_version = 99")
    store = SQLiteStore(path)
    with pytest.raises(StoreError, match=r"schema version 99.*upgrade contextfold"):
        await store.__aenter__()
    await store.aclose()
    assert query(path, "PRAGMA user_version") == [(99,)]
    assert query(path, "SELECT name FROM sqlite_master") == []


async def test_several_stores_opening_a_new_file_at_once_create_one_schema(tmp_path: Path) -> None:
    """Stores opening the same new file concurrently all succeed and share one schema."""
    path = tmp_path / "race.db"
    stores = [SQLiteStore(path) for _ in range(4)]
    async with anyio.create_task_group() as group:
        for store in stores:
            group.start_soon(store.__aenter__)
    try:
        for n, store in enumerate(stores):
            await store.append("t", [Message.user(f"m{n}")], [1])
        assert (await stores[0].stats("t")).message_count == 4
    finally:
        for store in stores:
            await store.aclose()


@pytest.mark.parametrize("first", ["append", "stats", "pressure"])
async def test_a_store_opens_on_first_use(tmp_path: Path, first: str) -> None:
    """A store used without ``async with`` opens its file on the first call, a read included."""
    store = SQLiteStore(tmp_path / "lazy.db")
    try:
        if first != "append":
            await getattr(store, first)("t")
        await store.append("t", [Message.user("hi")], [1])
        assert (await store.stats("t")).message_count == 1
    finally:
        await store.aclose()


async def test_an_unopenable_path_names_the_file(tmp_path: Path) -> None:
    """A path SQLite cannot open raises StoreError naming the path."""
    store = SQLiteStore(tmp_path)
    with pytest.raises(StoreError, match=str(tmp_path)):
        await store.stats("t")
    await store.aclose()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("busy_timeout", 0),
        ("busy_timeout", "30"),
        ("busy_timeout", None),
        ("busy_timeout", float("inf")),
        ("busy_timeout", float("nan")),
        ("busy_timeout", True),
        ("busy_timeout", 10**12),
        ("lease_seconds", -1),
        ("lease_seconds", "x"),
        ("lease_seconds", None),
        ("lease_seconds", float("inf")),
        ("synchronous", "OFF"),
        ("synchronous", None),
        ("synchronous", "full"),
    ],
)
def test_bad_options_are_config_errors(tmp_path: Path, option: str, value: Any) -> None:
    """A bad timeout, lease or synchronous mode is a ConfigError naming the option, before the file exists."""
    with pytest.raises(ConfigError) as caught:
        SQLiteStore(tmp_path / "x.db", **{option: value})
    assert caught.value.key == option
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", ["agent\x00.db", b"agent.db", None, 3, "", "bad-\udc80.db"])
def test_a_bad_path_is_a_config_error_before_any_file_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: Any
) -> None:
    """A path with a NUL, bytes, a non-path or a lone surrogate is a ConfigError naming 'path'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        SQLiteStore(path)
    assert caught.value.key == "path"
    assert list(tmp_path.iterdir()) == []


def test_the_in_memory_database_is_refused_with_the_store_to_use_instead() -> None:
    """':memory:' would give each connection its own empty database; the error names MemoryStore."""
    with pytest.raises(ConfigError) as caught:
        SQLiteStore(":memory:")
    assert caught.value.key == "path"
    assert caught.value.value == ":memory:"
    assert "MemoryStore()" in str(caught.value)


class _BytesPath:
    def __fspath__(self) -> bytes:
        return b"agent.db"


def test_a_path_object_giving_bytes_is_a_config_error() -> None:
    """A path-like object whose path is bytes is refused with the fix (os.fsdecode)."""
    with pytest.raises(ConfigError, match="fsdecode") as caught:
        SQLiteStore(_BytesPath())  # type: ignore[arg-type]
    assert caught.value.key == "path"


def test_good_options_are_accepted_as_given(tmp_path: Path) -> None:
    """Whole-number seconds and either synchronous mode are accepted."""
    store = SQLiteStore(str(tmp_path / "ok.db"), busy_timeout=5, lease_seconds=0.25, synchronous="NORMAL")
    assert store.path == tmp_path / "ok.db"


def _old_database(path: Path, version: int) -> None:
    """A database as schema ``version`` (1 to 3) wrote it: a thread in both memories, "from v<version>".

    Schema 2 links the message row to its episode; both keep the message's text
    (in schema 3 too, which shares it only for rows it wrote itself).
    """
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for target in range(1, version + 1):
            for statement in _MIGRATIONS[target]:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {version}")
        message = Message.user(f"from v{version}")
        conn.execute("INSERT INTO threads VALUES ('t', 1, 5, 0, 1)")
        link = {1: "", 2: ", 1", 3: ", 1, NULL"}[version]
        conn.execute(f"INSERT INTO messages VALUES ('t', 1, 5, ?{link})", (message.model_dump_json(),))
        episode = UserMessageEpisode(message=message).model_dump_json()
        conn.execute(
            "INSERT INTO episodes VALUES ('t', 1, '2026-01-01T00:00:00+00:00', 'user_message', ?)", (episode,)
        )
        conn.execute(
            "INSERT INTO episode_threads VALUES ('t', 1, 1, 1, 0, 1, NULL, '2026-01-01T00:00:00+00:00')"
        )
    finally:
        conn.close()


async def test_a_version_1_database_is_migrated_and_keeps_its_data(tmp_path: Path) -> None:
    """Opening a schema-1 file migrates it to the current schema; its rows read back and forget works."""
    path = tmp_path / "v1.db"
    _old_database(path, 1)
    async with SQLiteStore(path) as store:
        window = await store.load("t")
        assert window.plain == [Message.user("from v1")]
        assert window.messages[0].episode_seq is None
        old = UserMessageEpisode(message=Message.user("from v1"))
        assert [r.episode async for r in store.replay("t")] == [old]
        new = UserMessageEpisode(message=Message.user("v2"))
        stored = await store.record_and_append("t", [new], [Message.user("v2")], [1], message_episodes=[0])
        assert (stored[0].seq, stored[0].episode_seq) == (2, 2)
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            query(path, "DELETE FROM episodes WHERE thread = 't'")
        tombstone = await store.forget("t")
        assert (tombstone.messages, tombstone.episodes) == (2, 2)
    assert query(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)] == [(4,)]
    assert query(path, "SELECT count(*) FROM episodes") == [(0,)]


async def test_a_version_2_database_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    """Schema 2 kept each message's text twice: its rows read back after the migration, and new ones share."""
    path = tmp_path / "v2.db"
    _old_database(path, 2)
    async with SQLiteStore(path) as store:
        step = UserMessageEpisode(message=Message.user("from v3"))
        await store.record_and_append("t", [step], [step.message], [1], message_episodes=[0])
        window = await store.load("t")
        assert window.plain == [Message.user("from v2"), Message.user("from v3")]
        assert [m.episode_seq for m in window.messages] == [1, 2]
        assert (await store.tail("t", after_seq=1)).plain == [Message.user("from v3")]
    assert query(path, "PRAGMA user_version") == [(4,)]
    assert query(path, "SELECT seq, body IS NULL, body_chars FROM messages ORDER BY seq") == [
        (1, 0, None),
        (2, 1, len(Message.user("from v3").model_dump_json())),
    ]
    assert query(path, "SELECT name FROM sqlite_master WHERE name LIKE 'messages%'") == [("messages",)]


async def test_a_version_3_database_keeps_each_thread_s_stats_and_counters_in_one_row(tmp_path: Path) -> None:
    """Schema 3 kept a thread's stats and its log's counters in two tables: they merge into one row each.

    A thread with rows only, one with episodes only and one with both read back
    as before, and a step then updates the merged row in place.
    """
    path = tmp_path / "v3.db"
    _old_database(path, 3)
    query(path, "INSERT INTO threads VALUES ('rows only', 2, 9, 3, 7)")
    counters = "('log only', 4, 2, 1, 1, 0, 3, '2026-01-02T00:00:00+00:00')"
    query(path, f"INSERT INTO episode_threads VALUES {counters}")
    async with SQLiteStore(path) as store:
        assert await store.stats("rows only") == ThreadStats(
            message_count=2, total_tokens=9, version=3, last_seq=7
        )
        assert await store.stats("log only") == ThreadStats()
        log_only = await store.pressure("log only")
        assert (log_only.total_user_messages, log_only.user_messages_since_boundary) == (2, 1)
        assert log_only.run_completed_since_boundary == 1
        listed = {(info.thread, info.message_count, info.episodes) for info in await store.threads()}
        assert listed == {("t", 1, 1), ("rows only", 2, 0), ("log only", 0, 4)}
        step = UserMessageEpisode(message=Message.user("from v4"))
        stored = await store.record_and_append("t", [step], [step.message], [1], message_episodes=[0])
        assert (stored[0].seq, stored[0].episode_seq) == (2, 2)
        state = await store.state("t")
        assert (state.stats.message_count, state.stats.total_tokens, state.stats.last_seq) == (2, 6, 2)
        assert state.pressure.total_user_messages == 2
        assert (await store.load("t")).plain == [Message.user("from v3"), Message.user("from v4")]
    tables = {name for (name,) in query(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "episode_threads" not in tables and "threads_v4" not in tables
    merged = "SELECT thread, message_count, last_seq, last_episode_seq FROM threads ORDER BY 1"
    assert query(path, merged) == [
        ("log only", 0, 0, 4),
        ("rows only", 2, 7, 0),
        ("t", 2, 2, 2),
    ]


async def test_a_recorded_message_is_stored_once_in_its_episode(tmp_path: Path) -> None:
    """A message recorded by its own episode keeps its text in the log alone; the row holds only its length.

    A row with no episode of its own (a plain append, a fold's summary, a late
    tool result's note) keeps its text in the row, and every kind reads back.
    """
    path = tmp_path / "once.db"
    text = "x" * 3_000 + " ünïcødé ☃ 𝄞"
    async with SQLiteStore(path) as store:
        recorded = [Message.user(text), Message.assistant("done", metadata={"reply": "a key like the field"})]
        episodes = [UserMessageEpisode(message=recorded[0]), episode_for(recorded[1], model="m")]
        await store.record_and_append("t", episodes, recorded, [10, 2], message_episodes=[0, 1])
        await store.append("t", [Message.user("plain")], [1])
        # The episode records one message and the row holds another: no sharing is possible.
        other = UserMessageEpisode(message=Message.user("said"))
        await store.record_and_append("t", [other], [Message.user("sent")], [1], message_episodes=[0])
        assert (await store.load("t")).plain == [*recorded, Message.user("plain"), Message.user("sent")]
    rows = query(path, "SELECT seq, body IS NULL, episode_seq FROM messages ORDER BY seq")
    assert rows == [(1, 1, 1), (2, 1, 2), (3, 0, None), (4, 0, 3)]
    unshared = [Message.user("plain").model_dump_json(), Message.user("sent").model_dump_json()]
    assert query(path, "SELECT sum(length(body)) FROM messages") == [(sum(map(len, unshared)),)]


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE messages SET body_chars = 5 WHERE seq = 1",
        "UPDATE messages SET body_chars = 'x' WHERE seq = 1",
    ],
    ids=["wrong-length", "mistyped-length"],
)
async def test_a_row_whose_length_does_not_fit_its_episode_is_reported_by_seq(
    tmp_path: Path, statement: str
) -> None:
    """A shared row whose length was changed reads as a corrupt row, named by thread and seq."""
    path = tmp_path / "length.db"
    async with SQLiteStore(path) as store:
        step = UserMessageEpisode(message=Message.user("hello"))
        await store.record_and_append("t", [step], [step.message], [1], message_episodes=[0])
        query(path, statement)
        with pytest.raises(StoreError, match=r"thread 't': short-term message seq 1 is corrupt"):
            await store.load("t")


async def test_state_is_one_statement(tmp_path: Path) -> None:
    """state() runs exactly one SQL statement, however long the thread."""
    async with SQLiteStore(tmp_path / "state.db", synchronous="NORMAL") as store:
        await fill(store, "t", 2_000)
        await store.record("t", UserMessageEpisode(message=Message.user("a")))
        statements: list[str] = []
        assert store._loop_reader is not None
        store._loop_reader.set_trace_callback(statements.append)
        state = await store.state("t")
        store._loop_reader.set_trace_callback(None)
    assert len(statements) == 1, statements
    assert (state.stats.message_count, state.pressure.total_user_messages) == (2_000, 1)
    assert state.pressure.estimated_context_tokens == 2_000


async def test_a_recorded_step_writes_each_row_once_and_reads_none(tmp_path: Path) -> None:
    """A step on a thread with rows: each counter row is updated in place, its new seq returned with it.

    Five statements (BEGIN, the thread's stats and its log's counters in one
    row, the episodes, the messages, COMMIT) and no SELECT of the rows it then
    rewrites.
    """
    async with SQLiteStore(tmp_path / "step.db", synchronous="NORMAL") as store:
        await fill(store, "t", 10)
        episodes = [
            UserMessageEpisode(message=Message.user("a")),
            UserMessageEpisode(message=Message.user("b")),
        ]
        await store.record_and_append(
            "t", episodes, [e.message for e in episodes], [1, 1], message_episodes=[0, 1]
        )
        await thread_settled(store)
        statements: list[str] = []
        assert store._loop_reader is not None
        store._loop_reader.set_trace_callback(statements.append)
        stored = await store.record_and_append(
            "t", episodes, [e.message for e in episodes], [2, 3], message_episodes=[0, 1]
        )
        store._loop_reader.set_trace_callback(None)
        # What each statement does to which table, a statement per row (executemany) told once.
        done = [" ".join(statement.split()[:3]) for statement in statements]
        assert list(dict.fromkeys(done)) == [
            "BEGIN IMMEDIATE",
            "UPDATE threads SET",
            "INSERT INTO episodes",
            "INSERT INTO messages",
            "COMMIT",
        ]
        # The row ends where this store's last step left it: the new seqs need no RETURNING.
        assert not [statement for statement in statements if "RETURNING" in statement]
        assert [(row.seq, row.episode_seq, row.tokens) for row in stored] == [(13, 3, 2), (14, 4, 3)]
        state = await store.state("t")
        assert (state.stats.message_count, state.stats.total_tokens, state.stats.last_seq) == (14, 17, 14)
        assert state.pressure.total_user_messages == state.pressure.user_messages_since_boundary == 4
        assert [r.seq async for r in store.replay("t")] == [1, 2, 3, 4]


def user_step(text: str) -> tuple[list[UserMessageEpisode], list[Message]]:
    episode = UserMessageEpisode(message=Message.user(text))
    return [episode], [episode.message]


async def test_two_stores_taking_turns_on_a_thread_give_every_step_the_next_seqs(tmp_path: Path) -> None:
    """A store's memory of its last step is stale once the other wrote: the row decides the seqs."""
    path = tmp_path / "turns.db"
    async with (
        SQLiteStore(path, synchronous="NORMAL") as first,
        SQLiteStore(path, synchronous="NORMAL") as second,
    ):
        seqs = []
        for n in range(8):
            store = (first, first, second)[n % 3]  # twice in a row, then the other
            episodes, messages = user_step(f"m{n}")
            stored = await store.record_and_append("t", episodes, messages, [n + 1], message_episodes=[0])
            seqs.append((stored[0].seq, stored[0].episode_seq, stored[0].message.text))
        assert seqs == [(n + 1, n + 1, f"m{n}") for n in range(8)]
        for store in (first, second):
            state = await store.state("t")
            assert (state.stats.message_count, state.stats.total_tokens, state.stats.last_seq) == (8, 36, 8)
            assert state.pressure.total_user_messages == 8
            assert [r.episode.message.text async for r in store.replay("t")] == [f"m{n}" for n in range(8)]


async def test_a_step_after_an_episode_recorded_alone_takes_the_seq_after_it(tmp_path: Path) -> None:
    """An episode recorded between two steps moves the log's seq; the next step's episode comes after it."""
    async with SQLiteStore(tmp_path / "record.db", synchronous="NORMAL") as store:
        for text in ("a", "b"):
            await store.record_and_append("t", *user_step(text), [1], message_episodes=[0])
        await store.record("t", UserMessageEpisode(message=Message.user("logged only")))
        stored = await store.record_and_append("t", *user_step("c"), [1], message_episodes=[0])
        assert (stored[0].seq, stored[0].episode_seq) == (3, 4)
        assert [r.seq async for r in store.replay("t")] == [1, 2, 3, 4]
        assert (await store.stats("t")).last_seq == 3


async def test_a_step_that_rolled_back_leaves_the_next_step_its_own_seqs(tmp_path: Path) -> None:
    """A step counted, then rolled back (its row's seq was taken): the next one takes the seqs it left."""
    path = tmp_path / "rollback.db"
    async with SQLiteStore(path, synchronous="NORMAL") as store:
        for text in ("a", "b"):
            await store.record_and_append("t", *user_step(text), [1], message_episodes=[0])
        query(path, "INSERT INTO messages (thread, seq, tokens, body) VALUES ('t', 3, 1, '{}')")
        with pytest.raises(StoreError):
            await store.record_and_append("t", *user_step("lost"), [1], message_episodes=[0])
        query(path, "DELETE FROM messages WHERE thread = 't' AND seq = 3")
        stored = await store.record_and_append("t", *user_step("c"), [5], message_episodes=[0])
        assert (stored[0].seq, stored[0].episode_seq) == (3, 3)
        assert [r.episode.message.text async for r in store.replay("t")] == ["a", "b", "c"]
        stats = await store.stats("t")
        assert (stats.message_count, stats.total_tokens, stats.last_seq) == (3, 7, 3)


async def test_a_store_writing_to_many_threads_keeps_a_bounded_memory_of_their_last_steps(
    tmp_path: Path,
) -> None:
    """A store's memory of each thread's last step starts over past its bound; every step stays right."""
    async with SQLiteStore(tmp_path / "many.db", synchronous="NORMAL") as store:
        threads = [f"t{n}" for n in range(_ENDS_KEPT + 6)]
        for text in ("a", "b"):
            for thread in threads:
                await store.record_and_append(thread, *user_step(text), [1], message_episodes=[0])
                assert len(store._ends) <= _ENDS_KEPT
        for thread in (threads[0], threads[-1]):
            assert [(r.seq, r.message.text) for r in (await store.load(thread)).messages] == [
                (1, "a"),
                (2, "b"),
            ]
            assert [r.seq async for r in store.replay(thread)] == [1, 2]


async def test_state_does_the_same_work_whatever_the_thread_length(tmp_path: Path) -> None:
    """SQLite runs as many VM instructions for state() of a 20,000-message thread as of a 10-message one."""
    async with SQLiteStore(tmp_path / "flat.db", synchronous="NORMAL") as store:
        await fill(store, "short", 10)
        await fill(store, "long", 20_000)
        for thread in ("short", "long"):
            await store.record(thread, UserMessageEpisode(message=Message.user("a")))
        await store.state("short")  # compiles the statement outside the count
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0

        assert store._loop_reader is not None
        store._loop_reader.set_progress_handler(count, 1)
        work = {}
        for thread in ("short", "long"):
            steps = 0
            await store.state(thread)
            work[thread] = steps
    assert work["long"] == work["short"] > 0


async def test_a_lease_row_is_timed_by_the_database_clock(tmp_path: Path) -> None:
    """The lease row expires lease_seconds after the database's own now."""
    path = tmp_path / "clock.db"
    async with SQLiteStore(path, lease_seconds=120) as store, store.compaction_lock("t") as mine:
        assert mine
        ((left,),) = query(
            path, "SELECT expires_at - (julianday('now') - 2440587.5) * 86400.0 FROM compaction_leases"
        )
        assert 110 < left <= 120
    assert query(path, "SELECT count(*) FROM compaction_leases") == [(0,)]


async def test_aclose_is_idempotent_and_survives_cancellation(tmp_path: Path) -> None:
    """aclose() called twice, or from a cancelled scope, leaves the store closed with no connection."""
    store = SQLiteStore(tmp_path / "close.db")
    await store.append("t", [Message.user("a")], [1])
    with anyio.CancelScope() as scope:
        scope.cancel()
        await store.aclose()
    assert (store._conn, store._reader) == (None, None)
    await store.aclose()
    with pytest.raises(StoreClosedError):
        await store.stats("t")


async def test_aclose_during_opening_leaves_no_connection(tmp_path: Path) -> None:
    """A store closed while it is opening ends closed, holding no connection."""
    for turns in range(6):
        store = SQLiteStore(tmp_path / f"race{turns}.db")
        async with anyio.create_task_group() as group:

            async def open_it(store: SQLiteStore = store) -> None:
                with contextlib.suppress(StoreClosedError):
                    await store.__aenter__()

            group.start_soon(open_it)
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
            await store.aclose()
        assert (store._conn, store._reader) == (None, None)


async def test_a_replacing_insert_cannot_overwrite_an_episode(tmp_path: Path) -> None:
    """INSERT OR REPLACE, which deletes without firing DELETE triggers, is refused on the episode table."""
    path = tmp_path / "log.db"
    async with SQLiteStore(path) as store:
        record = await store.record("t", UserMessageEpisode(message=Message.user("original")))
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            query(
                path,
                "INSERT OR REPLACE INTO episodes (thread, seq, at, kind, body) VALUES (?, 1, ?, 'x', '{}')",
                ("t", record.at.isoformat()),
            )
        assert [r async for r in store.replay("t")] == [record]


async def test_waiting_for_another_writer_leaves_the_event_loop_running(tmp_path: Path) -> None:
    """An append queued behind another connection's write lock waits in a worker thread, not on the loop."""
    path = tmp_path / "busy.db"
    async with SQLiteStore(path) as store:
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            appended = anyio.Event()

            async def append() -> None:
                await store.append("t", [Message.user("waited")], [1])
                appended.set()

            async with anyio.create_task_group() as group:
                group.start_soon(append)
                for _ in range(100):
                    await anyio.lowlevel.checkpoint()
                assert not appended.is_set()
                blocker.execute("COMMIT")
        finally:
            blocker.close()
        assert (await store.stats("t")).message_count == 1


def hold_lock(path: str, holding: Any) -> None:
    async def main() -> None:
        async with SQLiteStore(path, lease_seconds=1) as store, store.compaction_lock("t") as mine:
            assert mine
            holding.set()
            await anyio.sleep_forever()

    anyio.run(main)


async def test_a_killed_holders_lease_blocks_until_it_expires(tmp_path: Path) -> None:
    """A SIGKILLed lock holder's lease keeps others out until its lease_seconds pass, then is taken over."""
    path = tmp_path / "lease.db"
    context = multiprocessing.get_context("spawn")
    holding = context.Event()
    child = context.Process(target=hold_lock, args=(str(path), holding), daemon=True)
    child.start()
    try:
        assert await anyio.to_thread.run_sync(holding.wait, 60)
    finally:
        os.kill(child.pid or 0, signal.SIGKILL)
        await anyio.to_thread.run_sync(child.join)

    async with SQLiteStore(path) as store:
        async with store.compaction_lock("t") as mine:
            assert not mine
        with anyio.fail_after(20):
            while True:
                async with store.compaction_lock("t") as mine:
                    if mine:
                        break
                await anyio.sleep(0.05)  # polling the database's clock
    async with SQLiteStore(path) as again, again.compaction_lock("t") as mine:
        assert mine


async def test_closing_inside_the_lock_releases_it(tmp_path: Path) -> None:
    """A store closed while its caller still holds the compaction lock gives the lock back."""
    path = tmp_path / "close.db"
    async with SQLiteStore(path) as other:
        store = SQLiteStore(path)
        async with store.compaction_lock("t") as mine:
            assert mine
            await store.aclose()
            async with other.compaction_lock("t") as theirs:
                assert theirs


async def fill(store: SQLiteStore, thread: str, count: int) -> None:
    for start in range(0, count, 5_000):
        size = min(5_000, count - start)
        await store.append(thread, [Message.user(f"m{n}") for n in range(size)], [1] * size)


async def test_a_windowed_load_does_the_same_work_whatever_the_thread_length(tmp_path: Path) -> None:
    """SQLite runs as many VM instructions for a 10-message window of 20,000 messages as of 100."""
    async with SQLiteStore(tmp_path / "window.db", synchronous="NORMAL") as store:
        await fill(store, "short", 100)
        await fill(store, "long", 20_000)
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0  # carry on

        for limit in (10, None):
            await store.load("short", max_tokens=limit)  # compiles the statements outside the count
        assert store._reader is not None
        store._reader.set_progress_handler(count, 1)
        work = {}
        for thread in ("short", "long"):
            for limit in (10, None):
                steps = 0
                window = await store.load(thread, max_tokens=limit)
                work[thread, limit] = steps
                assert len(window.messages) == (10 if limit else {"short": 100, "long": 20_000}[thread])
    assert work["long", 10] == work["short", 10]
    assert work["long", None] > 100 * work["long", 10], "the counter must see a whole-thread read"


async def test_stats_and_pressure_leave_no_read_snapshot_open(tmp_path: Path) -> None:
    """After stats() and pressure() a checkpoint can move the whole WAL back and truncate it."""
    path = tmp_path / "wal.db"
    async with SQLiteStore(path) as store:
        await store.append("t", [Message.user("a")], [1])
        await store.record("t", UserMessageEpisode(message=Message.user("a")))
        assert (await store.stats("t")).message_count == 1
        assert (await store.pressure("t")).total_user_messages == 1
        busy, _, _ = query(path, "PRAGMA wal_checkpoint(TRUNCATE)")[0]
        assert busy == 0
        assert os.path.getsize(f"{path}-wal") == 0


async def test_stats_read_the_committed_state_while_another_writer_holds_the_lock(tmp_path: Path) -> None:
    """stats() and pressure() answer at once while another connection is mid-write, with committed values."""
    path = tmp_path / "busy.db"
    async with SQLiteStore(path) as store:
        await store.append("t", [Message.user("a")], [4])
        await store.record("t", UserMessageEpisode(message=Message.user("a")))
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            blocker.execute("UPDATE threads SET total_tokens = 99")
            blocker.execute("UPDATE threads SET total_user_messages = 99")
            with anyio.fail_after(5):
                assert (await store.stats("t")).total_tokens == 4
                assert (await store.pressure("t")).total_user_messages == 1
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()


@pytest.mark.parametrize(
    ("statement", "read", "names"),
    [
        ("UPDATE threads SET total_tokens = 'lots'", "stats", "the threads row"),
        ("UPDATE messages SET tokens = 'few' WHERE seq = 2", "load", "seq 2"),
        ("UPDATE threads SET total_user_messages = 1.5", "pressure", "episode counters"),
        ("UPDATE threads SET first_at = 'yesterday'", "pressure", "first episode"),
    ],
    ids=["threads", "message-tokens", "counters", "first-at"],
)
async def test_a_row_of_the_wrong_type_is_a_store_error_naming_the_thread(
    tmp_path: Path, statement: str, read: str, names: str
) -> None:
    """SQLite keeps values of any type, so a mistyped column is reported by thread and row, not as a crash."""
    path = tmp_path / "typed.db"
    async with SQLiteStore(path) as store:
        await store.append("it's", [Message.user("a"), Message.user("b")], [1, 1])
        await store.record("it's", UserMessageEpisode(message=Message.user("a")))
        query(path, statement)
        with pytest.raises(StoreError, match=rf"thread \"it's\": .*{names}"):
            await getattr(store, read)("it's")


@pytest.mark.parametrize(
    ("statement", "names"),
    [
        ("UPDATE threads SET total_tokens = 'lots'", "the threads row"),
        ("UPDATE threads SET last_seq = 2.5", "the threads row"),
        ("UPDATE threads SET total_user_messages = 1.5", "the threads row's episode counters"),
        ("UPDATE threads SET boundary_seq = 'x'", "the threads row's episode counters"),
    ],
    ids=["threads-tokens", "threads-seq", "counters", "boundary"],
)
@pytest.mark.parametrize("steps_before", [1, 2], ids=["first-step", "after-a-step"])
async def test_a_step_written_over_a_row_of_the_wrong_type_reports_it_and_writes_nothing(
    tmp_path: Path, statement: str, names: str, steps_before: int
) -> None:
    """A recorded step adds to the thread's rows in place, but never to a mistyped one: that is reported.

    Also when the store's last step left the row's seqs where they still are
    (``after-a-step``), so the step takes the statement without ``RETURNING``.
    """
    path = tmp_path / "typed.db"
    async with SQLiteStore(path) as store:
        for n in range(steps_before):
            episode = UserMessageEpisode(message=Message.user(f"a{n}"))
            await store.record_and_append("t", [episode], [episode.message], [1], message_episodes=[0])
        query(path, statement)
        before = [query(path, f"SELECT * FROM {table} ORDER BY 1, 2") for table in ("messages", "episodes")]
        step = UserMessageEpisode(message=Message.user("b"))
        with pytest.raises(StoreError, match=rf"thread 't': {names} is corrupt"):
            await store.record_and_append("t", [step], [step.message], [1], message_episodes=[0])
        after = [query(path, f"SELECT * FROM {table} ORDER BY 1, 2") for table in ("messages", "episodes")]
        assert after == before


async def test_stats_answer_while_the_stores_own_write_waits_for_another_process(tmp_path: Path) -> None:
    """stats() and pressure() do not queue behind an append of the same store that waits for a lock."""
    path = tmp_path / "queue.db"
    async with SQLiteStore(path) as store:
        await store.append("t", [Message.user("a")], [4])
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            appended = anyio.Event()

            async def append() -> None:
                await store.append("t", [Message.user("b")], [1])
                appended.set()

            async with anyio.create_task_group() as group:
                group.start_soon(append)
                for _ in range(100):
                    await anyio.lowlevel.checkpoint()
                with anyio.fail_after(5):
                    assert (await store.stats("t")).total_tokens == 4
                    assert (await store.pressure("t")).total_user_messages == 0
                assert not appended.is_set()
                blocker.execute("COMMIT")
        finally:
            blocker.close()
        assert (await store.stats("t")).total_tokens == 5


# Another process in the middle of rebuilding the WAL index after a crash: it holds
# the index's write, checkpoint and recovery locks (SQLite's unix VFS locks byte
# 120 + n of the -shm file) while the index header is still zeroed.
_RECOVERING = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 3, 120)
os.pwrite(fd, bytes(96), 0)
print("recovering", flush=True)
sys.stdin.readline()
"""


async def test_a_read_that_must_wait_for_a_recovery_waits_off_the_event_loop(tmp_path: Path) -> None:
    """While another process rebuilds the WAL index, stats() waits in the worker thread, then answers."""
    path = tmp_path / "recovering.db"
    async with SQLiteStore(path) as store:
        await store.append("t", [Message.user("a")], [4])
        process = await anyio.open_process(
            [sys.executable, "-c", _RECOVERING, f"{path}-shm"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        async with process:
            assert process.stdout is not None and process.stdin is not None
            with anyio.fail_after(30):
                line = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 100)
            assert line == b"recovering"
            answered = anyio.Event()
            stats: list[Any] = []

            async def read() -> None:
                stats.append(await store.stats("t"))
                answered.set()

            async with anyio.create_task_group() as group:
                started = anyio.current_time()
                group.start_soon(read)
                for _ in range(100):
                    await anyio.lowlevel.checkpoint()  # the loop keeps turning meanwhile
                assert not answered.is_set()
                # Far below the 30 s busy_timeout a read waiting on the loop would have blocked it for.
                assert anyio.current_time() - started < 2
                await process.stdin.send(b"done\n")
            await process.wait()
        assert stats[0].total_tokens == 4


BOTH = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


def store_threads(path: Path) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"contextfold-sqlite {path}"]


@BOTH
async def test_the_writing_thread_is_one_named_thread_that_aclose_ends(tmp_path: Path) -> None:
    """Every write runs in the store's one daemon thread, named after the file; aclose() ends it."""
    path = tmp_path / "thread.db"
    store = SQLiteStore(path)
    assert store_threads(path) == []  # started on first use
    async with store:
        (thread,) = store_threads(path)
        assert thread.daemon
        await store.append("t", [Message.user("a")], [1])
        await store.record("t", UserMessageEpisode(message=Message.user("a")))
        ran_in = {await store._call(lambda conn: threading.current_thread()) for _ in range(5)}
        assert ran_in == {thread}
        assert store_threads(path) == [thread]
    assert store_threads(path) == []
    assert not thread.is_alive()
    assert (store._conn, store._reader, store._loop_reader) == (None, None, None)
    with pytest.raises(StoreClosedError):
        await store.state("t")


@BOTH
async def test_an_unused_store_closes_without_a_thread(tmp_path: Path) -> None:
    """A store closed before any call never starts its thread nor creates its file."""
    path = tmp_path / "unused.db"
    store = SQLiteStore(path)
    await store.aclose()
    assert store_threads(path) == []
    assert not path.exists()


LOOP_LIMIT = 10.0
"""Seconds the loops of ``loops_in_threads`` get for all their calls (well under one): past it, one hung."""


@contextlib.contextmanager
def loops_in_threads(count: int, serve: Callable[[int], None]) -> Iterator[list[BaseException]]:
    """``serve(n)`` in ``count`` threads started together; yields their errors, filled in once they ended.

    Each ``serve`` runs its calls in event loops of its own (``anyio.run``), as
    LangChain's sync ``invoke`` does in a threaded server. On exit the threads
    are waited for, up to ``LOOP_LIMIT``: one still running fails the test
    (its loop waits for a wake-up that never comes) instead of hanging it.
    """
    errors: list[BaseException] = []
    together = threading.Barrier(count)

    def run(n: int) -> None:
        try:
            together.wait(LOOP_LIMIT)
            serve(n)
        except BaseException as exc:  # reported by the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + LOOP_LIMIT
    yield errors
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [n for n, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"the event loops of threads {stuck} never finished: a call of theirs hung"


async def loop_step(store: SQLiteStore, who: int, n: int) -> None:
    """A step of loop ``who`` on its own thread and a shared one, with the reads of every kind."""
    with anyio.fail_after(LOOP_LIMIT):
        own = f"loop {who}"
        await store.append(own, [Message.user(f"{who}.{n}")], [1])
        await store.append("shared", [Message.user(f"{who}.{n}")], [1])
        await store.record(own, UserMessageEpisode(message=Message.user(f"{who}.{n}")))
        assert (await store.stats(own)).message_count == n + 1
        assert [stored.seq for stored in (await store.load(own)).messages] == list(range(1, n + 2))
        assert [stored.seq for stored in (await store.tail(own, after_seq=n)).messages] == [n + 1]
        assert len([record async for record in store.replay(own)]) == n + 1
        assert len(await store.threads()) >= 2


@pytest.mark.parametrize("loop_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_event_loops_in_several_threads_share_the_store_and_its_one_thread(
    tmp_path: Path, synchronous: Any, loop_backend: str
) -> None:
    """Loops in three threads use a store none of them opened, at once, a fresh loop per call.

    Every call completes, with what it wrote there once; the store starts one
    thread however many loops make its first call together, and a loop of
    yet another thread closes it.
    """
    path = tmp_path / "loops.db"
    store = SQLiteStore(path, synchronous=synchronous)
    steps = 8

    def serve(who: int) -> None:
        for n in range(steps):
            anyio.run(partial(loop_step, store, who, n), backend=loop_backend)

    with loops_in_threads(3, serve) as errors:
        pass
    assert not errors, errors
    assert len(store_threads(path)) == 1
    anyio.run(store.aclose, backend=loop_backend)
    assert store_threads(path) == []
    said = sorted(text for (text,) in query(path, "SELECT body FROM messages WHERE thread = 'shared'"))
    assert len(said) == 3 * steps
    assert query(
        path, "SELECT min(seq), max(seq), count(DISTINCT seq) FROM messages WHERE thread = 'shared'"
    ) == [(1, 3 * steps, 3 * steps)]
    for who in range(3):
        assert query(path, "SELECT count(*) FROM episodes WHERE thread = ?", (f"loop {who}",)) == [(steps,)]


@pytest.mark.parametrize("loop_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_a_store_closed_by_one_loop_ends_the_calls_of_the_others(
    tmp_path: Path, synchronous: Any, loop_backend: str
) -> None:
    """Loops of other threads still calling the store when one closes it get StoreClosedError, at once.

    A call either completes (its write is there) or raises ``StoreClosedError``
    (it wrote nothing): none waits for a thread that has ended, and none
    opens the file again.
    """
    path = tmp_path / "closing.db"
    store = SQLiteStore(path, synchronous=synchronous)
    anyio.run(store.__aenter__, backend=loop_backend)
    appended = [0, 0, 0]

    async def use(who: int) -> None:
        own = f"loop {who}"
        with anyio.fail_after(LOOP_LIMIT):
            while True:
                try:
                    await store.append(own, [Message.user("x")], [1])
                    appended[who] += 1
                    await store.load(own)
                    await store.stats(own)
                except StoreClosedError:
                    return

    with loops_in_threads(3, lambda who: anyio.run(use, who, backend=loop_backend)) as errors:
        deadline = time.monotonic() + LOOP_LIMIT
        while min(appended) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        anyio.run(store.aclose, backend=loop_backend)
    assert not errors, errors
    assert store_threads(path) == []
    for who in range(3):
        assert query(path, "SELECT count(*) FROM messages WHERE thread = ?", (f"loop {who}",)) == [
            (appended[who],)
        ]


async def test_a_call_racing_aclose_from_another_thread_raises_closed(tmp_path: Path) -> None:
    """The two races a loop of another thread can run against aclose() end in StoreClosedError.

    A call that found the store open just before it closed reaches the
    worker after its end was queued: it raises instead of waiting for a
    thread that has ended. One that came in between the thread closing the
    connections and ending runs there, and finds them closed: it raises
    instead of opening the file again.
    """
    store = SQLiteStore(tmp_path / "race.db")
    await store.__aenter__()
    worker = store._worker
    await store.aclose()
    store._closed, store._worker = False, worker  # what that call saw
    with anyio.fail_after(5), pytest.raises(StoreClosedError):
        await store._call(lambda conn: None)
    with pytest.raises(StoreClosedError):
        store._writer()
    assert (store._conn, store._reader, store._loop_conn) == (None, None, None)


@contextlib.contextmanager
def holding_the_write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        yield blocker
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()


async def wait_for(flag: threading.Event) -> None:
    with anyio.fail_after(10):
        while not flag.is_set():
            await anyio.sleep(0.005)


@BOTH
async def test_a_caller_cancelled_mid_write_waits_for_the_write(tmp_path: Path) -> None:
    """A caller cancelled while its write runs gets its result only once the write ended, then raises."""
    path = tmp_path / "cancel.db"
    async with SQLiteStore(path) as store:
        begun = threading.Event()
        assert store._conn is not None
        store._conn.set_trace_callback(lambda statement: begun.set())
        returned = anyio.Event()
        with holding_the_write_lock(path) as blocker:
            async with anyio.create_task_group() as group:
                scope = anyio.CancelScope()

                async def write() -> None:
                    with scope:
                        stored = await store.record_and_append(
                            "t",
                            [UserMessageEpisode(message=Message.user("a"))],
                            [Message.user("a")],
                            [3],
                            message_episodes=[0],
                        )
                        # As anyio.to_thread.run_sync: the call's result, then the cancellation.
                        assert [(s.seq, s.episode_seq) for s in stored] == [(1, 1)]
                        returned.set()
                        await anyio.lowlevel.checkpoint()
                        pytest.fail("the cancellation was not raised at the next checkpoint")

                group.start_soon(write)
                await wait_for(begun)  # BEGIN IMMEDIATE is waiting for the blocker
                scope.cancel()
                for _ in range(50):
                    await anyio.lowlevel.checkpoint()
                await anyio.sleep(0.1)
                assert not returned.is_set(), "the caller returned while its write still ran"
                blocker.execute("COMMIT")
        store._conn.set_trace_callback(None)
        assert scope.cancelled_caught
        assert query(path, "SELECT count(*) FROM messages") == [(1,)]
        assert query(path, "SELECT count(*) FROM episodes") == [(1,)]
        assert query(path, "SELECT message_count, total_tokens, last_seq FROM threads") == [(1, 3, 1)]
        state = await store.state("t")
        assert (state.stats.message_count, state.pressure.total_user_messages) == (1, 1)


@BOTH
async def test_a_queued_write_never_runs_after_its_cancelled_caller_returned(
    tmp_path: Path, anyio_backend: str
) -> None:
    """A write cancelled while queued behind another is skipped, or done before its caller returns."""
    path = tmp_path / "queued.db"
    async with SQLiteStore(path) as store:
        begun = threading.Event()
        assert store._conn is not None
        store._conn.set_trace_callback(lambda statement: begun.set())
        counts: list[Any] = []
        with holding_the_write_lock(path) as blocker:
            async with anyio.create_task_group() as group:
                group.start_soon(store.append, "first", [Message.user("a")], [1])
                await wait_for(begun)  # the first write waits for the blocker in the thread
                scope = anyio.CancelScope()

                async def second() -> None:
                    with scope:
                        # Skipped (asyncio: it is still queued) or run to its end first (trio:
                        # the waiting thread is not abandoned); either way the scope raises.
                        await store.append("second", [Message.user("b")], [1])
                        await anyio.lowlevel.checkpoint()
                    counts.append(query(path, "SELECT count(*) FROM messages WHERE thread = 'second'"))

                group.start_soon(second)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
                with anyio.move_on_after(0.2):
                    while not counts:
                        await anyio.sleep(0.01)
                blocker.execute("COMMIT")
        await store._call(lambda conn: None)  # everything queued before has run
        store._conn.set_trace_callback(None)  # not before: it waits for the connection's mutex
        assert scope.cancelled_caught
        assert counts == [query(path, "SELECT count(*) FROM messages WHERE thread = 'second'")]
        if anyio_backend == "asyncio":
            assert counts == [[(0,)]], "a call still queued when its caller was cancelled is skipped"
        assert (await store.stats("first")).message_count == 1


@BOTH
async def test_a_caller_cancelled_before_its_write_submits_nothing(
    tmp_path: Path, anyio_backend: str
) -> None:
    """A write made inside an already cancelled scope never reaches the thread, on either backend.

    On trio the job used to be queued before the first checkpoint, so the thread
    could take it and the cancelled caller then waited for the write to finish.
    """
    async with SQLiteStore(tmp_path / "cancelled.db") as store:
        await store.append("warm", [Message.user("open the file")], [1])
        for n in range(20):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await store.append("t", [Message.user(f"m{n}")], [1])
            assert scope.cancelled_caught
        assert (await store.stats("t")).message_count == 0


async def test_a_paced_write_on_the_loop_yields_before_it_writes(tmp_path: Path) -> None:
    """At NORMAL a write due to yield lets other tasks run first; a cancellation then stops it whole.

    Writes are paced (see ``contextfold._pacing``): one made 0.2 ms or
    more after the store last yielded gives the loop away before it writes.
    On asyncio, which runs woken tasks in order (trio shuffles each batch, so
    which of two woken tasks goes first is not fixed there).
    """
    async with SQLiteStore(tmp_path / "yield.db", synchronous="NORMAL") as store:
        await store.append("warm", [Message.user("open the file")], [1])
        ran: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _note(ran))
            await _past_the_pace()
            assert ran == [1]
            await store.append("t", [Message.user("a")], [1])
            tg.start_soon(lambda: _note(ran))
            await _past_the_pace(yielding=False)
            await store.append("t", [Message.user("a2")], [1])
            assert ran == [1, 1], "the write gave the loop to the task waiting for it"
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel, scope)  # runs at the write's yield, before the write
                await _past_the_pace(yielding=False)
                await store.append("t", [Message.user("b")], [1])
        assert scope.cancelled_caught
        assert (await store.load("t")).plain == [Message.user("a"), Message.user("a2")]


async def test_a_write_on_the_loop_stops_for_a_cancellation_requested_before_it(tmp_path: Path) -> None:
    """A write that is not due to yield still looks for a cancellation first, and then writes nothing."""
    async with SQLiteStore(tmp_path / "cancelled.db", synchronous="NORMAL") as store:
        await store.append("t", [Message.user("a")], [1])  # yielded just now: the next is not due
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.append("t", [Message.user("b")], [1])
        assert scope.cancelled_caught
        assert (await store.load("t")).plain == [Message.user("a")]


async def _past_the_pace(*, yielding: bool = True) -> None:
    """Let more than one pacing interval pass, with (or without) giving the loop away meanwhile."""
    if yielding:
        await anyio.sleep(2 * PACE_SECONDS)
        return
    deadline = time.monotonic() + 2 * PACE_SECONDS
    while time.monotonic() < deadline:  # busy, as a step's own work would be
        pass


async def _note(ran: list[int]) -> None:
    ran.append(1)


async def _cancel(scope: anyio.CancelScope) -> None:
    scope.cancel()


@BOTH
async def test_a_write_waiting_for_the_store_thread_holds_no_pool_thread(tmp_path: Path) -> None:
    """A write's caller waits for the store's thread without taking a token of anyio's thread pool.

    On trio every waiting write held a pool thread (``to_thread.run_sync`` of
    a blocking wait): with the pool's one token held elsewhere, no write
    could return.
    """
    async with SQLiteStore(tmp_path / "pool.db") as store:  # FULL: every write goes to the thread
        limiter = anyio.to_thread.current_default_thread_limiter()
        tokens, limiter.total_tokens = limiter.total_tokens, 1
        release = threading.Event()
        try:
            async with anyio.create_task_group() as tg:
                # Holds the one token until the writes are done, or for 3 s at most.
                tg.start_soon(anyio.to_thread.run_sync, release.wait, 3)
                await anyio.sleep(0.05)
                started = anyio.current_time()
                for n in range(5):
                    await store.append("t", [Message.user(f"m{n}")], [1])
                took = anyio.current_time() - started
                release.set()
        finally:
            release.set()
            limiter.total_tokens = tokens
        assert took < 2, f"five writes took {took:.1f} s: each waited for the pool's token"
        assert (await store.stats("t")).message_count == 5


class Counting:
    """Counts the hops to a thread: anyio.to_thread.run_sync and submissions to the store's thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hops: list[str] = []
        real_run_sync = anyio.to_thread.run_sync
        real_run = _Worker.run

        async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
            self.hops.append("to_thread")
            return await real_run_sync(fn, *args, **kwargs)

        async def run(worker: _Worker, fn: Any) -> Any:
            self.hops.append("worker")
            return await real_run(worker, fn)

        monkeypatch.setattr(anyio.to_thread, "run_sync", run_sync)
        monkeypatch.setattr(_Worker, "run", run)


async def filled(store: SQLiteStore) -> None:
    await store.append("t", [Message.user("a"), Message.user("b")], [4, 5])
    await store.record("t", UserMessageEpisode(message=Message.user("a")))


async def point_reads(store: SQLiteStore) -> tuple[Any, ...]:
    now = datetime.now(UTC)
    return (
        await store.state("t", now=now),
        await store.state("never", now=now),
        await store.stats("t"),
        await store.pressure("t", now=now),
        await store.pressure("never", now=now),
    )


@BOTH
async def test_point_reads_run_on_the_loop_without_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """state(), stats() and pressure() read on the event loop itself, the same answers as the thread's."""
    async with SQLiteStore(tmp_path / "loop.db") as store:
        await filled(store)
        frozen = datetime.now(UTC)
        loop_reader = store._loop_reader
        assert loop_reader is not None
        threads: list[int] = []
        loop_reader.set_trace_callback(lambda statement: threads.append(threading.get_ident()))
        counting = Counting(monkeypatch)
        on_loop = [
            await store.state("t", now=frozen),
            await store.stats("t"),
            await store.pressure("t", now=frozen),
        ]
        assert counting.hops == []
        assert threads == [threading.get_ident()] * 3
        loop_reader.set_trace_callback(None)
        store._loop_reader = None  # the thread path, as before the file was open
        in_thread = [
            await store.state("t", now=frozen),
            await store.stats("t"),
            await store.pressure("t", now=frozen),
        ]
        assert counting.hops == ["to_thread"] * 3
        assert on_loop == in_thread
        assert on_loop[1].message_count == 2 and on_loop[2].total_user_messages == 1


class Refusing:
    """A reader connection that answers every statement with the error SQLite gives when it is busy."""

    def __init__(self, error: sqlite3.Error) -> None:
        self.error = error
        self.tried = 0

    def execute(self, *args: Any) -> Any:
        self.tried += 1
        raise self.error


@BOTH
@pytest.mark.parametrize(
    "error",
    [
        sqlite3.OperationalError("database is locked"),
        sqlite3.OperationalError("database is busy"),
        sqlite3.DatabaseError("database disk image is malformed"),
    ],
    ids=["locked", "busy", "other"],
)
async def test_a_point_read_refused_on_the_loop_is_done_in_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: sqlite3.Error
) -> None:
    """When the on-loop reader answers busy (or any SQLite error), the read is redone in a thread."""
    async with SQLiteStore(tmp_path / "busy.db") as store:
        await filled(store)
        frozen = datetime.now(UTC)
        on_loop = [
            await store.state("t", now=frozen),
            await store.stats("t"),
            await store.pressure("t", now=frozen),
        ]
        refusing = Refusing(error)
        store._loop_reader = refusing  # type: ignore[assignment]
        counting = Counting(monkeypatch)
        fallen_back = [
            await store.state("t", now=frozen),
            await store.stats("t"),
            await store.pressure("t", now=frozen),
        ]
        assert refusing.tried == 3
        assert counting.hops == ["to_thread"] * 3
        assert fallen_back == on_loop


async def test_a_point_read_waits_in_the_thread_until_the_store_is_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read of a store not yet open opens it in its thread; the next ones stay on the loop."""
    async with SQLiteStore(tmp_path / "first.db") as writer:
        await filled(writer)
    store = SQLiteStore(tmp_path / "first.db")
    try:
        counting = Counting(monkeypatch)
        first = await store.stats("t")
        assert counting.hops == ["worker", "to_thread"]
        assert await store.stats("t") == first
        assert counting.hops == ["worker", "to_thread"]
    finally:
        await store.aclose()


async def thread_settled(store: SQLiteStore) -> None:
    """Until the store's thread has finished its last call's upkeep (a loaded machine may lag)."""
    with anyio.fail_after(10):
        while store._worker is not None and not store._worker.idle:
            await anyio.sleep(0.001)


def small_writes(store: SQLiteStore) -> list[Any]:
    """One of each write a step makes: append, record, record_and_append."""
    return [
        store.append("t", [Message.user("a")], [1]),
        store.record("t", UserMessageEpisode(message=Message.user("b"))),
        store.record_and_append(
            "t",
            [UserMessageEpisode(message=Message.user("c"))],
            [Message.user("c")],
            [1],
            message_episodes=[0],
        ),
    ]


def committed(path: Path) -> tuple[list[str], int]:
    """What another connection sees: the thread's message texts and its episode count."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(f"SELECT {_BODY} {_WITH_EPISODES} WHERE m.thread = 't' ORDER BY m.seq").fetchall()
        (episodes,) = conn.execute("SELECT count(*) FROM episodes WHERE thread = 't'").fetchone()
    return [Message.model_validate_json(body).text for (body,) in rows], episodes


@BOTH
async def test_a_steps_small_writes_at_normal_run_on_the_loop_without_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With synchronous=NORMAL a step's writes (and a fold's lease) commit on the loop: no hop to a thread.

    At FULL every commit syncs the disk, so each write goes to the store's
    thread; a write of more than 64 KiB goes there at NORMAL too.
    """
    async with SQLiteStore(tmp_path / "normal.db", synchronous="NORMAL") as store:
        conn = store._loop_writer
        assert conn is not None
        threads: list[int] = []
        conn.set_trace_callback(lambda statement: threads.append(threading.get_ident()))
        await thread_settled(store)  # the open's call
        counting = Counting(monkeypatch)
        for write in small_writes(store):
            await write
        async with store.compaction_lock("t") as taken:  # a lease's take and release
            assert taken
        assert counting.hops == []
        assert threads and set(threads) == {threading.get_ident()}
        assert committed(tmp_path / "normal.db") == (["a", "c"], 2)
        with contextlib.closing(sqlite3.connect(tmp_path / "normal.db")) as other:
            assert other.execute("SELECT count(*) FROM compaction_leases").fetchone() == (0,)
        await store.append("t", [Message.user("x" * 70_000)], [1])
        assert counting.hops[0] == "worker"  # (on trio its caller waits through to_thread as well)
        conn.set_trace_callback(None)
    async with SQLiteStore(tmp_path / "full.db") as store:
        assert store._loop_writer is None
        counting = Counting(monkeypatch)
        for write in small_writes(store):
            await write
        assert counting.hops.count("worker") == 3
        assert committed(tmp_path / "full.db") == (["a", "c"], 2)


async def test_at_normal_a_fold_of_few_rows_commits_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fold (and a replacement) that removes few rows commits on the loop: no hop to the thread.

    It always went to the store's thread, whose round trip cost more than its
    transaction (about a millisecond per fold, 79 folds in the 5,000-message
    session). One that finds more rows than the loop may remove rolls back
    there and is made in the thread, once.
    """
    from contextfold.stores import _sqlite

    path = tmp_path / "fold.db"
    async with SQLiteStore(path, synchronous="NORMAL") as store:
        for n in range(12):
            step = UserMessageEpisode(message=Message.user(f"m{n}"))
            await store.record_and_append("t", [step], [step.message], [2], message_episodes=[0])
        await thread_settled(store)
        counting = Counting(monkeypatch)

        async def fold(through_seq: int, version: int) -> None:
            checkpoint = SummaryCheckpoint(trigger="tokens", from_seq=1, through_seq=through_seq, summary="s")
            summary = Message.system(f"summary through {through_seq}")
            await store.fold(
                "t",
                checkpoint=checkpoint,
                through_seq=through_seq,
                expected_version=version,
                replacement=[summary],
                tokens=[1],
            )

        await fold(3, 0)
        assert counting.hops == []
        await store.replace_prefix(
            "t", through_seq=4, expected_version=1, replacement=[Message.user("kept")], tokens=[1]
        )
        assert counting.hops == []
        monkeypatch.setattr(_sqlite, "_SWAP_ON_LOOP_ROWS", 3)
        conn = store._loop_writer
        assert conn is not None
        on_loop: list[str] = []
        conn.set_trace_callback(on_loop.append)
        await fold(9, 2)  # removes 6 rows: tried on the loop, rolled back, made in the thread
        conn.set_trace_callback(None)
        assert counting.hops == ["worker"]
        # The loop counted no further than the bound: the full count ran in the thread only.
        assert on_loop[0].startswith("BEGIN") and on_loop[-1] == "ROLLBACK"
        assert any("LIMIT" in statement for statement in on_loop)
        assert not any("sum(tokens)" in statement for statement in on_loop)
        window = await store.load("t")
        assert [m.text for m in window.plain] == ["summary through 9", "m9", "m10", "m11"]
        assert (window.version, window.total_tokens) == (3, 1 + 3 * 2)
        kinds = [record.episode.kind async for record in store.replay("t")]
        assert kinds == ["user_message"] * 12 + ["summary_checkpoint"] * 2


@pytest.mark.parametrize("call", ["append", "record_and_append"])
async def test_a_small_write_made_while_the_thread_has_a_call_runs_after_it(
    tmp_path: Path, call: str
) -> None:
    """Writes keep the order they were made in: none overtakes a call already handed to the thread.

    The large append goes to the store's thread, where it is also encoded; the
    small one, made while that call is queued or running, must not commit
    first on the loop.
    """

    async def write(store: SQLiteStore, text: str) -> None:
        message = Message.user(text)
        if call == "append":
            await store.append("t", [message], [1])
        else:
            await store.record_and_append(
                "t", [UserMessageEpisode(message=message)], [message], [1], message_episodes=[0]
            )

    async with SQLiteStore(tmp_path / "order.db", synchronous="NORMAL") as store:
        for n in range(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(write, store, f"large {n} " + "x" * 70_000)
                await anyio.sleep(0)  # the large append is handed to the thread
                tg.start_soon(write, store, f"small {n}")
        texts = [m.message.text.split(" x")[0] for m in (await store.load("t")).messages]
        assert texts == [f"{kind} {n}" for n in range(20) for kind in ("large", "small")]


async def test_a_write_lock_held_elsewhere_sends_the_write_to_the_thread_and_the_loop_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At NORMAL, a write that finds another process's write lock waits for it in the thread, not the loop."""
    path = tmp_path / "locked.db"
    async with SQLiteStore(path, synchronous="NORMAL") as store:
        await store.append("t", [Message.user("before")], [1])
        holding, release = threading.Event(), threading.Event()

        def hold_the_write_lock() -> None:
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
                other.execute("BEGIN IMMEDIATE")
                holding.set()
                release.wait(10)
                other.execute("COMMIT")

        gaps: list[float] = []

        async def tick() -> None:
            while not release.is_set():
                started = anyio.current_time()
                await anyio.sleep(0.005)
                gaps.append(anyio.current_time() - started)

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, hold_the_write_lock)
            await anyio.to_thread.run_sync(holding.wait, 5)
            tg.start_soon(tick)
            counting = Counting(monkeypatch)
            with anyio.fail_after(10):
                async with anyio.create_task_group() as writes:
                    writes.start_soon(store.append, "t", [Message.user("after")], [1])
                    await anyio.sleep(0.3)
                    assert (await store.stats("t")).message_count == 1  # still waiting for the lock
                    release.set()
        assert counting.hops[0] == "worker"
        assert committed(path) == (["before", "after"], 0)
        assert max(gaps) < 0.2, f"the loop stalled {max(gaps) * 1000:.0f} ms while the write waited"


async def test_a_write_does_not_wait_for_the_checkpoint_it_makes_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WAL is copied back after a call was handed back, never inside the call that made it due.

    SQLite's automatic checkpoint ran inside the committing write: one append
    in a few hundred took milliseconds to tens of milliseconds (max 31 ms in
    1,500 paced appends with synchronous=NORMAL, against 2.6 ms now).
    """
    from contextfold.stores import _sqlite

    started, release = threading.Event(), threading.Event()
    checkpoints: list[int] = []

    def slow_checkpoint(conn: sqlite3.Connection) -> bool:
        started.set()
        release.wait(10)
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        checkpoints.append(busy)
        return not busy and frames == copied

    monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 3)
    monkeypatch.setattr(_sqlite, "_checkpoint", slow_checkpoint)
    async with SQLiteStore(tmp_path / "cf.db", synchronous="NORMAL") as store:
        (autocheckpoint,) = store._writer().execute("PRAGMA wal_autocheckpoint").fetchone()
        assert autocheckpoint == 0
        with anyio.fail_after(5):
            await store.append("t", [Message.user("one")], [1])
            await store.append("t", [Message.user("two")], [1])  # the third call: due now
            await anyio.to_thread.run_sync(started.wait, 5)
        assert [m.message.text for m in (await store.load("t")).messages] == ["one", "two"]
        release.set()
        await thread_settled(store)
        with anyio.fail_after(5):
            await store.append("t", [Message.user("three")], [1])  # after the checkpoint
    assert checkpoints == [0]  # one pass: nothing was written beside it


async def test_at_normal_the_loops_writes_go_on_beside_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's copy and syncs do not hold up the loop's writes; what they add is copied after.

    A write made while the store's thread checkpointed used to go to the
    thread and wait out the whole checkpoint: about 5 ms, every 100 calls, in
    a 5,000-message session. Its second pass (the writes waiting) copies only
    what they added, so the next write can start the WAL over.
    """
    from contextfold.stores import _sqlite

    started, release = threading.Event(), threading.Event()
    passes: list[tuple[int, int, int]] = []

    def held_checkpoint(conn: sqlite3.Connection) -> bool:
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if not passes:  # the first pass ends when let go, as a slow disk's syncs would make it
            started.set()
            release.wait(10)
        passes.append((busy, frames, copied))
        return not busy and frames == copied

    monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 3)
    monkeypatch.setattr(_sqlite, "_SECOND_PASS_AFTER", 0)  # any remainder: this checkpoint holds them
    monkeypatch.setattr(_sqlite, "_checkpoint", held_checkpoint)
    path = tmp_path / "beside.db"
    async with SQLiteStore(path, synchronous="NORMAL") as store:
        await thread_settled(store)  # the open's call
        await store.append("t", [Message.user("one")], [1])
        await store.append("t", [Message.user("two")], [1])  # makes the checkpoint due
        await anyio.to_thread.run_sync(started.wait, 5)
        monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 1_000)  # no other checkpoint in this test
        conn = store._loop_writer
        assert conn is not None
        threads: list[int] = []
        conn.set_trace_callback(lambda statement: threads.append(threading.get_ident()))
        counting = Counting(monkeypatch)
        with anyio.fail_after(2):  # the checkpoint is held for 10 s
            for write in small_writes(store):
                await write
        conn.set_trace_callback(None)
        assert counting.hops == [] and set(threads) == {threading.get_ident()}
        assert committed(path) == (["one", "two", "a", "c"], 2)
        release.set()
        await thread_settled(store)
        # The first pass copied the frames it found; a second, with the writes held, what the
        # writes beside it added (the WAL may have started over in between).
        assert len(passes) == 2
        (_, first, _), (_, second, copied) = passes
        assert first > 0 and second == copied > 0
        await store.append("t", [Message.user("after")], [1])
        with contextlib.closing(sqlite3.connect(path)) as other:
            _, frames, _ = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert 0 < frames < 10  # the WAL started over: it holds the last write's pages alone


def checkpoints_with_a_write_beside(monkeypatch: pytest.MonkeyPatch, stores: list[SQLiteStore]) -> list[bool]:
    """Every checkpoint pass of ``stores[0]`` runs as if the loop wrote beside it, unless held.

    Returns, per pass, whether the loop's writes were free to go on beside it
    (``False``: a held pass).
    """
    from contextfold.stores import _sqlite

    passes: list[bool] = []
    checkpoint = _sqlite._checkpoint

    def checkpoint_with_a_write_beside(conn: sqlite3.Connection) -> bool:
        store = stores[0]
        assert store._worker is not None
        free = store._worker.free
        passes.append(free)
        copied = checkpoint(conn)
        if free:
            store._loop_commits += 1  # as if the loop wrote during the pass
        return copied

    monkeypatch.setattr(_sqlite, "_checkpoint", checkpoint_with_a_write_beside)
    return passes


async def test_writes_beside_checkpoints_are_held_only_once_they_left_enough_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the loop wrote beside a checkpoint waits for the next; one that finds enough left holds them.

    Every checkpoint used to copy that remainder at once with the loop's writes
    held, and a busy agent's next write waited for its syncs (about 1-2 ms)
    at every checkpoint. The WAL can start over only once a pass has copied
    everything, so the remainder is left to the next checkpoint until the
    calls left over reach ``_SECOND_PASS_AFTER`` intervals; then a held pass
    lets the WAL start over.
    """
    from contextfold.stores import _sqlite

    stores: list[SQLiteStore] = []
    passes = checkpoints_with_a_write_beside(monkeypatch, stores)
    monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 2)
    monkeypatch.setattr(_sqlite, "_SECOND_PASS_AFTER", 4, raising=False)  # 8 calls left over
    async with SQLiteStore(tmp_path / "held.db", synchronous="NORMAL") as store:
        stores.append(store)
        await thread_settled(store)  # the open's call
        for n in range(8):
            await store.append("t", [Message.user(f"m{n}")], [1])
            await thread_settled(store)
        assert (await store.stats("t")).message_count == 8
    # Four checkpoints, each counting three calls (two writes and the empty call that starts
    # it; the first, the open's call, one write and its own): the third found 9 calls left
    # over and was followed by the held pass, and the count started over for the fourth.
    assert passes == [True, True, True, False, True]


async def test_a_writer_that_never_pauses_waits_for_a_held_checkpoint_once_in_a_thousand_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default intervals, writes beside every checkpoint are held once per 1,000 calls, not 300.

    A held pass costs the write that waits for it the checkpoint's two syncs
    (about 1.5 ms here): at one in 300 calls a 5,000-step session that never
    paused waited 17 times, 4% of its time. Every checkpoint here has a write
    beside it, as in such a session; 1,200 writes leave one held pass (four
    before).
    """
    stores: list[SQLiteStore] = []
    passes = checkpoints_with_a_write_beside(monkeypatch, stores)
    async with SQLiteStore(tmp_path / "busy.db", synchronous="NORMAL") as store:
        stores.append(store)
        await thread_settled(store)  # the open's call
        for n in range(1_200):
            await store.append("t", [Message.user(f"m{n}")], [1])
            if n % 25 == 24:  # each checkpoint runs when due, whatever the machine's load
                await thread_settled(store)
        assert (await store.stats("t")).message_count == 1_200
    assert len(passes) >= 11, "a checkpoint every 100 calls"
    assert passes.count(False) == 1, "one held pass"


async def test_the_loops_writes_wait_once_a_checkpoint_that_cannot_run_leaves_the_wal_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint the thread cannot get through (starved of CPU, a slow disk) holds the writes back in time.

    The loop's writes went on beside a checkpoint that had not begun or did
    not end, each posting another empty call once one was due: the WAL grew
    without bound (past 2.5 MB in 300 writes with three CPU hogs). Now the
    loop posts one at a time, and once the calls not copied back reach
    ``_SECOND_PASS_AFTER + 1`` intervals its writes go to the thread and wait.
    """
    from contextfold.stores import _sqlite

    started, release = threading.Event(), threading.Event()

    def slow_checkpoint(conn: sqlite3.Connection) -> bool:
        started.set()
        release.wait(10)
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return not busy and frames == copied

    posts: list[object] = []
    real_post = _Worker.post

    def post(worker: _Worker, fn: Any) -> None:
        posts.append(fn)
        real_post(worker, fn)

    monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 3)
    monkeypatch.setattr(_sqlite, "_SECOND_PASS_AFTER", 1, raising=False)  # a bound of 6 calls
    monkeypatch.setattr(_sqlite, "_checkpoint", slow_checkpoint)
    monkeypatch.setattr(_Worker, "post", post)
    async with SQLiteStore(tmp_path / "starved.db", synchronous="NORMAL") as store:
        await thread_settled(store)  # the open's call
        await store.append("t", [Message.user("0")], [1])
        await store.append("t", [Message.user("1")], [1])  # due: the checkpoint begins, and stalls
        await anyio.to_thread.run_sync(started.wait, 5)
        counting = Counting(monkeypatch)
        for n in range(2, 8):
            await store.append("t", [Message.user(str(n))], [1])
        assert counting.hops == [], "six writes beside the stalled checkpoint run on the loop"
        assert len(posts) == 2, "one empty call, and one more once it ran: not one per write"
        done = anyio.Event()

        async def seventh() -> None:
            await store.append("t", [Message.user("8")], [1])
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(seventh)
            await wait_until(lambda: counting.hops == ["worker"])
            await anyio.sleep(0.05)
            assert not done.is_set(), "the write waits for the checkpoint in the thread"
            release.set()
        assert [m.text for m in (await store.load("t")).plain] == [str(n) for n in range(9)]


async def test_a_reader_that_keeps_frames_in_the_wal_does_not_send_the_writes_to_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's long read keeps the WAL from being copied whole: the loop's writes go on.

    No held pass can copy what such a reader still needs. Counting those calls
    on after a held pass made the WAL look ever further behind, and every
    later write went to the thread until the reader ended.
    """
    from contextfold.stores import _sqlite

    monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 2)
    monkeypatch.setattr(_sqlite, "_SECOND_PASS_AFTER", 1, raising=False)
    path = tmp_path / "reader.db"
    async with SQLiteStore(path, synchronous="NORMAL") as store:
        await store.append("t", [Message.user("before")], [1])
        await thread_settled(store)
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as reader:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM messages").fetchone() == (1,)  # a snapshot
            counting = Counting(monkeypatch)
            for n in range(20):
                await store.append("t", [Message.user(f"m{n}")], [1])
                await thread_settled(store)
            reader.execute("COMMIT")
        assert counting.hops == [], "the writes went on on the loop beside the reader"
        assert (await store.stats("t")).message_count == 21


async def test_posted_upkeep_does_not_hold_the_loops_writes() -> None:
    """The empty call that starts a checkpoint is no caller's call: writes are free beside it, not behind.

    A write made after the loop posted that call, before the thread began the
    checkpoint's first pass, used to find the thread busy, went to it, and
    waited for the whole checkpoint.
    """
    worker = _Worker("upkeep")
    started, release = threading.Event(), threading.Event()
    try:
        worker.post(lambda: (started.set(), release.wait(5)))
        assert worker.free and not worker.idle  # queued
        assert await anyio.to_thread.run_sync(started.wait, 5)
        assert worker.free and not worker.idle  # running
        call = anyio.Event()

        async def a_call() -> None:
            await worker.run(lambda: None)
            call.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(a_call)
            await wait_until(lambda: not worker.free)  # a caller's call queued behind it
            release.set()
            with anyio.fail_after(5):
                await call.wait()
        await wait_until(lambda: worker.free and worker.idle)
    finally:
        release.set()
        worker.stop()


async def wait_until(condition: Any) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.sleep(0.001)


async def test_the_wal_stays_bounded_without_automatic_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many writes reuse a WAL of a few calls' pages: the checkpoints between calls copy it back."""
    from contextfold.stores import _sqlite

    monkeypatch.setattr(_sqlite, "_CHECKPOINT_EVERY", 10, raising=False)
    monkeypatch.setattr(_sqlite, "_SECOND_PASS_AFTER", 3)  # a bound of 40 calls, well under 300
    path = tmp_path / "cf.db"
    async with SQLiteStore(path, synchronous="NORMAL") as store:
        for n in range(300):
            await store.append("t", [Message.user(f"{n} " + "x" * 3000)], [1])
        wal = os.path.getsize(f"{path}-wal")
        assert (await store.stats("t")).message_count == 300
    # Idle, a checkpoint follows every 10 calls (a WAL of about 420 KB here, the writes going on
    # beside it); on a loaded machine the store's thread may not run for a while, and the loop's
    # writes go on until the calls not copied back reach (_SECOND_PASS_AFTER + 1) intervals, then
    # wait for it (about 1.5 MB at worst with three CPU hogs). Without checkpoints the WAL
    # reaches 6.6 MB.
    assert wal < 2_000_000, f"the WAL grew to {wal:,} bytes over 300 writes of 3 KB"


class _PlaceholderCheckingConnection(sqlite3.Connection):
    """Refuses numbered placeholders (``?1``) bound to a sequence, as Python 3.14's sqlite3 does.

    Python 3.12 and 3.13 warn (a ``DeprecationWarning``, an error under this
    suite's settings); 3.11 takes them silently, so this suite checks the rule
    itself on every Python.
    """

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        _check_placeholders(sql, parameters)
        return super().execute(sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        rows = list(parameters)
        for row in rows:
            _check_placeholders(sql, row)
        return super().executemany(sql, rows)


def _check_placeholders(sql: str, parameters: Any) -> None:
    import re

    if not isinstance(parameters, dict) and re.search(r"\?\d", sql):
        raise AssertionError(f"numbered placeholders bound to a sequence: {sql!r}")


async def test_no_statement_binds_numbered_placeholders_to_a_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read and write, replay and forget included, runs on Python 3.12 to 3.14's sqlite3."""
    connect = sqlite3.connect
    monkeypatch.setattr(
        sqlite3,
        "connect",
        lambda *args, **kwargs: connect(*args, factory=_PlaceholderCheckingConnection, **kwargs),
    )
    async with SQLiteStore(tmp_path / "t.db") as store:
        first = Message.user("first")
        await store.record_and_append("t", [episode_for(first)], [first], [3])
        for n in range(3):
            message = Message.assistant(f"reply {n}")
            await store.record_and_append("t", [episode_for(message)], [message], [2])
        stats = await store.stats("t")
        assert (await store.tail("t", after_seq=0)).messages[0].message.text == "first"
        await store.fold(
            "t",
            checkpoint=SummaryCheckpoint(trigger="manual", from_seq=1, through_seq=2, summary="s"),
            through_seq=2,
            expected_version=stats.version,
            replacement=[Message.user("s")],
            tokens=[1],
        )
        replayed = [record.seq async for record in store.replay("t")]
        assert replayed == [1, 2, 3, 4, 5]
        await store.forget("t")
        assert [record async for record in store.replay("t")] == []


async def test_a_write_that_waited_out_the_busy_timeout_says_what_holds_it_and_the_fix(
    tmp_path: Path,
) -> None:
    """A bare "database is locked" (all the CLI said after 30 s of silence) names the wait and the fix."""
    path = tmp_path / "held.db"
    async with SQLiteStore(path, busy_timeout=0.2) as store:
        await store.append("t", [Message.user("before")], [1])
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN EXCLUSIVE")
            with pytest.raises(StoreError) as raised:
                await store.append("t", [Message.user("blocked")], [1])
            other.execute("ROLLBACK")
        assert str(raised.value) == (
            f"SQLite database {str(path)!r}: database is locked (another connection held a lock on it "
            "for all of busy_timeout=0.2 seconds; end that process or its transaction and retry, or "
            "wait longer with a larger busy_timeout)"
        )
        assert [m.text for m in (await store.load("t")).plain] == ["before"]  # nothing of it written
