"""One fixture that runs every contract test on every backend.

``store`` is an open store for the test's backend (memory, SQLite, PostgreSQL);
``open_store`` opens another handle on the same data, to test durability and
separate workers. PostgreSQL tests get a schema of their own, dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from contextfold.stores import MemoryStore, SQLiteStore

OpenStore = Callable[[], Awaitable[Any]]

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[OpenStore]:
    """A factory of stores over one shared database; every store it opens is closed after the test."""
    opened: list[Any] = []
    memory = MemoryStore()  # the memory backend shares data between handles only within one object
    schema = f"cf_test_{uuid.uuid4().hex[:12]}"
    url = request.getfixturevalue("postgres_url") if backend == "postgres" else ""

    async def factory() -> Any:
        if backend == "memory":
            return memory
        if backend == "sqlite":
            store: Any = SQLiteStore(tmp_path / "contextfold.db")
        else:
            from contextfold.stores import PostgresStore

            store = PostgresStore(url, schema=schema)
        await store.__aenter__()
        opened.append(store)
        return store

    yield factory
    for store in reversed(opened):
        await store.aclose()
    await memory.aclose()
    if backend == "postgres":
        import psycopg

        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
async def store(open_store: OpenStore) -> Any:
    return await open_store()
