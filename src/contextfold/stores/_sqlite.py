"""``SQLiteStore``: both stores in one SQLite file, the embedded default.

Every write and every read of messages or episodes is one short transaction
run in a worker thread, so the event loop never waits on the disk or on
another process's write lock. The file is in WAL mode, so readers do not
block the writer, and several processes may open it at once: ``BEGIN
IMMEDIATE`` serializes their writes and ``busy_timeout`` makes them queue
instead of failing.

``stats()`` and ``pressure()``, which a step loop calls before every model
request, read one row by primary key on the event loop itself, through a
second, read-only connection that never waits (see ``SQLiteStore._read``); anything
that would make them wait sends them to the worker thread instead.

The schema version lives in ``PRAGMA user_version`` and is migrated on open.
The episode table is append-only in the database itself: triggers reject
UPDATE, DELETE and a replacing INSERT, whoever issues them.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

import anyio
from anyio import to_thread
from anyio.lowlevel import checkpoint

from .._episodes import Episode, EpisodeRecord
from .._errors import ConfigError, StoreClosedError, StoreError
from .._messages import Message
from .._policy import EpisodicCompactionPressure
from .._resource import AsyncResource
from ._base import ContextWindow, StoredMessage, ThreadStats
from ._rows import (
    PressureCounters,
    Window,
    check_from_seq,
    check_max_tokens,
    check_replace,
    check_thread,
    decode_episode,
    encode_episode,
    encode_messages,
    missing_seq_conflict,
    utc,
    version_conflict,
)

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

SCHEMA_VERSION = 1
"""The schema this code writes; ``PRAGMA user_version`` of every file it opened."""

_T = TypeVar("_T")

_REPLAY_BATCH = 256

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE threads (
            thread TEXT PRIMARY KEY,
            message_count INTEGER NOT NULL,
            total_tokens INTEGER NOT NULL,
            version INTEGER NOT NULL,
            last_seq INTEGER NOT NULL
        ) WITHOUT ROWID""",
        """CREATE TABLE messages (
            thread TEXT NOT NULL,
            seq INTEGER NOT NULL,
            tokens INTEGER NOT NULL,
            body TEXT NOT NULL,
            PRIMARY KEY (thread, seq)
        )""",
        """CREATE TABLE episode_threads (
            thread TEXT PRIMARY KEY,
            last_seq INTEGER NOT NULL,
            total_user_messages INTEGER NOT NULL,
            user_messages_since_boundary INTEGER NOT NULL,
            run_completed_since_boundary INTEGER NOT NULL,
            user_messages_after_latest_run_completed INTEGER NOT NULL,
            boundary_seq INTEGER,
            first_at TEXT
        ) WITHOUT ROWID""",
        """CREATE TABLE episodes (
            thread TEXT NOT NULL,
            seq INTEGER NOT NULL,
            at TEXT NOT NULL,
            kind TEXT NOT NULL,
            body TEXT NOT NULL,
            PRIMARY KEY (thread, seq)
        )""",
        """CREATE TRIGGER episodes_no_update BEFORE UPDATE ON episodes
        BEGIN SELECT RAISE(ABORT, 'contextfold episodes are append-only: UPDATE is not allowed'); END""",
        """CREATE TRIGGER episodes_no_delete BEFORE DELETE ON episodes
        BEGIN SELECT RAISE(ABORT, 'contextfold episodes are append-only: DELETE is not allowed'); END""",
        # INSERT OR REPLACE deletes the old row without firing DELETE triggers.
        """CREATE TRIGGER episodes_no_replace BEFORE INSERT ON episodes
        WHEN EXISTS (SELECT 1 FROM episodes WHERE thread = NEW.thread AND seq = NEW.seq)
        BEGIN SELECT RAISE(ABORT, 'contextfold episodes are append-only: a seq is written once'); END""",
        """CREATE TABLE compaction_leases (
            thread TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            expires_at REAL NOT NULL
        ) WITHOUT ROWID""",
    ),
}

_COUNTERS = (
    "last_seq, total_user_messages, user_messages_since_boundary, run_completed_since_boundary, "
    "user_messages_after_latest_run_completed, boundary_seq, first_at"
)


