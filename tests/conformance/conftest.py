"""One fixture that runs every contract test on every backend.

``store`` is an open store for the test's backend (memory, SQLite, PostgreSQL);
``open_store`` opens another handle on the same data, to test durability and
separate workers (its keyword arguments are options of the SQL stores).
PostgreSQL tests get a schema of their own, dropped afterwards.
``raw_sql`` runs SQL on the backend's database directly, bypassing the store,
for the tests that show what the database itself enforces; tests that need it
narrow ``backend`` to ``SQL_BACKENDS``.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from contextfold.stores import MemoryStore, SQLiteStore

OpenStore = Callable[..., Awaitable[Any]]
RawSQL = Callable[[str, Sequence[Any]], Awaitable[list[tuple[Any, ...]]]]

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    # synchronous=NORMAL makes a step's small writes on the event loop's own connection.
    pytest.param("sqlite-normal", id="sqlite-normal"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]
SQL_BACKENDS = BACKENDS[1:]


def dialect(backend: str) -> str:
    """The SQL a backend speaks: ``sqlite`` for either synchronous mode, else the backend."""
    return "sqlite" if backend.startswith("sqlite") else backend


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    """Where the test's data lives: the SQLite file, or the PostgreSQL URL and schema."""
    if backend.startswith("sqlite"):
        return {"path": str(tmp_path / "contextfold.db")}
    if backend == "postgres":
        return {"url": request.getfixturevalue("postgres_url"), "schema": f"cf_test_{uuid.uuid4().hex[:12]}"}
    return {}


@pytest.fixture
async def open_store(backend: str, database: dict[str, str]) -> AsyncIterator[OpenStore]:
    """A factory of stores over one shared database; every store it opens is closed after the test."""
    opened: list[Any] = []
    memory = MemoryStore()  # the memory backend shares data between handles only within one object

    async def factory(**options: Any) -> Any:
        if backend == "memory":
            return memory
        if backend.startswith("sqlite"):
            if backend == "sqlite-normal":
                options.setdefault("synchronous", "NORMAL")
            store: Any = SQLiteStore(database["path"], **options)
        else:
            from contextfold.stores import PostgresStore

            store = PostgresStore(database["url"], schema=database["schema"], **options)
        await store.__aenter__()
        opened.append(store)
        return store

    yield factory
    for store in reversed(opened):
        await store.aclose()
    await memory.aclose()
    if backend == "postgres":
        import psycopg

        async with await psycopg.AsyncConnection.connect(database["url"], autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{database["schema"]}" CASCADE')


@pytest.fixture
async def store(open_store: OpenStore) -> Any:
    return await open_store()


@pytest.fixture
def raw_sql(backend: str, database: dict[str, str]) -> RawSQL:
    """Run one statement (``?`` placeholders) in its own transaction on the store's tables."""

    async def sqlite_run(statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(database["path"], timeout=30)
        try:
            with conn:
                return conn.execute(statement, tuple(params)).fetchall()
        finally:
            conn.close()

    async def postgres_run(statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(database["url"]) as conn:
            await conn.execute(f'SET search_path TO "{database["schema"]}"')
            cur = await conn.execute(statement.replace("?", "%s"), tuple(params))
            rows = await cur.fetchall() if cur.description else []
            await conn.commit()
            return rows

    if backend.startswith("sqlite"):
        return sqlite_run
    if backend == "postgres":
        return postgres_run
    pytest.fail("raw_sql needs a SQL backend: parametrize the test with SQL_BACKENDS")
