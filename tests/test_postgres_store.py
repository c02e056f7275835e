"""What only the PostgreSQL backend has: its schema, server-side locks and guards, and its pool."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from psycopg import sql

from contextfold import ConfigError, ConflictError, StoreClosedError, StoreError
from contextfold._episodes import (
    Episode,
    LlmCallEpisode,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    ToolResultEpisode,
    UserMessageEpisode,
)
from contextfold._messages import Message
from contextfold.stores import ThreadStats
from contextfold.stores._postgres import SCHEMA_VERSION, PostgresStore
from contextfold.stores._rows import PressureCounters

pytestmark = pytest.mark.postgres

Opener = Callable[..., Any]


async def _sql(url: str, query: sql.Composable | str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(query, params)  # type: ignore[arg-type]
        return await cur.fetchall() if cur.description else []


@pytest.fixture
async def schema(postgres_url: str) -> AsyncIterator[str]:
    """A schema name of the test's own, with characters that need quoting; dropped afterwards."""
    name = f'cf pg "{uuid.uuid4().hex[:10]}"'
    yield name
    await _sql(postgres_url, sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
async def store(postgres_url: str, schema: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(postgres_url, schema=schema, max_size=4) as opened:
        yield opened


def _table(schema: str, table: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table))


def _users(count: int) -> list[Message]:
    return [Message.user(f"message {n}") for n in range(count)]


async def test_concurrent_first_opens_create_the_schema_once(postgres_url: str, schema: str) -> None:
    """Eight stores racing to create a missing schema all open, and leave one version row."""
    app = f"cf_open_{uuid.uuid4().hex[:8]}"
    stores = [
        PostgresStore(f"{postgres_url}?application_name={app}", schema=schema, min_size=0) for _ in range(8)
    ]
    # An uncommitted CREATE SCHEMA makes every opener queue behind it, so all eight
    # start their DDL at the same moment once it rolls back: the race at its worst.
    async with await psycopg.AsyncConnection.connect(postgres_url) as blocker:
        await blocker.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        async with anyio.create_task_group() as tg:
            for each in stores:
                tg.start_soon(each.open)
            with anyio.fail_after(20):
                while (await _sql(postgres_url, _WAITING, (app,)))[0][0] < len(stores):
                    await anyio.sleep(0.02)
            await blocker.rollback()
    try:
        await stores[3].append("t", _users(2), [1, 1])
        assert (await stores[5].stats("t")).message_count == 2
    finally:
        for each in stores:
            await each.aclose()
    query = sql.SQL("SELECT version FROM {}").format(_table(schema, "schema_version"))
    assert await _sql(postgres_url, query) == [(SCHEMA_VERSION,)]


_WAITING = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'"


async def test_reopening_keeps_the_data(postgres_url: str, schema: str) -> None:
    """Opening an existing schema again migrates nothing and finds what was written before."""
    async with PostgresStore(postgres_url, schema=schema) as first:
        await first.append("t", _users(3), [2, 2, 2])
        await first.record("t", UserMessageEpisode(message=Message.user("hi")))
    async with PostgresStore(postgres_url, schema=schema) as second:
        assert (await second.stats("t")).total_tokens == 6
        assert [r.seq async for r in second.replay("t")] == [1]


async def test_a_newer_schema_version_is_refused(postgres_url: str, schema: str) -> None:
    """A schema written by a newer release fails open with a StoreError naming the version and the fix."""
    async with PostgresStore(postgres_url, schema=schema):
        pass
    await _sql(postgres_url, sql.SQL("UPDATE {} SET version = 99").format(_table(schema, "schema_version")))
    with pytest.raises(StoreError, match=r"version 99.*upgrade contextfold") as caught:
        await PostgresStore(postgres_url, schema=schema).open()
    assert schema in str(caught.value)


async def test_unreachable_server_names_the_host_and_the_fix() -> None:
    """A DSN nobody listens on fails fast with a StoreError naming host, port and what to check."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = PostgresStore(f"postgresql://nobody:secret@127.0.0.1:{port}/nothing")
    with anyio.fail_after(10), pytest.raises(StoreError) as caught:
        await store.open()
    message = str(caught.value)
    assert f"127.0.0.1:{port}/nothing" in message
    assert "check that the server is running" in message
    assert "secret" not in message


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"max_size": 1}, "max_size"),
        ({"min_size": 5, "max_size": 4}, "max_size"),
        ({"min_size": -1}, "min_size"),
        ({"schema": ""}, "schema"),
        ({"schema": "x" * 64}, "schema"),
    ],
)
def test_bad_options_are_rejected_at_construction(options: dict[str, Any], key: str) -> None:
    """Pool sizes that could deadlock a compaction, and unusable schema names, raise ConfigError by key."""
    with pytest.raises(ConfigError) as caught:
        PostgresStore("postgresql://postgres@127.0.0.1:5432/test", **options)
    assert caught.value.key == key


async def test_raw_update_delete_and_truncate_of_episodes_are_rejected(
    postgres_url: str, schema: str, store: PostgresStore
) -> None:
    """The database itself refuses UPDATE, DELETE and TRUNCATE on the episode table, leaving it intact."""
    await store.record("t", UserMessageEpisode(message=Message.user("keep me")))
    episodes = _table(schema, "episodes")
    for statement in (
        sql.SQL("UPDATE {} SET body = '{{}}'").format(episodes),
        sql.SQL("DELETE FROM {}").format(episodes),
        sql.SQL("TRUNCATE {}").format(episodes),
    ):
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            await _sql(postgres_url, statement)
    [record] = [r async for r in store.replay("t")]
    assert isinstance(record.episode, UserMessageEpisode)
    assert record.episode.message.text == "keep me"


_HOLDER = textwrap.dedent(
    """
    import sys, anyio
    from contextfold.stores import PostgresStore

    async def main() -> None:
        async with PostgresStore(sys.argv[1], schema=sys.argv[2]) as store:
            async with store.compaction_lock(sys.argv[3]) as held:
                print("held" if held else "refused", flush=True)
                await anyio.sleep_forever()

    anyio.run(main)
    """
)


async def test_a_killed_holders_lock_is_released_by_the_server(
    postgres_url: str, schema: str, store: PostgresStore
) -> None:
    """Another process holding the lock excludes this one until it is SIGKILLed, then the lock frees."""
    thread = "shared thread"
    process = await anyio.open_process(
        [sys.executable, "-c", _HOLDER, postgres_url, schema, thread], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        with anyio.fail_after(30):
            line = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 100)
        assert line == b"held"
        async with store.compaction_lock(thread) as held:
            assert not held
    finally:
        process.kill()
        await process.wait()
    with anyio.fail_after(10):
        while True:
            # The server notices the dropped connection asynchronously; poll until it has.
            async with store.compaction_lock(thread) as held:
                if held:
                    break
            await anyio.sleep(0.05)


async def test_pool_serves_more_concurrent_calls_than_connections(postgres_url: str, schema: str) -> None:
    """Forty concurrent appends through a two-connection pool all land, with distinct seqs."""
    app = f"cf_pool_{uuid.uuid4().hex[:8]}"
    async with PostgresStore(f"{postgres_url}?application_name={app}", schema=schema, max_size=2) as store:
        async with anyio.create_task_group() as tg:
            for n in range(40):
                tg.start_soon(store.append, "t", [Message.user(f"m{n}")], [1])
        window = await store.load("t")
        assert sorted(m.seq for m in window.messages) == list(range(1, 41))
        sessions = await _sql(
            postgres_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
        )
        assert sessions[0][0] <= 2


async def test_a_compaction_writes_while_holding_the_lock_with_the_smallest_pool(
    postgres_url: str, schema: str
) -> None:
    """With max_size=2 the locked body can still load and replace the prefix through the other connection."""
    async with PostgresStore(postgres_url, schema=schema, min_size=0, max_size=2) as store:
        await store.append("t", _users(4), [5, 5, 5, 5])
        async with store.compaction_lock("t") as held:
            assert held
            window = await store.load("t")
            stats = await store.replace_prefix(
                "t",
                through_seq=3,
                expected_version=window.version,
                replacement=[Message.system("s")],
                tokens=[2],
            )
        assert (stats.message_count, stats.total_tokens, stats.version) == (2, 7, 1)


async def test_a_missing_cut_rolls_back_the_delete(store: PostgresStore) -> None:
    """A replacement through a seq past the newest raises ConflictError and deletes nothing."""
    await store.append("t", _users(5), [1, 2, 3, 4, 5])
    before = await store.load("t")
    with pytest.raises(ConflictError, match="no message with seq 6"):
        await store.replace_prefix("t", through_seq=6, expected_version=0, replacement=[], tokens=[])
    assert await store.load("t") == before
    assert await store.stats("t") == ThreadStats(message_count=5, total_tokens=15, version=0, last_seq=5)


async def test_a_window_larger_than_the_average_guess_is_read_in_full(store: PostgresStore) -> None:
    """When one huge old message skews the average, the window still holds every small message that fits."""
    await store.append("t", [Message.system("huge")], [10_000])
    await store.append("t", _users(300), [1] * 300)
    window = await store.load("t", max_tokens=5_000)
    assert [m.seq for m in window.messages] == list(range(2, 302))
    assert not window.complete
    assert (await store.load("t", max_tokens=10_300)).complete


async def test_a_thread_emptied_by_a_replacement_loads_as_empty(store: PostgresStore) -> None:
    """A thread whose whole context was dropped loads as an empty, complete window at its new version."""
    await store.append("t", _users(3), [1, 1, 1])
    await store.replace_prefix("t", through_seq=3, expected_version=0, replacement=[], tokens=[])
    for limit in (None, 0, 10):
        window = await store.load("t", max_tokens=limit)
        assert (window.messages, window.complete, window.version, window.total_tokens) == ((), True, 1, 0)


async def test_a_corrupt_message_row_names_thread_and_seq(
    postgres_url: str, schema: str, store: PostgresStore
) -> None:
    """A message row that no longer parses makes load raise a StoreError naming its thread and seq."""
    await store.append("it's thread", _users(3), [1, 1, 1])
    await _sql(
        postgres_url,
        sql.SQL("UPDATE {} SET body = %s WHERE seq = 2").format(_table(schema, "messages")),
        ('{"role": "robot"}',),
    )
    with pytest.raises(StoreError, match=r"thread \"it's thread\": short-term message seq 2"):
        await store.load("it's thread")
    assert [m.seq for m in (await store.load("it's thread", max_tokens=1)).messages] == [3]


async def test_a_corrupt_episode_row_names_thread_and_seq(
    postgres_url: str, schema: str, store: PostgresStore
) -> None:
    """An episode row inserted behind the store's back that does not parse fails replay by thread and seq."""
    await store.record("t", UserMessageEpisode(message=Message.user("ok")))
    await _sql(
        postgres_url,
        sql.SQL("INSERT INTO {} (thread, seq, kind, body) VALUES (%s, %s, %s, %s)").format(
            _table(schema, "episodes")
        ),
        ("t", 2, "user_message", "not json"),
    )
    with pytest.raises(StoreError, match="thread 't': episode seq 2"):
        _ = [r async for r in store.replay("t")]


def _random_episode(rng: random.Random) -> Episode:
    pick = rng.randrange(6)
    if pick <= 1:
        return UserMessageEpisode(message=Message.user("u"))
    if pick == 2:
        return RunCompletedEpisode(clean=rng.random() < 0.7)
    if pick == 3:
        return LlmCallEpisode(reply=Message.assistant("a"))
    if pick == 4:
        return ToolResultEpisode(message=Message.tool("c1", "r"))
    if rng.random() < 0.5:
        return SummaryCheckpoint(trigger="context_pressure", from_seq=1, through_seq=2, summary="s")
    return ManualRecoveryBoundary()


async def test_server_side_counters_follow_the_shared_pressure_arithmetic(store: PostgresStore) -> None:
    """After every one of 300 random episodes the counters the server kept equal PressureCounters'."""
    rng = random.Random(20261130)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    expected = PressureCounters()
    for n in range(300):
        episode = _random_episode(rng)
        at = start + timedelta(hours=7 * n)
        expected = expected.after(episode, at)
        await store.record("t", episode, at=at)
        now = at + timedelta(hours=1)
        assert await store.pressure("t", now=now, estimated_context_tokens=n) == expected.pressure(now, n)
    latest = await store.latest_checkpoint("t")
    assert (latest.seq if latest else None) == expected.boundary_seq


async def test_timestamps_come_back_in_utc_whatever_the_session_zone(postgres_url: str, schema: str) -> None:
    """With the server session in Tokyo time, recorded and replayed times are the same instant in UTC."""
    at = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    async with PostgresStore(f"{postgres_url}?options=-c%20TimeZone%3DAsia/Tokyo", schema=schema) as store:
        recorded = await store.record("t", UserMessageEpisode(message=Message.user("x")), at=at)
        [replayed] = [r async for r in store.replay("t")]
    assert recorded.at == replayed.at == at
    assert replayed.at.utcoffset() == timedelta(0)


async def test_use_before_open_and_after_close_is_refused(postgres_url: str, schema: str) -> None:
    """An unopened store says how to open it; a closed one raises StoreClosedError, also on reopen."""
    store = PostgresStore(postgres_url, schema=schema)
    with pytest.raises(StoreError, match=r"await store\.open"):
        await store.stats("t")
    await store.open()
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreClosedError):
        await store.append("t", _users(1), [1])
    with pytest.raises(StoreClosedError):
        _ = [r async for r in store.replay("t")]
    with pytest.raises(StoreClosedError):
        await store.open()