@contextmanager
def _transaction(conn: sqlite3.Connection, mode: Literal["DEFERRED", "IMMEDIATE"]) -> Iterator[None]:
    """One transaction: committed when the block ends, rolled back if it raises."""
    conn.execute(f"BEGIN {mode}")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _one(conn: sqlite3.Connection, query: str, params: tuple[object, ...]) -> tuple[Any, ...] | None:
    """The query's only row, or ``None``; the statement runs to its end.

    Stepping to the end resets the statement at once, so no read snapshot stays
    open between calls to hold back WAL checkpoints.
    """
    rows = conn.execute(query, params).fetchall()
    return rows[0] if rows else None


def _whole_numbers(thread: str, what: str, values: Sequence[object]) -> None:
    if not all(type(value) is int for value in values):
        raise StoreError(
            f"thread {thread!r}: {what} is corrupt (expected whole numbers, found {tuple(values)!r}); "
            "restore the database from a backup"
        )


def _read_stats(conn: sqlite3.Connection, thread: str) -> ThreadStats:
    row = _one(
        conn, "SELECT message_count, total_tokens, version, last_seq FROM threads WHERE thread = ?", (thread,)
    )
    if row is None:
        return ThreadStats()
    _whole_numbers(thread, "the threads row", row)
    return ThreadStats(message_count=row[0], total_tokens=row[1], version=row[2], last_seq=row[3])


def _write_stats(conn: sqlite3.Connection, thread: str, stats: ThreadStats) -> None:
    conn.execute(
        """INSERT INTO threads (thread, message_count, total_tokens, version, last_seq)
        VALUES (?, ?, ?, ?, ?)
        ON CONFLICT (thread) DO UPDATE SET message_count = excluded.message_count,
            total_tokens = excluded.total_tokens, version = excluded.version, last_seq = excluded.last_seq""",
        (thread, stats.message_count, stats.total_tokens, stats.version, stats.last_seq),
    )


def _insert_messages(
    conn: sqlite3.Connection, thread: str, first_seq: int, rows: list[tuple[str, int]]
) -> None:
    conn.executemany(
        "INSERT INTO messages (thread, seq, tokens, body) VALUES (?, ?, ?, ?)",
        [(thread, first_seq + n, count, body) for n, (body, count) in enumerate(rows)],
    )


def _parse_time(thread: str, what: str, text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"thread {thread!r}: {what} has an unreadable time {text!r}") from exc


def _read_counters(conn: sqlite3.Connection, thread: str) -> PressureCounters:
    row = _one(conn, f"SELECT {_COUNTERS} FROM episode_threads WHERE thread = ?", (thread,))
    if row is None:
        return PressureCounters()
    first_at = None if row[6] is None else _parse_time(thread, "the first episode", row[6])
    last_seq, total, since, runs, after, boundary_seq = row[:6]
    _whole_numbers(thread, "the episode_threads row", row[:5] if boundary_seq is None else row[:6])
    return PressureCounters(
        last_seq=last_seq,
        total_user_messages=total,
        user_messages_since_boundary=since,
        run_completed_since_boundary=runs,
        user_messages_after_latest_run_completed=after,
        boundary_seq=boundary_seq,
        first_at=first_at,
    )


