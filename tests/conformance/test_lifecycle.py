"""Opening, closing, durability and unreadable data, on every backend."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from contextfold import Message, StoreClosedError, StoreError
from contextfold.episodes import SummaryCheckpoint, UserMessageEpisode
from contextfold.stores import EpisodicStore, ShortTermStore

from .conftest import SQL_BACKENDS, OpenStore, RawSQL

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_each_backend_is_both_stores(store: Any) -> None:
    """Every backend implements ShortTermStore and EpisodicStore on one database."""
    assert isinstance(store, ShortTermStore)
    assert isinstance(store, EpisodicStore)


async def fill(store: Any) -> None:
    await store.append("t", [Message.user(f"m{n}") for n in range(5)], [2] * 5)
    await store.replace_prefix(
        "t", through_seq=3, expected_version=0, replacement=[Message.system("s")], tokens=[1]
    )
    await store.record("t", UserMessageEpisode(message=Message.user("m0")), at=T0)
    await store.record("t", SummaryCheckpoint(trigger="x", from_seq=1, through_seq=3, summary="s"), at=T0)


async def state(store: Any) -> tuple[Any, ...]:
    return (
        await store.load("t"),
        await store.stats("t"),
        [r async for r in store.replay("t")],
        await store.pressure("t", now=T0),
        await store.latest_checkpoint("t"),
    )


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_data_survives_closing_and_reopening(open_store: OpenStore) -> None:
    """What one store wrote is all there, counters included, in a store opened after it closed."""
    first = await open_store()
    await fill(first)
    written = await state(first)
    await first.aclose()
    second = await open_store()
    assert await state(second) == written
    stored = await second.append("t", [Message.user("more")], [1])
    assert stored[0].seq == 6


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_two_open_handles_share_one_database(open_store: OpenStore) -> None:
    """Writes through one open handle are seen, and continued, through another."""
    first, second = await open_store(), await open_store()
    await first.append("t", [Message.user("a")], [1])
    await second.append("t", [Message.user("b")], [1])
    await first.record("t", UserMessageEpisode(message=Message.user("a")))
    await second.record("t", UserMessageEpisode(message=Message.user("b")))
    assert [m.text for m in (await first.load("t")).plain] == ["a", "b"]
    assert [r.seq async for r in first.replay("t")] == [1, 2]
    assert (await first.pressure("t")).total_user_messages == 2


def uses(store: Any) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    async def lock() -> None:
        async with store.compaction_lock("t"):
            pass

    async def replay() -> None:
        async for _ in store.replay("t"):
            pass

    return [
        ("append", lambda: store.append("t", [Message.user("x")], [1])),
        ("load", lambda: store.load("t")),
        ("stats", lambda: store.stats("t")),
        (
            "replace_prefix",
            lambda: store.replace_prefix("t", through_seq=1, expected_version=0, replacement=[], tokens=[]),
        ),
        ("compaction_lock", lock),
        ("record", lambda: store.record("t", UserMessageEpisode(message=Message.user("x")))),
        ("replay", replay),
        ("pressure", lambda: store.pressure("t")),
        ("latest_checkpoint", lambda: store.latest_checkpoint("t")),
    ]


async def test_a_closed_store_refuses_every_operation(store: Any) -> None:
    """After aclose(), every operation raises StoreClosedError saying the store was closed."""
    await store.append("t", [Message.user("x")], [1])
    await store.aclose()
    await store.aclose()  # closing twice is harmless
    for name, use in uses(store):
        with pytest.raises(StoreClosedError, match="closed"):
            await use()
            pytest.fail(f"{name} worked on a closed store")


async def test_async_with_closes_the_store(open_store: OpenStore) -> None:
    """Leaving an ``async with`` block closes the store."""
    store = await open_store()
    async with store as entered:
        assert entered is store
        await store.append("t", [Message.user("x")], [1])
    with pytest.raises(StoreClosedError):
        await store.stats("t")


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_a_corrupt_message_row_names_its_thread_and_seq(store: Any, raw_sql: RawSQL) -> None:
    """A short-term row that no longer parses raises StoreError naming the thread and the seq."""
    await store.append("odd 'thread'", [Message.user(f"m{n}") for n in range(3)], [1, 1, 1])
    await raw_sql(
        "UPDATE messages SET body = ? WHERE thread = ? AND seq = ?",
        ['{"role": "wizard", "content": "hi"}', "odd 'thread'", 2],
    )
    with pytest.raises(StoreError, match=r"thread \"odd 'thread'\".*seq 2"):
        await store.load("odd 'thread'")


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_a_corrupt_episode_row_names_its_thread_and_seq(store: Any, raw_sql: RawSQL) -> None:
    """An episode row that no longer parses raises StoreError naming the thread and the seq."""
    await store.record("t", UserMessageEpisode(message=Message.user("fine")))
    await raw_sql(
        "INSERT INTO episodes (thread, seq, at, kind, body) VALUES (?, ?, ?, ?, ?)",
        ["t", 2, T0.isoformat(), "user_message", '{"kind": "user_message"}'],
    )
    with pytest.raises(StoreError, match=r"thread 't'.*episode seq 2"):
        [r async for r in store.replay("t")]


def test_postgres_store_without_psycopg_says_how_to_install_it() -> None:
    """Without psycopg, contextfold still imports and creating a PostgresStore names the extra to install."""
    script = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "import contextfold\n"
        "from contextfold.stores import MemoryStore, PostgresStore\n"
        "try:\n"
        "    PostgresStore('postgresql://127.0.0.1/x')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "pip install 'contextfold[postgres]'" in done.stdout


def test_the_stores_package_exports_every_backend() -> None:
    """contextfold.stores lists the protocols and all three backends in ``__all__``, each importable."""
    import contextfold.stores as stores

    assert set(stores.__all__) >= {"MemoryStore", "SQLiteStore", "PostgresStore"}
    for name in stores.__all__:
        value = getattr(stores, name)
        assert isinstance(value, int) if name.isupper() else value.__name__ == name
