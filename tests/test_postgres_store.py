"""What only the PostgreSQL backend has: its schema, server-side locks and guards, and its pool."""

from __future__ import annotations

import math
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

from contextfold import ConfigError, ConflictError, StoreClosedError, StoreError
from contextfold._episodes import (
    Episode,
    EpisodeRecord,
    LlmCallEpisode,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    ToolResultEpisode,
    UserMessageEpisode,
)
from contextfold._messages import SUMMARY_METADATA_KEY, Message
from contextfold.stores import ThreadStats
from contextfold.stores._postgres import _MIGRATIONS, SCHEMA_VERSION, PostgresStore
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


async def test_reading_times_needs_no_time_zone_file_on_the_loop(
    postgres_url: str, schema: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server in another time zone: timestamps read back in UTC, and no tz file is read on the loop.

    psycopg looks the session's zone up with zoneinfo, from disk, on the
    event loop, the first time a process reads a timestamp; under the
    blocking detector the lookup failed and psycopg fell back with a warning.
    """
    from psycopg import _tz

    monkeypatch.delitem(_tz._timezones, b"Europe/Paris", raising=False)
    url = postgres_url + ("&" if "?" in postgres_url else "?") + "options=-c%20TimeZone%3DEurope/Paris"
    async with PostgresStore(url, schema=schema) as store:
        before = datetime.now(UTC)
        await store.record("t", UserMessageEpisode(message=Message.user("hi")))
        [record] = [r async for r in store.replay("t")]
    assert record.at.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=5) < record.at < datetime.now(UTC) + timedelta(seconds=5)
    assert not [r.getMessage() for r in caplog.records if "timezone" in r.getMessage()]


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
        ({"max_size": 0}, "max_size"),
        ({"min_size": 5, "max_size": 4}, "max_size"),
        ({"min_size": -1}, "min_size"),
        ({"max_size": "10"}, "max_size"),
        ({"schema": ""}, "schema"),
        ({"schema": "x" * 64}, "schema"),
        ({"schema": "bad\x00name"}, "schema"),
        ({"schema": "bad\ud800name"}, "schema"),
        ({"lease_seconds": "x"}, "lease_seconds"),
        ({"lease_seconds": None}, "lease_seconds"),
        ({"lease_seconds": math.inf}, "lease_seconds"),
        ({"lease_seconds": 0}, "lease_seconds"),
        ({"lease_seconds": True}, "lease_seconds"),
        ({"statement_timeout": "30"}, "statement_timeout"),
        ({"statement_timeout": math.nan}, "statement_timeout"),
        ({"statement_timeout": -1}, "statement_timeout"),
        ({"dsn": "postgresql://postgres@127.0.0.1/te\x00st"}, "dsn"),
        ({"dsn": None}, "dsn"),
    ],
)
def test_bad_options_are_rejected_at_construction(options: dict[str, Any], key: str) -> None:
    """Bad pool sizes, schema names, DSNs, leases and timeouts raise ConfigError by key, unconnected."""
    options = {"dsn": "postgresql://postgres@127.0.0.1:5432/test", **options}
    with pytest.raises(ConfigError) as caught:
        PostgresStore(**options)
    assert caught.value.key == key
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        (
            "postgres+psycopg://app:hunter2@db.internal/agents",
            "postgres+psycopg://app:***@db.internal/agents",
        ),
        ("postgresql+asyncpg://app:hunter2@db.internal/agents", "drop '+asyncpg'"),
        ("mysql://app:hunter2@db.internal/agents", "mysql://app:***@db.internal/agents"),
        ("POSTGRESQL://app:hunter2@db/a", "'POSTGRESQL'"),
        ("postgresql://app:hunter2%zz@db/a", 'invalid percent-encoded token: "***"'),
        ("postgresql://app:hunter 2@db/a", 'unexpected spaces found in "***"'),
        ("postgresql://app:hunter2@[::1/a", 'URI: "postgresql://app:***@[::1/a"'),
        ("postgresql://app:p@ss@hunter2@db/a?bogus=1", "postgresql://app:***@db/a?bogus=1"),
        ("postgresql://app@db/a?password=hunter2%zz", 'invalid percent-encoded token: "***"'),
        ("postgresql://app@db/a?password=hunter2&bogus=1", 'invalid URI query parameter: "bogus"'),
        ("host=db password=hunter2 bogus=1", "host=db password=*** bogus=1"),
        ("host=db password='hunter 2", "unterminated quoted string"),
        ("postgresql://app:hunter2\udc80@db/a", "lone surrogate"),
    ],
)
def test_a_refused_dsn_never_shows_its_password(dsn: str, shown: str) -> None:
    """A DSN refused at construction is named with its password masked, on one line, saying what to use."""
    with pytest.raises(ConfigError) as caught:
        PostgresStore(dsn)
    text = str(caught.value)
    assert caught.value.key == "dsn"
    assert "hunter" not in text and "p@ss" not in text and "hunter" not in repr(caught.value.value)
    assert shown in text
    assert "\n" not in text
    assert "postgresql://" in caught.value.reason or "surrogate" in caught.value.reason


async def test_a_failed_connection_never_shows_the_password() -> None:
    """A password with a '/', which libpq reads as a port and a database, is masked when it fails."""
    store = PostgresStore("postgresql://127.0.0.1:hun/ter2@127.0.0.1:1/a")
    assert "ter2" not in repr(store)
    with pytest.raises(StoreError) as caught:
        await store.open()
    text = str(caught.value)
    assert "hun" not in text and "ter2" not in text and "127.0.0.1" in text


def test_a_one_connection_pool_is_accepted() -> None:
    """max_size=1 is a valid pool now that a compaction lease holds no connection."""
    store = PostgresStore("postgresql://postgres@127.0.0.1:5432/test", min_size=0, max_size=1)
    assert "PostgresStore" in repr(store)


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


_ON_TRIO = (
    r"PostgresStore runs on asyncio only .*, but {}\(\) was called on another event loop, such as trio; "
    r"run the program under asyncio .*or use SQLiteStore or MemoryStore, which run on trio too"
)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_opening_on_trio_is_a_store_error_saying_to_use_asyncio(anyio_backend: str) -> None:
    """Under trio, open() raises a StoreError naming asyncio and the stores that do run on trio."""
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/unused", schema="unused")
    with pytest.raises(StoreError, match=_ON_TRIO.format("open")) as caught:
        async with store:
            pass
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    await store.aclose()


async def test_a_store_opened_on_asyncio_refuses_calls_from_trio(store: PostgresStore) -> None:
    """A call made under trio (in a worker thread here) on a store asyncio opened raises that StoreError."""
    on_trio = partial(anyio.run, store.stats, "t", backend="trio")
    with pytest.raises(StoreError, match=_ON_TRIO.format("stats")):
        await anyio.to_thread.run_sync(on_trio)
    assert (await store.stats("t")).message_count == 0  # still serves its own loop


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


async def _columns(url: str, schema: str, table: str) -> dict[str, str]:
    rows = await _sql(
        url,
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_schema = %s AND table_name = %s",
        (schema, table),
    )
    return dict(rows)


async def test_a_version_1_schema_is_migrated_with_its_data(postgres_url: str, schema: str) -> None:
    """A schema written at version 1 opens at version 2 with bigint tokens, its rows intact and usable."""
    hello, reply = Message.user("hello"), Message.assistant("hi there")
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        s = sql.Identifier(schema)
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {}.schema_version (only_row boolean PRIMARY KEY DEFAULT true, version integer)"
            ).format(s)
        )
        for statement in _MIGRATIONS[0]:
            await conn.execute(sql.SQL(statement).format(s=s))  # type: ignore[arg-type]
        await conn.execute(sql.SQL("INSERT INTO {}.schema_version (version) VALUES (1)").format(s))
        await conn.execute(sql.SQL("INSERT INTO {}.threads VALUES ('t', 2, 7, 0, 2)").format(s))
        for seq, (message, tokens) in enumerate([(hello, 3), (reply, 4)], start=1):
            await conn.execute(
                sql.SQL("INSERT INTO {}.messages VALUES ('t', %s, %s, %s)").format(s),
                (seq, tokens, message.model_dump_json()),
            )
            episode = UserMessageEpisode(message=hello) if seq == 1 else LlmCallEpisode(reply=reply)
            await conn.execute(
                sql.SQL("INSERT INTO {}.episodes VALUES ('t', %s, now(), %s, %s)").format(s),
                (seq, episode.kind, episode.model_dump_json()),
            )
        await conn.execute(
            sql.SQL("INSERT INTO {}.episode_threads VALUES ('t', 2, now(), 1, 1, 0, 1, NULL)").format(s)
        )
    assert (await _columns(postgres_url, schema, "messages"))["tokens"] == "integer"

    async with PostgresStore(postgres_url, schema=schema) as store:
        window = await store.load("t")
        assert [(m.seq, m.message, m.tokens, m.episode_seq) for m in window.messages] == [
            (1, hello, 3, None),
            (2, reply, 4, None),
        ]
        assert [r.seq async for r in store.replay("t")] == [1, 2]
        (big,) = await store.append("t", [Message.user("huge")], [2**40])
        assert (await store.stats("t")).total_tokens == 7 + 2**40
        record = await store.fold(
            "t",
            checkpoint=SummaryCheckpoint(trigger="test", from_seq=1, through_seq=2, summary="greeted"),
            through_seq=2,
            expected_version=0,
            replacement=[Message.system("greeted")],
            tokens=[1],
        )
        assert record.seq == 3
        tombstone = await store.forget("t")
        assert (tombstone.messages, tombstone.episodes) == (2, 3)
        assert big.seq == 3
    columns = await _columns(postgres_url, schema, "messages")
    assert (columns["tokens"], columns["episode_seq"]) == ("bigint", "bigint")
    assert await _sql(
        postgres_url, sql.SQL("SELECT version FROM {}").format(_table(schema, "schema_version"))
    ) == [(SCHEMA_VERSION,)]


async def test_batched_records_keep_the_shared_pressure_arithmetic(store: PostgresStore) -> None:
    """Per random batch, the counters equal PressureCounters', and each message links its episode."""
    rng = random.Random(20261201)
    expected = PressureCounters()
    for n in range(80):
        episodes = [_random_episode(rng) for _ in range(rng.randrange(1, 6))]
        carriers = [
            i for i, e in enumerate(episodes) if isinstance(e, UserMessageEpisode | ToolResultEpisode)
        ]
        messages = [episodes[i].message for i in carriers]  # type: ignore[union-attr]
        for episode in episodes:
            expected = expected.after(episode, datetime.now(UTC))
        stored = await store.record_and_append(
            "t", episodes, messages, [1] * len(messages), message_episodes=carriers
        )
        state = await store.state("t")
        got = state.pressure
        assert (
            got.total_user_messages,
            got.user_messages_since_boundary,
            got.run_completed_since_boundary,
            got.user_messages_after_latest_run_completed,
        ) == (
            expected.total_user_messages,
            expected.user_messages_since_boundary,
            expected.run_completed_since_boundary,
            expected.user_messages_after_latest_run_completed,
        ), f"batch {n}"
        assert got.estimated_context_tokens == state.stats.total_tokens
        links = {m.seq: m.episode_seq for m in stored}
        assert [
            m.episode_seq
            for m in (await store.tail("t", after_seq=min(links, default=1) - 1)).messages
            if m.seq in links
        ] == list(links.values())
        for message in stored:
            assert message.episode_seq is not None
            [record] = [r async for r in store.replay("t", from_seq=message.episode_seq)][:1]
            assert record.episode.message == message.message  # type: ignore[union-attr]
    latest = await store.latest_checkpoint("t")
    assert (latest.seq if latest else None) == expected.boundary_seq


async def _fold_half(store: PostgresStore, thread: str, *, summarizing: float = 0.0) -> EpisodeRecord:
    window = await store.load(thread)
    cut = window.messages[: len(window.messages) // 2]
    await anyio.sleep(summarizing)  # the summarizer's own time
    return await store.fold(
        thread,
        checkpoint=SummaryCheckpoint(
            trigger="test", from_seq=cut[0].seq, through_seq=cut[-1].seq, summary=f"{len(cut)} folded"
        ),
        through_seq=cut[-1].seq,
        expected_version=window.version,
        replacement=[Message.system(f"{len(cut)} folded", metadata={SUMMARY_METADATA_KEY: True})],
        tokens=[1],
    )


async def test_fifty_threads_compact_at_once_on_a_default_pool(postgres_url: str, schema: str) -> None:
    """50 leases, 0.5 s summaries and folds at once on default pool settings: all apply, in about 0.5 s."""
    app = f"cf_burst_{uuid.uuid4().hex[:8]}"
    threads = [f"thread {n}" for n in range(50)]
    async with PostgresStore(f"{postgres_url}?application_name={app}", schema=schema) as store:
        for thread in threads:
            messages = _users(8)
            await store.record_and_append(
                thread,
                [UserMessageEpisode(message=m) for m in messages],
                messages,
                [5] * 8,
                message_episodes=range(8),
            )
        folded: dict[str, EpisodeRecord] = {}

        async def compact(thread: str) -> None:
            async with store.compaction_lock(thread) as mine:
                assert mine
                folded[thread] = await _fold_half(store, thread, summarizing=0.5)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for thread in threads:
                tg.start_soon(compact, thread)
        elapsed = time.perf_counter() - start
        for thread in threads:
            window = await store.load(thread)
            assert window.version == 1
            assert window.messages[0].message.text == "4 folded"
            assert window.messages[0].episode_seq == folded[thread].seq == 9
            assert [m.seq for m in window.messages] == [4, 5, 6, 7, 8]
        sessions = await _sql(
            postgres_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
        )
        assert sessions[0][0] <= 10
    assert elapsed < 0.5 + 1.5, f"50 folds took {elapsed:.2f} s against 0.5 s of summarizing"


async def test_a_lease_holds_no_connection_while_its_body_runs(postgres_url: str, schema: str) -> None:
    """With a one-connection pool the lease holder loads and folds, while another handle is refused."""
    async with (
        PostgresStore(postgres_url, schema=schema, min_size=0, max_size=1) as store,
        PostgresStore(postgres_url, schema=schema, min_size=0, max_size=1) as other,
    ):
        await store.append("t", _users(4), [5, 5, 5, 5])
        async with store.compaction_lock("t") as mine:
            assert mine
            async with other.compaction_lock("t") as theirs:
                assert not theirs
            await _fold_half(store, "t")
        async with other.compaction_lock("t") as theirs:
            assert theirs, "a released lease is free at once"
        assert (await store.stats("t")).version == 1
        assert await _sql(
            postgres_url, sql.SQL("SELECT count(*) FROM {}").format(_table(schema, "compaction_leases"))
        ) == [(0,)]


async def test_an_expired_lease_is_taken_over_by_the_server_clock(postgres_url: str, schema: str) -> None:
    """A lease not released within lease_seconds of the server's clock is taken by the next worker."""
    async with (
        PostgresStore(postgres_url, schema=schema, lease_seconds=0.3) as first,
        PostgresStore(postgres_url, schema=schema) as second,
    ):
        async with first.compaction_lock("t") as mine:
            assert mine
            [(left,)] = await _sql(
                postgres_url,
                sql.SQL("SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM {}").format(
                    _table(schema, "compaction_leases")
                ),
            )
            assert 0 < left <= 0.3
            taken_at = None
            with anyio.fail_after(10):
                while taken_at is None:
                    async with second.compaction_lock("t") as theirs:
                        if theirs:
                            taken_at = time.monotonic()
                    await anyio.sleep(0.02)  # polling the server's clock


async def test_a_statement_over_statement_timeout_is_cancelled_by_the_server(
    postgres_url: str, schema: str
) -> None:
    """An append stuck behind a lock fails with a StoreError after statement_timeout, and is not applied."""
    async with PostgresStore(postgres_url, schema=schema, statement_timeout=0.3) as store:
        await store.append("t", _users(1), [1])
        async with await psycopg.AsyncConnection.connect(postgres_url) as blocker:
            await blocker.execute(
                sql.SQL("SELECT 1 FROM {} WHERE thread = 't' FOR UPDATE").format(_table(schema, "threads"))
            )
            start = time.perf_counter()
            with pytest.raises(StoreError, match=r"statement_timeout=0\.3 s") as caught:
                await store.append("t", _users(1), [1])
            assert 0.25 < time.perf_counter() - start < 3
            assert "raise statement_timeout" in str(caught.value)
            await blocker.rollback()
        assert (await store.stats("t")).message_count == 1


async def _sessions(url: str, app: str) -> int:
    rows = await _sql(url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,))
    return int(rows[0][0])


async def test_a_cancelled_aclose_still_closes_the_pool(postgres_url: str, schema: str) -> None:
    """aclose() called in an already cancelled scope closes the pool and its sessions all the same."""
    app = f"cf_close_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(f"{postgres_url}?application_name={app}", schema=schema, min_size=2)
    await store.open()
    assert await _sessions(postgres_url, app) == 2
    with anyio.CancelScope() as scope:
        scope.cancel()
        await store.aclose()
    with pytest.raises(StoreClosedError):
        await store.stats("t")
    with anyio.fail_after(10):
        while await _sessions(postgres_url, app):
            await anyio.sleep(0.02)  # the server notices closed sessions asynchronously


async def test_aclose_during_open_leaves_no_pool_behind(postgres_url: str, schema: str) -> None:
    """An aclose() racing an open() waits for it and closes what it opened: no session outlives the store."""
    app = f"cf_race_{uuid.uuid4().hex[:8]}"
    for _ in range(5):
        store = PostgresStore(f"{postgres_url}?application_name={app}", schema=schema, min_size=2)

        async def opening(store: PostgresStore = store) -> None:
            try:
                await store.open()
            except StoreClosedError:
                pass  # aclose won the race: open is refused, which is what it promises

        async with anyio.create_task_group() as tg:
            tg.start_soon(opening)
            await anyio.sleep(0)
            tg.start_soon(store.aclose)
        await store.aclose()
        with pytest.raises(StoreClosedError):
            await store.open()
        assert store._pool is None
    with anyio.fail_after(10):
        while await _sessions(postgres_url, app):
            await anyio.sleep(0.02)  # the server notices closed sessions asynchronously


async def test_calls_waiting_for_a_connection_end_promptly_when_the_store_closes(
    postgres_url: str, schema: str
) -> None:
    """Calls waiting for a connection when the store closes raise StoreClosedError at once, not after 30 s.

    The one connection is held by a writer, and the test holds the pool's lock,
    so the pool's own close cannot wake anyone: the calls made before aclose()
    and those made during it must end all the same. Without that, one reaching
    the pool's lock behind its close queued after it and waited out the pool's
    timeout, then failed as if the pool were too small.
    """
    app = f"cf_wait_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(f"{postgres_url}?application_name={app}", schema=schema, min_size=1, max_size=1)
    await store.open()
    await store.append("t", _users(1), [1])
    pool = store._pool
    assert pool is not None
    ended: dict[str, tuple[str, float]] = {}
    closed_at = math.inf

    async def call(name: str, method: Callable[[], Any]) -> None:
        try:
            await method()
            outcome = "returned"
        except StoreClosedError:
            outcome = "closed"
        ended[name] = (outcome, time.monotonic() - closed_at)

    async with await psycopg.AsyncConnection.connect(postgres_url) as blocker:
        await blocker.execute(
            sql.SQL("SELECT 1 FROM {} WHERE thread = 't' FOR UPDATE").format(_table(schema, "threads"))
        )
        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(call, "writer", partial(store.append, "t", _users(1), [1]))
                with anyio.fail_after(10):
                    while not (await _sql(postgres_url, _WAITING, (app,)))[0][0]:
                        await anyio.sleep(0.02)  # the server reports lock waits asynchronously
                async with pool._lock:
                    for name in ("stats before", "load before", "state before"):
                        tg.start_soon(call, name, partial(getattr(store, name.split()[0]), "t"))
                    await anyio.wait_all_tasks_blocked()
                    closed_at = time.monotonic()
                    tg.start_soon(store.aclose)
                    for name in ("stats during", "load during", "state during"):
                        tg.start_soon(call, name, partial(getattr(store, name.split()[0]), "t"))
                    with anyio.fail_after(1):
                        while len(ended) < 6:
                            await anyio.sleep(0.01)
            finally:
                await blocker.rollback()
    assert ended.pop("writer")[0] == "returned"
    assert {name: outcome for name, (outcome, _) in ended.items()} == dict.fromkeys(ended, "closed")
    assert len(ended) == 6


async def test_only_the_tombstones_transaction_may_delete_episodes(
    postgres_url: str, schema: str, store: PostgresStore
) -> None:
    """A thread's episodes may be deleted only under its own tombstone; updates are always refused."""
    await store.record("a", UserMessageEpisode(message=Message.user("a")))
    await store.record("b", UserMessageEpisode(message=Message.user("b")))
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {} (thread, messages, episodes) VALUES ('a', 0, 0)").format(
                _table(schema, "tombstones")
            )
        )
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            await conn.execute(
                sql.SQL("DELETE FROM {} WHERE thread = 'b'").format(_table(schema, "episodes"))
            )
        await conn.rollback()
    await store.forget("a")
    for statement in (
        sql.SQL("DELETE FROM {} WHERE thread = 'b'").format(_table(schema, "episodes")),
        sql.SQL("UPDATE {} SET body = '{{}}'").format(_table(schema, "episodes")),
        sql.SQL("DELETE FROM {}").format(_table(schema, "tombstones")),
    ):
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            await _sql(postgres_url, statement)
    assert [r.seq async for r in store.replay("b")] == [1]
    assert [r.seq async for r in store.replay("a")] == []
    assert [(t.thread, t.episodes) for t in await store.tombstones("a")] == [("a", 1)]
