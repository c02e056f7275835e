"""Storage backends: the protocols and their implementations.

``ShortTermStore`` (the working context) and ``EpisodicStore`` (the
append-only log) are the two memories; ``Store`` is both in one backend, where
recording a step, folding a prefix and applying an edit of the conversation are
each one transaction. Every bundled backend is a ``Store``.

``PostgresStore`` needs the optional ``contextfold[postgres]`` extra; its
module (and psycopg) is imported only when the name is first looked up.
"""

from typing import TYPE_CHECKING, Any

from ._base import (
    ContextWindow,
    EpisodicStore,
    ShortTermStore,
    Store,
    StoredMessage,
    ThreadInfo,
    ThreadState,
    ThreadStats,
    Tombstone,
)
from ._memory import MemoryStore
from ._rows import MAX_THREAD_BYTES
from ._sqlite import SQLiteStore

if TYPE_CHECKING:
    from ._postgres import PostgresStore

__all__ = [
    "MAX_THREAD_BYTES",
    "ContextWindow",
    "EpisodicStore",
    "MemoryStore",
    "PostgresStore",
    "SQLiteStore",
    "ShortTermStore",
    "Store",
    "StoredMessage",
    "ThreadInfo",
    "ThreadState",
    "ThreadStats",
    "Tombstone",
]


def __getattr__(name: str) -> Any:
    if name != "PostgresStore":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from ._postgres import PostgresStore
    except ModuleNotFoundError as exc:
        if exc.name not in ("psycopg", "psycopg_pool"):
            raise
        missing = exc.name

        # A star import of this package looks the name up too, so a missing extra
        # surfaces when the store is created rather than when contextfold is imported.
        class PostgresStore:  # type: ignore[no-redef]
            def __init__(self, *args: object, **options: object) -> None:
                raise ImportError(
                    f"PostgresStore needs {missing}, which is not installed; "
                    "install the extra with: pip install 'contextfold[postgres]'"
                )

    return PostgresStore