def _write_counters(conn: sqlite3.Connection, thread: str, counters: PressureCounters) -> None:
    conn.execute(
        f"""INSERT OR REPLACE INTO episode_threads (thread, {_COUNTERS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
        (
            thread,
            counters.last_seq,
            counters.total_user_messages,
            counters.user_messages_since_boundary,
            counters.run_completed_since_boundary,
            counters.user_messages_after_latest_run_completed,
            counters.boundary_seq,
            None if counters.first_at is None else counters.first_at.isoformat(),
        ),
    )


def _episode_record(thread: str, seq: int, at: str, body: str) -> EpisodeRecord:
    return EpisodeRecord(
        thread=thread,
        seq=seq,
        at=_parse_time(thread, f"episode seq {seq}", at),
        episode=decode_episode(thread, seq, body),
    )


class SQLiteStore(AsyncResource):
    """A ``ShortTermStore`` and ``EpisodicStore`` in one SQLite file.

    ``busy_timeout`` is how long, in seconds, a write waits for another
    process's transaction before failing. ``lease_seconds`` bounds how long a
    compaction lock outlives a holder that crashed; a compaction that runs
    longer may see a second one start, and then the version guard of
    ``replace_prefix`` lets only one of them apply. ``synchronous="FULL"``
    survives power loss; ``"NORMAL"`` is faster and still survives a crashed
    process. ``clock`` gives the wall time leases are measured in.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 30.0,
        lease_seconds: float = 300.0,
        synchronous: Literal["NORMAL", "FULL"] = "FULL",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not busy_timeout > 0:
            raise ConfigError(
                "busy_timeout", "must be a positive number of seconds, e.g. 30", value=busy_timeout
            )
        if not lease_seconds > 0:
            raise ConfigError(
                "lease_seconds", "must be a positive number of seconds, e.g. 300", value=lease_seconds
            )
        if synchronous not in ("NORMAL", "FULL"):
            raise ConfigError("synchronous", "must be 'FULL' or 'NORMAL'", value=synchronous)
        self.path = Path(path)
        self._busy_timeout = busy_timeout
        self._lease_seconds = lease_seconds
        self._synchronous = synchronous
        self._clock = clock
        self._conn: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._lock = anyio.Lock()
        self._closed = False
        self._leases: set[tuple[str, str]] = set()

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._call(lambda conn: None)
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            async with self._lock:
                conn, self._conn = self._conn, None
                reader, self._reader = self._reader, None
                if conn is not None:
                    await to_thread.run_sync(self._close, conn, reader)

    def _close(self, conn: sqlite3.Connection, reader: sqlite3.Connection | None) -> None:
        if reader is not None:
            reader.close()
        try:
            if self._leases:
                with _transaction(conn, "IMMEDIATE"):
                    conn.executemany(
                        "DELETE FROM compaction_leases WHERE thread = ? AND owner = ?", list(self._leases)
                    )
                self._leases.clear()
        except sqlite3.Error:
            pass  # an unreleased lease expires after lease_seconds
        finally:
            conn.close()

    def _connect(self) -> tuple[sqlite3.Connection, sqlite3.Connection]:
        """The writing connection, with the file in WAL mode and migrated, and the on-loop reader."""
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            self._migrate(conn)
            # No busy handler: where the writer would sleep waiting for a lock, the
            # reader gets SQLITE_BUSY at once (see _read).
            reader = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
            try:
                reader.execute("PRAGMA busy_timeout = 0")
                reader.execute("PRAGMA query_only = ON")
            except BaseException:
                reader.close()
                raise
        except BaseException:
            conn.close()
            raise
        return conn, reader

    def _migrate(self, conn: sqlite3.Connection) -> None:
        with _transaction(conn, "IMMEDIATE"):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"SQLite database {str(self.path)!r} has schema version {version}, newer than "
                    f"version {SCHEMA_VERSION} this contextfold understands; upgrade contextfold to "
                    "the release that wrote it, or open a different file"
                )
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target]:
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _closed_error(self) -> StoreClosedError:
        return StoreClosedError(f"{self!r} was closed with aclose(); open a new SQLiteStore")

    async def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` on the connection in a worker thread, one call at a time."""
        async with self._lock:
            if self._closed:
                raise self._closed_error()
            try:
                if self._conn is None:
                    conn, self._reader = await to_thread.run_sync(self._connect)
                    self._conn = conn
                return await to_thread.run_sync(fn, self._conn)
            except sqlite3.Error as exc:
                raise StoreError(f"SQLite database {str(self.path)!r}: {exc}") from exc

    async def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """A one-row read on the event loop when it cannot wait, else in the worker thread.

        A hop to the worker thread and back costs far more than reading one row
        by primary key, and a step loop pays it before every model request. The
        read may stay on the loop because it cannot wait on anything another
        transaction holds for long:

        * In WAL mode a reader takes no lock that a writer or a checkpoint holds
          for the length of its work; it reads the last committed snapshot.
        * The reader has no busy handler (``busy_timeout = 0``), so where SQLite
          would sleep for a lock (another connection rebuilding the WAL index
          after a crash, say) it returns SQLITE_BUSY at once, and the read is
          redone in the worker thread, which may wait.
        * What remains is SQLite's own retry of a race with a writer that is
          updating the WAL index header, a window of a few instructions with no
          I/O. SQLite bounds that retry below 10 s in total, a limit reached only
          when another process ignores the locking protocol (then SQLITE_PROTOCOL).
        * The rows read are one B-tree path in a table every write touches, so
          their pages come from the page cache.
        * Once, after a writer crashed half-way through updating the WAL index,
          the first reader to notice rebuilds the index by reading the WAL file,
          which automatic checkpoints keep to a few megabytes.

        The statement runs to completion, so no read snapshot stays open to hold
        back checkpoints (the WAL could otherwise grow without bound).
        """
        await checkpoint()
        if self._closed:
            raise self._closed_error()
        reader = self._reader
        if reader is not None:
            try:
                return fn(reader)
            except sqlite3.OperationalError as exc:
                code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
                if code not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                    raise StoreError(f"SQLite database {str(self.path)!r}: {exc}") from exc
            except sqlite3.Error as exc:
                raise StoreError(f"SQLite database {str(self.path)!r}: {exc}") from exc
        return await self._call(fn)

    # short-term -----------------------------------------------------------

    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        check_thread(thread)
        rows = encode_messages(messages, tokens)

        def run(conn: sqlite3.Connection) -> int:
            with _transaction(conn, "IMMEDIATE"):
                stats = _read_stats(conn, thread)
                _insert_messages(conn, thread, stats.last_seq + 1, rows)
                added = sum(count for _, count in rows)
                _write_stats(
                    conn,
                    thread,
                    stats.model_copy(
                        update={
                            "message_count": stats.message_count + len(rows),
                            "total_tokens": stats.total_tokens + added,
                            "last_seq": stats.last_seq + len(rows),
                        }
                    ),
                )
            return stats.last_seq + 1

        first = await self._call(run)
        return [
            StoredMessage(seq=first + n, message=message, tokens=count)
            for n, (message, count) in enumerate(zip(messages, tokens, strict=True))
        ]

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        check_thread(thread)
        limit = check_max_tokens(max_tokens)

        def run(conn: sqlite3.Connection) -> ContextWindow:
            window = Window(thread, limit)
            with _transaction(conn, "DEFERRED"):
                stats = _read_stats(conn, thread)
                # The cursor steps through the index newest first, one row at a time,
                # so stopping here leaves the older rows unread.
                rows = conn.execute(
                    "SELECT seq, tokens, body FROM messages WHERE thread = ? ORDER BY seq DESC", (thread,)
                )
                try:
                    for seq, tokens, body in rows:
                        if not window.offer(seq, tokens, body):
                            break
                finally:
                    rows.close()
            return ContextWindow(
                thread=thread,
                messages=window.messages(),
                version=stats.version,
                total_tokens=stats.total_tokens,
                complete=not window.full,
            )

        return await self._call(run)

    async def stats(self, thread: str) -> ThreadStats:
        check_thread(thread)
        return await self._read(partial(_read_stats, thread=thread))

    async def replace_prefix(
        self,
        thread: str,
        *,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
    ) -> ThreadStats:
        check_thread(thread)
        check_replace(through_seq, expected_version)
        rows = encode_messages(replacement, tokens, field="replacement")

        def run(conn: sqlite3.Connection) -> ThreadStats:
            with _transaction(conn, "IMMEDIATE"):
                stats = _read_stats(conn, thread)
                if stats.version != expected_version:
                    raise version_conflict(thread, stats.version, expected_version)
                found = conn.execute(
                    "SELECT 1 FROM messages WHERE thread = ? AND seq = ?", (thread, through_seq)
                ).fetchone()
                if found is None:
                    raise missing_seq_conflict(thread, through_seq)
                count, removed = conn.execute(
                    "SELECT count(*), coalesce(sum(tokens), 0) FROM messages WHERE thread = ? AND seq <= ?",
                    (thread, through_seq),
                ).fetchone()
                conn.execute("DELETE FROM messages WHERE thread = ? AND seq <= ?", (thread, through_seq))
                _insert_messages(conn, thread, through_seq - len(rows) + 1, rows)
                new = stats.model_copy(
                    update={
                        "message_count": stats.message_count - count + len(rows),
                        "total_tokens": stats.total_tokens - removed + sum(n for _, n in rows),
                        "version": stats.version + 1,
                    }
                )
                _write_stats(conn, thread, new)
            return new

        return await self._call(run)

    @asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        check_thread(thread)
        owner = uuid.uuid4().hex

        def take(conn: sqlite3.Connection) -> bool:
            with _transaction(conn, "IMMEDIATE"):
                now = self._clock()
                row = conn.execute(
                    "SELECT expires_at FROM compaction_leases WHERE thread = ?", (thread,)
                ).fetchone()
                if row is not None and row[0] > now:
                    return False
                conn.execute(
                    "INSERT OR REPLACE INTO compaction_leases (thread, owner, expires_at) VALUES (?, ?, ?)",
                    (thread, owner, now + self._lease_seconds),
                )
                self._leases.add((thread, owner))
                return True

        def release(conn: sqlite3.Connection) -> None:
            with _transaction(conn, "IMMEDIATE"):
                conn.execute("DELETE FROM compaction_leases WHERE thread = ? AND owner = ?", (thread, owner))
            self._leases.discard((thread, owner))

        if not await self._call(take):
            yield False
            return
        try:
            yield True
        finally:
            with anyio.CancelScope(shield=True):
                if not self._closed:
                    await self._call(release)

    # episodic -------------------------------------------------------------

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        check_thread(thread)
        when = utc(at, "at")
        body = encode_episode(episode)

        def run(conn: sqlite3.Connection) -> int:
            with _transaction(conn, "IMMEDIATE"):
                counters = _read_counters(conn, thread).after(episode, when)
                conn.execute(
                    "INSERT INTO episodes (thread, seq, at, kind, body) VALUES (?, ?, ?, ?, ?)",
                    (thread, counters.last_seq, when.isoformat(), episode.kind, body),
                )
                _write_counters(conn, thread, counters)
            return counters.last_seq

        seq = await self._call(run)
        return EpisodeRecord(thread=thread, seq=seq, at=when, episode=episode)

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        check_thread(thread)
        next_seq = check_from_seq(from_seq)

        def batch(start: int, conn: sqlite3.Connection) -> list[EpisodeRecord]:
            rows = conn.execute(
                "SELECT seq, at, body FROM episodes WHERE thread = ? AND seq >= ? ORDER BY seq LIMIT ?",
                (thread, start, _REPLAY_BATCH),
            ).fetchall()
            return [_episode_record(thread, *row) for row in rows]

        while True:
            records = await self._call(partial(batch, next_seq))
            for record in records:
                yield record
            if len(records) < _REPLAY_BATCH:
                return
            next_seq = records[-1].seq + 1

    async def pressure(
        self,
        thread: str,
        *,
        now: datetime | None = None,
        estimated_context_tokens: int | None = None,
    ) -> EpisodicCompactionPressure:
        check_thread(thread)
        when = utc(now, "now")
        counters = await self._read(partial(_read_counters, thread=thread))
        return counters.pressure(when, estimated_context_tokens)

    async def latest_checkpoint(self, thread: str) -> EpisodeRecord | None:
        check_thread(thread)

        def run(conn: sqlite3.Connection) -> EpisodeRecord | None:
            row = _one(
                conn,
                """SELECT e.seq, e.at, e.body FROM episode_threads AS t
                JOIN episodes AS e ON e.thread = t.thread AND e.seq = t.boundary_seq
                WHERE t.thread = ?""",
                (thread,),
            )
            return None if row is None else _episode_record(thread, *row)

        return await self._call(run)