def _rows_read(plan: dict[str, Any], table: str) -> int:
    """Rows the plan's scans of ``table`` produced, over all their loops."""
    own = plan["Actual Rows"] * plan["Actual Loops"] if plan.get("Relation Name") == table else 0
    return own + sum(_rows_read(child, table) for child in plan.get("Plans", []))


async def test_a_windowed_load_reads_as_many_rows_whatever_the_thread_length(
    postgres_url: str, store: PostgresStore
) -> None:
    """The load query, run under EXPLAIN ANALYZE, reads as few message rows for 20,000 messages as for 200."""
    for thread, count in (("short", 200), ("long", 20_000)):
        for start in range(0, count, 5_000):
            size = min(5_000, count - start)
            await store.append(thread, _users(size), [1] * size)
    read = {}
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        for thread in ("short", "long"):
            for limit in (10, None):
                params = {"thread": thread, "limit": limit, "percent": 125}
                explain = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + store._load_query
                cur = await conn.execute(explain, params)
                row = await cur.fetchone()
                assert row is not None
                read[thread, limit] = _rows_read(row[0][0]["Plan"], "messages")
    assert read["long", 10] == read["short", 10] <= 10 * 125 // 100 + 16
    assert read["long", None] == 20_000, "the count must see a whole-thread read"
    window = await store.load("long", max_tokens=10)
    assert [m.seq for m in window.messages] == list(range(19_991, 20_001))
