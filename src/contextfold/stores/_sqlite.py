"""``SQLiteStore``: both stores in one SQLite file, the embedded default.

Every write is one short transaction on the store's writing connection, run in
the store's own worker thread (one per store, named ``contextfold-sqlite
<path>``), one call at a time in the order they were made, so the event loop
never waits on the disk or on another process's write lock. On asyncio a call
is handed to that thread through a ``queue.SimpleQueue`` and its result comes
back with ``loop.call_soon_threadsafe``: two cheap hops instead of a trip
through a thread pool. On trio the result comes back through the run's token
(``TrioToken.run_sync_soon``), so no pool thread is held while a call waits
its turn. Either way cancellation works as
``anyio.to_thread.run_sync``'s (never abandoning the thread): a caller
cancelled while its call runs waits, shielded, for the call to end, gets its
result, and its cancelled scope raises at its next checkpoint; a call whose
caller was cancelled before it started is skipped, so nothing runs on the
connection for a caller that already returned.

Several event loops, in several threads, may use one store at once (a sync
framework runs each call in a loop of its own in the caller's thread: two
requests served at once are two loops). Nothing the store waits on belongs to
a loop: each call's result goes back to the loop that made it (above), the
worker thread starts under a ``threading.Lock`` (one per store, whichever loop
calls first), the reads take turns on their connection under another, taken
in the thread that reads, and a call that reaches the worker after another
loop closed the store raises ``StoreClosedError``.

The file is in WAL mode, so readers do not block the writer, and several
processes may open it at once: ``BEGIN IMMEDIATE`` serializes their writes and
``busy_timeout`` makes them queue instead of failing. Reads that decode rows
(``load``, ``tail``, ``replay``, ``threads``, ...) go through a second,
read-only connection in a worker thread, so they never queue behind the
store's own write waiting for another process.

The per-step point reads (``state``, ``stats``, ``pressure``: one indexed
SELECT of one row) run on the event loop itself, through a third connection
(read-only at ``FULL``) with ``PRAGMA busy_timeout = 0``. That is safe because in WAL mode
a reader takes no lock a writer holds: it reads the last committed snapshot
from the database file and the WAL, whatever other connections or processes
are writing. The only times a WAL reader must wait (another process
rebuilding the WAL index after a crash, a checkpoint resetting the WAL, a
file not yet in WAL mode) SQLite answers ``SQLITE_BUSY`` or
``SQLITE_LOCKED``, and with a busy timeout of 0 it answers at once instead of
sleeping. On that answer, or any other SQLite error, or before the
connections are open, the read is done again the ordinary way in a worker
thread, which waits for up to ``busy_timeout`` and reports any error. So the
loop spends on such a read what SQLite spends on one cached B-tree lookup,
tens of microseconds, and never sleeps there. The on-loop connection is only
ever used from the one thread that used it first; from any other thread a
read takes the worker-thread path.

At ``synchronous="NORMAL"`` no commit syncs the disk (only checkpoints do), so
a step's own small writes (``append``, ``record``, ``record_and_append`` of at
most 64 KiB, a compaction lease's one-row statements, and a ``fold`` or
``replace_prefix`` that removes at most ``_SWAP_ON_LOOP_ROWS`` rows; one that
finds more rolls back before it writes and is made in the worker thread) are
made on that on-loop connection too, which also writes: the
hop to the worker thread and back cost more than the transaction itself
(about 150 µs against 100-130 µs here), and the point read that follows finds the
connection's page cache still valid. Such a write runs only when the worker
thread has no call of this store waiting or running, so writes keep the order
they were made in; with
``busy_timeout = 0`` a write lock held by another process answers busy at
once, and then, as on any SQLite error (the transaction rolled back), the
write is made the ordinary way in the worker thread. At ``FULL`` every write
goes to the worker thread.

No commit copies the WAL back into the database file. SQLite's automatic
checkpoint does that inside the commit that makes the WAL reach a thousand
pages, with an fsync at ``synchronous`` NORMAL or FULL, so one write in a few
hundred took milliseconds (once in a while half a second). The writing
connection turns it off (``wal_autocheckpoint = 0``) and the worker thread
checkpoints after every ``_CHECKPOINT_EVERY`` calls (writes on the loop count,
and hand the thread an empty call when one is due), once it has handed the
last call's result back and no other call is waiting: the step that made it
due does not wait for it, and an agent's next write usually finds it done
(the model call between two steps is longer). A store that never runs idle
checkpoints anyway after four times as many calls, so the WAL stays bounded.
At ``synchronous="NORMAL"`` the writes the event loop makes itself go on
beside the checkpoint's copy and syncs (and beside the empty call that starts
it). If they wrote meanwhile, what they added stays in the WAL for the next
checkpoint, and the WAL cannot start over; once such checkpoints have left
``_SECOND_PASS_AFTER`` intervals' calls uncopied, a second pass copies the rest
with them waiting (a few calls' pages, not a hundred), so that the whole WAL is
copied and the next write starts it over.

The schema version lives in ``PRAGMA user_version`` and is migrated on open.
A message recorded by its own episode has its text stored once, in the
episode: the context's row holds the length of the message's JSON, which is
the episode's body but its last character, and reads join the two.
The episode table is append-only in the database itself: triggers reject
UPDATE, DELETE and a replacing INSERT, whoever issues them. The one DELETE
they let through is ``forget``'s: it opens a row in ``forgetting`` for the
thread, deletes, and removes the row again, all in one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, cast

import anyio
from anyio import to_thread

from .._episodes import (
    Episode,
    EpisodeRecord,
    LlmCallEpisode,
    SummaryCheckpoint,
    SystemMessageEpisode,
    ToolCallEpisode,
    ToolResultEpisode,
    UserMessageEpisode,
)
from .._errors import ConfigError, StoreClosedError, StoreError
from .._messages import Message
from .._pacing import Pacer, current_async_library, wake
from .._policy import EpisodicCompactionPressure
from .._resource import AsyncResource
from ._base import ContextWindow, StoredMessage, ThreadInfo, ThreadState, ThreadStats, Tombstone
from ._rows import (
    INT64_MAX,
    PressureCounters,
    Recording,
    Window,
    begin_write,
    by_activity,
    check_after_seq,
    check_checkpoint,
    check_choice,
    check_from_seq,
    check_max_tokens,
    check_path,
    check_replace,
    check_seconds,
    check_thread,
    check_total,
    counted_write,
    decode_episode,
    edit_links,
    encode_edit,
    encode_episode,
    encode_messages,
    encode_recording,
    encode_rows,
    end_write,
    fold_links,
    forgot,
    heavy_batch,
    missing_seq_conflict,
    stored_message,
    summary_index,
    tail_from,
    trusted,
    until_forgotten,
    utc,
    version_conflict,
)

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

SCHEMA_VERSION = 4
"""The schema this code writes; ``PRAGMA user_version`` of every file it opened."""

_T = TypeVar("_T")
_E = TypeVar("_E")

_logger = logging.getLogger("contextfold")

_REPLAY_BATCH = 256

_TOMBSTONES_QUERY = "SELECT count(*) FROM tombstones WHERE thread = :thread"

_REPLAY_QUERY = f"""SELECT seq, at, body, ({_TOMBSTONES_QUERY}) FROM episodes
WHERE thread = :thread AND seq >= :start ORDER BY seq LIMIT :limit"""
"""A batch of a replay, each row with the thread's tombstones as the batch read them (see ``replay``)."""

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
    2: (
        "ALTER TABLE messages ADD COLUMN episode_seq INTEGER",
        """CREATE TABLE tombstones (
            thread TEXT NOT NULL,
            forgotten_at TEXT NOT NULL,
            messages INTEGER NOT NULL,
            episodes INTEGER NOT NULL
        )""",
        "CREATE INDEX tombstones_by_thread ON tombstones (thread)",
        # Holds a thread only inside forget()'s transaction: the one DELETE the log allows.
        "CREATE TABLE forgetting (thread TEXT PRIMARY KEY) WITHOUT ROWID",
        "DROP TRIGGER episodes_no_delete",
        """CREATE TRIGGER episodes_no_delete BEFORE DELETE ON episodes
        WHEN NOT EXISTS (SELECT 1 FROM forgetting WHERE thread = OLD.thread)
        BEGIN SELECT RAISE(ABORT, 'contextfold episodes are append-only: DELETE is not allowed'); END""",
    ),
    # A message recorded by its own episode keeps its text there alone: the row holds the
    # length of its JSON (the end of the episode's body), not a second copy. Rows of small
    # values are what WITHOUT ROWID suits, and a step then writes one page of them, not two.
    3: (
        """CREATE TABLE messages_v3 (
            thread TEXT NOT NULL,
            seq INTEGER NOT NULL,
            tokens INTEGER NOT NULL,
            body TEXT,
            episode_seq INTEGER,
            body_chars INTEGER,
            PRIMARY KEY (thread, seq),
            CHECK (body IS NOT NULL OR (episode_seq IS NOT NULL AND body_chars IS NOT NULL))
        ) WITHOUT ROWID""",
        """INSERT INTO messages_v3 (thread, seq, tokens, body, episode_seq)
        SELECT thread, seq, tokens, body, episode_seq FROM messages""",
        "DROP TABLE messages",
        "ALTER TABLE messages_v3 RENAME TO messages",
    ),
    # A thread's context stats and its log's counters share one row, so a recorded step
    # updates one row (in one statement) and dirties one page for both, not two.
    4: (
        """CREATE TABLE threads_v4 (
            thread TEXT PRIMARY KEY,
            message_count INTEGER NOT NULL DEFAULT 0,
            total_tokens INTEGER NOT NULL DEFAULT 0,
            version INTEGER NOT NULL DEFAULT 0,
            last_seq INTEGER NOT NULL DEFAULT 0,
            last_episode_seq INTEGER NOT NULL DEFAULT 0,
            total_user_messages INTEGER NOT NULL DEFAULT 0,
            user_messages_since_boundary INTEGER NOT NULL DEFAULT 0,
            run_completed_since_boundary INTEGER NOT NULL DEFAULT 0,
            user_messages_after_latest_run_completed INTEGER NOT NULL DEFAULT 0,
            boundary_seq INTEGER,
            first_at TEXT
        ) WITHOUT ROWID""",
        """INSERT INTO threads_v4 SELECT k.thread, coalesce(t.message_count, 0),
            coalesce(t.total_tokens, 0), coalesce(t.version, 0), coalesce(t.last_seq, 0),
            coalesce(c.last_seq, 0), coalesce(c.total_user_messages, 0),
            coalesce(c.user_messages_since_boundary, 0), coalesce(c.run_completed_since_boundary, 0),
            coalesce(c.user_messages_after_latest_run_completed, 0), c.boundary_seq, c.first_at
        FROM (SELECT thread FROM threads UNION SELECT thread FROM episode_threads) AS k
        LEFT JOIN threads AS t ON t.thread = k.thread
        LEFT JOIN episode_threads AS c ON c.thread = k.thread""",
        "DROP TABLE threads",
        "DROP TABLE episode_threads",
        "ALTER TABLE threads_v4 RENAME TO threads",
    ),
}

_MAX_BUSY_TIMEOUT = 2_000_000.0
"""Seconds; SQLite takes the timeout as a C int of milliseconds."""

_MAX_LEASE = 366 * 86_400.0

_CLOSE_GRACE = 5.0
"""Seconds ``aclose`` waits beyond ``busy_timeout`` for a call in progress to end."""

_LOCKED = frozenset({"database is locked", "database table is locked", "database is busy"})
"""SQLite's errors for a lock it waited ``busy_timeout`` for and could not get."""

_CHECKPOINT_EVERY = 100
"""Calls between two checkpoints of the WAL: about SQLite's default of 1000 pages."""

_SECOND_PASS_AFTER = 10
"""Checkpoint intervals (of ``_CHECKPOINT_EVERY`` calls) whose checkpoints the loop's writes beside
them may keep from copying the whole WAL before one copies the rest with the writes waiting: a busy
thread's WAL holds about this many intervals' calls at most, and a write waits for a checkpoint
this many times less often. A held pass costs the waiting write the checkpoint's two syncs (about
1.5 ms here, whatever it copies); at 3, a 5,000-step session that never paused waited 17 times,
4% of its time on SQLite, for a WAL of at most about 6 MB. At 10 it waits 4-5 times, and its WAL
reaches about 19 MB (four or five pages a step) before it starts over. An agent that waits for a
model between steps gives every checkpoint the pause it needs, and never waits."""

_WRITE_ON_LOOP_BYTES = 64 * 1024
"""The largest write (encoded bytes) ``synchronous="NORMAL"`` makes on the event loop."""

_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
"""The database's clock in Unix seconds (millisecond precision): every handle measures leases by it."""

_COUNTERS = (
    "last_episode_seq, total_user_messages, user_messages_since_boundary, run_completed_since_boundary, "
    "user_messages_after_latest_run_completed, boundary_seq, first_at"
)


class _transaction:
    """One transaction: committed when the block ends, rolled back if it raises.

    A class rather than a generator: every step's write opens one, and this
    costs a third of what ``contextlib.contextmanager``'s machinery does.
    """

    __slots__ = ("_begin", "_conn")

    def __init__(self, conn: sqlite3.Connection, mode: Literal["DEFERRED", "IMMEDIATE"]) -> None:
        self._conn = conn
        self._begin = _BEGIN[mode]

    def __enter__(self) -> None:
        self._conn.execute(self._begin)

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self._conn.execute("COMMIT" if kind is None else "ROLLBACK")


_BEGIN = {"DEFERRED": "BEGIN DEFERRED", "IMMEDIATE": "BEGIN IMMEDIATE"}


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


_STATS_QUERY = "SELECT message_count, total_tokens, version, last_seq FROM threads WHERE thread = ?"


def _read_stats(conn: sqlite3.Connection, thread: str) -> ThreadStats:
    return _stats(thread, _one(conn, _STATS_QUERY, (thread,)))


def _stats(thread: str, row: tuple[Any, ...] | None) -> ThreadStats:
    if row is None or row[0] is None:
        return ThreadStats()
    if not (type(row[0]) is type(row[1]) is type(row[2]) is type(row[3]) is int):
        _whole_numbers(thread, "the threads row", row)  # what ThreadStats holds: built unvalidated
    return trusted(ThreadStats, message_count=row[0], total_tokens=row[1], version=row[2], last_seq=row[3])


def _write_stats(conn: sqlite3.Connection, thread: str, stats: ThreadStats) -> None:
    conn.execute(
        """INSERT INTO threads (thread, message_count, total_tokens, version, last_seq)
        VALUES (?, ?, ?, ?, ?)
        ON CONFLICT (thread) DO UPDATE SET message_count = excluded.message_count,
            total_tokens = excluded.total_tokens, version = excluded.version, last_seq = excluded.last_seq""",
        (thread, stats.message_count, stats.total_tokens, stats.version, stats.last_seq),
    )


_INSERT_EPISODE = "INSERT INTO episodes (thread, seq, at, kind, body) VALUES (?, ?, ?, ?, ?)"

_INSERT_MESSAGE = (
    "INSERT INTO messages (thread, seq, tokens, body, episode_seq, body_chars) VALUES (?, ?, ?, ?, ?, ?)"
)


def _insert_messages(
    conn: sqlite3.Connection,
    thread: str,
    first_seq: int,
    rows: list[tuple[str, int]],
    episode_seqs: Sequence[int | None] = (),
    shared: Sequence[bool] = (),
) -> None:
    """Insert the rows from ``first_seq`` on; a ``shared`` row's JSON is read from its episode's body.

    Such a row (what ``Compactor.append`` writes for every message) stores no
    body of its own, only its length: its JSON is its episode's body but the
    last character (see ``_BODY``), so the text is written once, not twice.
    """
    links = list(episode_seqs) or [None] * len(rows)
    flags = list(shared) or [False] * len(rows)
    _insert(
        conn,
        _INSERT_MESSAGE,
        [
            (thread, first_seq + n, count, None, link, len(body))
            if share
            else (thread, first_seq + n, count, body, link, None)
            for n, ((body, count), link, share) in enumerate(zip(rows, links, flags, strict=True))
        ],
    )


def _insert(conn: sqlite3.Connection, statement: str, rows: list[tuple[object, ...]]) -> None:
    """``executemany``, or ``execute`` for the one row a step usually inserts (a little cheaper)."""
    if len(rows) == 1:
        conn.execute(statement, rows[0])
    else:
        conn.executemany(statement, rows)


_BODY = "coalesce(m.body, substr(e.body, -1 - m.body_chars, m.body_chars))"
"""A message row's JSON: its own body, or the end of its episode's body (all but the last character)."""

_WITH_EPISODES = (
    "FROM messages AS m LEFT JOIN episodes AS e "
    "ON m.body IS NULL AND e.thread = m.thread AND e.seq = m.episode_seq"
)
"""The message rows, each beside the episode that holds its JSON when the row holds none."""


def _parse_time(thread: str, what: str, text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"thread {thread!r}: {what} has an unreadable time {text!r}") from exc


_COUNTERS_QUERY = f"SELECT {_COUNTERS} FROM threads WHERE thread = ?"


def _read_counters(conn: sqlite3.Connection, thread: str) -> PressureCounters:
    return _counters(thread, _one(conn, _COUNTERS_QUERY, (thread,)))


_COUNTERS_ROW = "the threads row's episode counters"
"""How an error names the log's counters: the columns of the threads row from ``last_episode_seq`` on."""


def _counters(thread: str, row: tuple[Any, ...] | None) -> PressureCounters:
    if row is None or row[0] is None:
        return PressureCounters()
    first_at = None if row[6] is None else _parse_time(thread, "the first episode", row[6])
    last_seq, total, since, runs, after, boundary_seq = row[:6]
    _whole_numbers(thread, _COUNTERS_ROW, row[:5] if boundary_seq is None else row[:6])
    return PressureCounters(
        last_seq=last_seq,
        total_user_messages=total,
        user_messages_since_boundary=since,
        run_completed_since_boundary=runs,
        user_messages_after_latest_run_completed=after,
        boundary_seq=boundary_seq,
        first_at=first_at,
    )


_SET_COUNTERS = ", ".join(f"{name} = excluded.{name}" for name in _COUNTERS.split(", "))


def _write_counters(conn: sqlite3.Connection, thread: str, counters: PressureCounters) -> None:
    conn.execute(
        f"""INSERT INTO threads (thread, {_COUNTERS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)
        ON CONFLICT (thread) DO UPDATE SET {_SET_COUNTERS}""",
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


def _record_rows(
    conn: sqlite3.Connection, thread: str, episodes: Sequence[Episode], bodies: list[str], when: datetime
) -> list[int]:
    """Insert episodes after the thread's newest and update its counters; return their seqs."""
    last_seq = _count_messages_recorded(conn, thread, episodes)
    if last_seq is not None:
        seqs = _seqs_through(last_seq, len(episodes))
    else:
        counters = _read_counters(conn, thread)
        seqs = []
        for episode in episodes:
            counters = counters.after(episode, when)
            seqs.append(counters.last_seq)
        if seqs:
            _write_counters(conn, thread, counters)
    _insert_episodes(conn, thread, seqs, episodes, bodies, when)
    return seqs


def _seqs_through(last_seq: int, n: int) -> list[int]:
    """The seqs of the ``n`` episodes that end at ``last_seq``."""
    return list(range(last_seq - n + 1, last_seq + 1))


def _insert_episodes(
    conn: sqlite3.Connection,
    thread: str,
    seqs: Sequence[int],
    episodes: Sequence[Episode],
    bodies: list[str],
    when: datetime,
) -> None:
    at = when.isoformat()
    _insert(
        conn,
        _INSERT_EPISODE,
        [
            (thread, seq, at, episode.kind, body)
            for seq, episode, body in zip(seqs, episodes, bodies, strict=True)
        ],
    )


def _record_step(
    conn: sqlite3.Connection,
    thread: str,
    episodes: Sequence[Episode],
    bodies: list[str],
    when: datetime,
    rows: list[tuple[str, int]],
    links: Sequence[int | None],
    shared: Sequence[bool],
    ends: _Ends,
) -> _Written:
    """Record the episodes and append the rows linked to them (see ``_Written``).

    A step of message episodes on a sound threads row updates its counters and
    its stats in one statement (see ``_count_step`` for ``ends``); anything
    else goes the long way, by the parts, and does not tell the row it left.
    """
    counted = _count_step(conn, thread, episodes, len(rows), sum([count for _, count in rows]), ends)
    if counted is None:
        seqs = _record_rows(conn, thread, episodes, bodies, when)
        linked = [None if link is None else seqs[link] for link in links]
        first = _append_rows(conn, thread, rows, linked, shared)
        end = _one(conn, _END_QUERY, (thread,)) if seqs and rows else None  # the row is sound now
        if end is None or not all(type(value) is int for value in end):
            ends.pop(thread, None)  # the next step reads the row back (RETURNING)
            return first, linked, None
        return first, linked, _left_at(ends, thread, (end[0], end[1], end[2], end[3], end[4]))
    last_episode, last_row = counted[:2]
    seqs = _seqs_through(last_episode, len(episodes))
    _insert_episodes(conn, thread, seqs, episodes, bodies, when)
    linked = [None if link is None else seqs[link] for link in links]
    first = last_row - len(rows) + 1
    _insert_messages(conn, thread, first, rows, linked, shared)
    return first, linked, counted


def _record_own_messages(
    conn: sqlite3.Connection,
    thread: str,
    recording: Recording,
    at: str,
    ends: _Ends,
) -> _Written | None:
    """A step of messages each recorded by its own episode, in three statements; ``None`` if not that step.

    What ``Compactor.append`` records (see ``record_messages``): episode ``i``
    records row ``i`` and holds its JSON, so the row stores only its length.
    ``None``, with nothing written, for any other shape of step, an episode
    not of a step's own types (``_STEP_EPISODES``, a subclass included),
    or a threads row missing or unsound (``_record_step`` then goes the long
    way); else the first row's seq and each row's episode seq, as
    ``_record_step`` returns them.
    """
    episodes, bodies, rows, links, shared, _ = recording
    n = len(rows)
    if len(episodes) != n or links != list(range(n)) or not all(shared):
        return None
    if n == 1:  # the common step, without the loops
        ((body, count, _),) = rows
        counted = _count_step(conn, thread, episodes, 1, count, ends)
        if counted is None:
            return None
        episode_seq, seq = counted[:2]
        conn.execute(_INSERT_EPISODE, (thread, episode_seq, at, episodes[0].kind, bodies[0]))
        conn.execute(_INSERT_MESSAGE, (thread, seq, count, None, episode_seq, len(body)))
        return seq, [episode_seq], counted
    counted = _count_step(conn, thread, episodes, n, sum([count for _, count, _ in rows]), ends)
    if counted is None:
        return None
    last_episode, last_row = counted[:2]
    first_episode, first_row = last_episode - n + 1, last_row - n + 1
    _insert(
        conn,
        _INSERT_EPISODE,
        [
            (thread, first_episode + i, at, episode.kind, body)
            for i, (episode, body) in enumerate(zip(episodes, bodies, strict=True))
        ],
    )
    _insert(
        conn,
        _INSERT_MESSAGE,
        [
            (thread, first_row + i, count, None, first_episode + i, len(body))
            for i, (body, count, _) in enumerate(rows)
        ],
    )
    return first_row, list(range(first_episode, last_episode + 1)), counted


_COUNTERS_SOUND = """typeof(last_episode_seq) = 'integer' AND typeof(total_user_messages) = 'integer'
    AND typeof(user_messages_since_boundary) = 'integer' AND typeof(run_completed_since_boundary) = 'integer'
    AND typeof(user_messages_after_latest_run_completed) = 'integer'
    AND (boundary_seq IS NULL OR typeof(boundary_seq) = 'integer') AND typeof(first_at) = 'text'"""
"""The log's counters hold numbers (and the first episode's time: some episode was recorded)."""

_ADD_MESSAGE_EPISODES = """last_episode_seq = last_episode_seq + ?,
    total_user_messages = total_user_messages + ?,
    user_messages_since_boundary = user_messages_since_boundary + ?,
    user_messages_after_latest_run_completed = user_messages_after_latest_run_completed + ?"""

_EPISODES_IN_RANGE = """last_episode_seq <= ? AND total_user_messages <= ?
    AND user_messages_since_boundary <= ? AND user_messages_after_latest_run_completed <= ?"""

_STATS_SOUND = """typeof(message_count) = 'integer' AND typeof(total_tokens) = 'integer'
    AND typeof(version) = 'integer' AND typeof(last_seq) = 'integer'"""

_ADD_ROWS = "message_count = message_count + ?, total_tokens = total_tokens + ?, last_seq = last_seq + ?"

_ROWS_IN_RANGE = "message_count <= ? AND total_tokens <= ? AND last_seq <= ?"

_COUNT_MESSAGES = f"""UPDATE threads SET {_ADD_MESSAGE_EPISODES}
WHERE thread = ? AND {_COUNTERS_SOUND} AND {_EPISODES_IN_RANGE}
RETURNING last_episode_seq"""
"""The counters' update for message episodes in one statement, when the row is sound and stays in range."""

_COUNT_ROWS = f"""UPDATE threads SET {_ADD_ROWS}
WHERE thread = ? AND {_STATS_SOUND} AND {_ROWS_IN_RANGE}
RETURNING last_seq"""
"""The stats' update for appended rows in one statement, when the row is sound and stays in range."""

_STEP_UPDATE = f"UPDATE threads SET {_ADD_MESSAGE_EPISODES}, {_ADD_ROWS} WHERE thread = ?"
_STEP_ROW_FITS = f"{_COUNTERS_SOUND} AND {_STATS_SOUND} AND {_EPISODES_IN_RANGE} AND {_ROWS_IN_RANGE}"

_COUNT_STEP = f"""{_STEP_UPDATE} AND {_STEP_ROW_FITS}
RETURNING last_episode_seq, last_seq, version, message_count, total_tokens"""
"""Both updates of a recorded step in one statement: ``_COUNT_MESSAGES`` and ``_COUNT_ROWS`` at once."""

_COUNT_STEP_FROM = f"""{_STEP_UPDATE} AND last_episode_seq = ? AND last_seq = ?
    AND version = ? AND message_count = ? AND total_tokens = ? AND {_STEP_ROW_FITS}"""
"""``_COUNT_STEP`` on a row that holds the given values: the new ones are those plus the step's.

Without ``RETURNING``, which SQLite runs as a trigger filling a temporary
table: about 40% of the statement's cost (7.7 µs against 4.4 in a tight loop).
"""

_End = tuple[int, int, int, int, int]
"""A threads row as a step left it: ``last_episode_seq``, ``last_seq``, ``version``, ``message_count``
and ``total_tokens``."""

_Ends = dict[str, _End]
"""Per thread, the row a store's last step left (see ``_count_step``)."""

_Written = tuple[int, list[int | None], _End | None]
"""What a step's write returns: the first row's seq, each row's episode seq, and the threads
row as the transaction left it (``None`` when the write did not learn it; see ``_count_step``)."""

_END_QUERY = (
    "SELECT last_episode_seq, last_seq, version, message_count, total_tokens FROM threads WHERE thread = ?"
)

_ENDS_KEPT = 1_024
"""The threads whose last written rows a store keeps (see ``_count_step``); past that it starts over."""

_STEP_EPISODES = frozenset(
    {UserMessageEpisode, SystemMessageEpisode, ToolResultEpisode, LlmCallEpisode, ToolCallEpisode}
)
"""The episodes of a step: its messages, and the tool calls that ran between its reply and their results."""


def _message_episodes(episodes: Sequence[Episode]) -> tuple[int, int] | None:
    """How many episodes and user messages a step's episodes add; ``None`` for any other batch.

    A step's episodes only add: to the seq, and a user message to the three
    user-message counts; the boundary, the runs and the first time stay (see
    ``PressureCounters.after``).
    """
    users = 0
    for episode in episodes:
        kind = type(episode)
        if kind not in _STEP_EPISODES:
            return None
        users += kind is UserMessageEpisode
    return (len(episodes), users) if episodes else None


def _count_messages_recorded(
    conn: sqlite3.Connection, thread: str, episodes: Sequence[Episode]
) -> int | None:
    """The counters' update for a batch of a step's episodes, in one statement: the new ``last_seq``.

    ``None`` (nothing written) unless every episode is a step's (see ``_STEP_EPISODES``) and the
    thread's counters hold sound numbers that stay under the limit: the caller
    then reads the row, reports what is wrong with it, or creates it.
    """
    adds = _message_episodes(episodes)
    if adds is None:
        return None
    n, users = adds
    row = _one(conn, _COUNT_MESSAGES, (n, users, users, users, thread, *_episode_limits(n, users)))
    return None if row is None else int(row[0])


def _episode_limits(n: int, users: int) -> tuple[int, int, int, int]:
    return INT64_MAX - n, INT64_MAX - users, INT64_MAX - users, INT64_MAX - users


def _row_limits(n: int, tokens: int) -> tuple[int, int, int]:
    return INT64_MAX - n, INT64_MAX - tokens, INT64_MAX - n


def _count_step(
    conn: sqlite3.Connection,
    thread: str,
    episodes: Sequence[Episode],
    m: int,
    tokens: int,
    ends: _Ends,
) -> _End | None:
    """``_COUNT_STEP`` for ``m`` rows of ``tokens``: the threads row as the step leaves it (an ``_End``).

    ``None``, with nothing written, unless every episode is a step's (by exact
    type, see ``_STEP_EPISODES``), and the threads row is sound and stays in range.
    ``ends`` holds the row this store's last step left on each thread: a row
    that still holds it takes ``_COUNT_STEP_FROM``, which needs no
    ``RETURNING``. The row itself says whether it does (another writer, a
    fold or a record changed it, or the step rolled back), so a stale entry
    costs one statement that changes nothing, never a wrong value. Either way
    the result is the row as this transaction wrote it: what a read right
    after the commit would return, unless another writer came in between.
    """
    adds = _message_episodes(episodes)
    if adds is None or not m or tokens > INT64_MAX:
        return None
    n, users = adds
    # _episode_limits and _row_limits, written out: this runs on every step.
    most_rows, most_users = INT64_MAX - m, INT64_MAX - users
    limits = (INT64_MAX - n, most_users, most_users, most_users, most_rows, INT64_MAX - tokens, most_rows)
    known = ends.get(thread)
    if known is not None:
        episode_seq, seq, version, count, total = known
        params = (n, users, users, users, m, tokens, m, thread, *known, *limits)
        if conn.execute(_COUNT_STEP_FROM, params).rowcount == 1:
            return _left_at(ends, thread, (episode_seq + n, seq + m, version, count + m, total + tokens))
    row = _one(conn, _COUNT_STEP, (n, users, users, users, m, tokens, m, thread, *limits))
    if row is None:
        return None
    return _left_at(ends, thread, (int(row[0]), int(row[1]), int(row[2]), int(row[3]), int(row[4])))


def _left_at(ends: _Ends, thread: str, end: _End) -> _End:
    """Note in ``ends`` that a step left ``thread``'s row as ``end``, and return it."""
    if thread not in ends and len(ends) >= _ENDS_KEPT:
        ends.clear()
    ends[thread] = end
    return end


def _append_rows(
    conn: sqlite3.Connection,
    thread: str,
    rows: list[tuple[str, int]],
    links: Sequence[int | None] = (),
    shared: Sequence[bool] = (),
) -> int:
    """Append message rows after the thread's newest and update its stats; return the first seq."""
    tokens = sum(count for _, count in rows)
    n = len(rows)
    counted = (
        _one(conn, _COUNT_ROWS, (n, tokens, n, thread, *_row_limits(n, tokens)))
        if tokens <= INT64_MAX  # else no SQLite integer holds the sum: the check below says so
        else None
    )
    if counted is not None:
        first = int(counted[0]) - n + 1
    else:  # a new thread, or a row to report: read it
        stats = _read_stats(conn, thread)
        total = check_total(thread, stats.total_tokens + tokens)
        first = stats.last_seq + 1
        _write_stats(
            conn,
            thread,
            stats.model_copy(
                update={
                    "message_count": stats.message_count + n,
                    "total_tokens": total,
                    "last_seq": stats.last_seq + n,
                }
            ),
        )
    _insert_messages(conn, thread, first, rows, links, shared)
    return first


class _TooLargeForTheLoop(Exception):
    """A swap that found more rows to remove than the event loop may: rolled back, made in the thread."""


_Replaced = list[tuple[int, int | None]]
"""``(seq, episode_seq)`` of replaced rows, oldest first."""

_Linker = Callable[[int, _Replaced, _Replaced], list[int | None]]
"""The replacement's episode links, from the count and the oldest and newest replaced rows."""


def _swap(
    conn: sqlite3.Connection,
    thread: str,
    through_seq: int,
    expected_version: int,
    rows: list[tuple[str, int]],
    linker: _Linker | None,
    most: int | None = None,
) -> ThreadStats:
    """The guarded prefix swap; ``linker`` runs once the guard held (a fold records there).

    Without a ``linker`` the replacement links no episode. With ``most``, a swap
    that would remove more rows raises ``_TooLargeForTheLoop`` before it writes
    anything.
    """
    stats = _read_stats(conn, thread)
    if stats.version != expected_version:
        raise version_conflict(thread, stats.version, expected_version)
    if most is not None:  # counted no further than the bound, so a long thread costs the loop nothing
        (found,) = conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM messages WHERE thread = ? AND seq <= ? LIMIT ?)",
            (thread, through_seq, most + 1),
        ).fetchone()
        if found > most:
            raise _TooLargeForTheLoop  # the swap in the thread looks for the missing seq too
    # The newest row removed is through_seq's if that row exists: no lookup of its own.
    count, removed, newest = conn.execute(
        "SELECT count(*), coalesce(sum(tokens), 0), max(seq) FROM messages WHERE thread = ? AND seq <= ?",
        (thread, through_seq),
    ).fetchone()
    if newest != through_seq:
        raise missing_seq_conflict(thread, through_seq)
    total = check_total(thread, stats.total_tokens - removed + sum(n for _, n in rows))
    links: list[int | None] = [None] * len(rows)
    if linker is not None:
        ends = min(len(rows), count)
        first, last = (
            conn.execute(
                "SELECT seq, episode_seq FROM messages WHERE thread = ? AND seq <= ? "
                f"ORDER BY seq {order} LIMIT ?",
                (thread, through_seq, ends),
            ).fetchall()
            for order in ("ASC", "DESC")
        )
        links = linker(count, first, last[::-1])
    conn.execute("DELETE FROM messages WHERE thread = ? AND seq <= ?", (thread, through_seq))
    _insert_messages(conn, thread, through_seq - len(rows) + 1, rows, links)
    new = trusted(
        ThreadStats,
        message_count=stats.message_count - count + len(rows),
        total_tokens=total,
        version=stats.version + 1,
        last_seq=stats.last_seq,
    )
    _write_stats(conn, thread, new)
    return new


_SWAP_ON_LOOP_ROWS = 1_000
"""Rows a fold or replacement may remove on the event loop (at ``synchronous="NORMAL"``):
about a millisecond of SQLite; one that finds more is rolled back and made in the worker thread."""


def _write_step(
    conn: sqlite3.Connection,
    thread: str,
    recording: Recording,
    when: datetime,
    ends: _Ends,
) -> _Written:
    """A recorded step's one transaction (see ``_Written``)."""
    with _transaction(conn, "IMMEDIATE"):
        own = _record_own_messages(conn, thread, recording, when.isoformat(), ends)
        if own is not None:
            return own
        episodes, bodies, encoded, links, shared, _ = recording
        rows = [(body, count) for body, count, _ in encoded]
        return _record_step(conn, thread, episodes, bodies, when, rows, links, shared, ends)


_Encoded = tuple[str, int, Message]
"""A message's JSON, its token count and the copy its JSON reads back as (see ``encode_rows``)."""


def _stored(
    first: int, rows: list[tuple[str, int, Message]], links: Sequence[int | None]
) -> list[StoredMessage]:
    """The rows as written from ``first`` on, each holding the copy its JSON reads back, not the caller's."""
    if len(rows) == 1:  # the common step, without the loop
        ((_, count, copy),) = rows
        return [trusted(StoredMessage, seq=first, message=copy, tokens=count, episode_seq=links[0])]
    return [
        trusted(StoredMessage, seq=first + n, message=copy, tokens=count, episode_seq=link)
        for n, ((_, count, copy), link) in enumerate(zip(rows, links, strict=True))
    ]


def _tombstone(thread: str, row: tuple[Any, ...]) -> Tombstone:
    return Tombstone(
        thread=thread,
        forgotten_at=_parse_time(thread, "a tombstone", row[0]),
        messages=row[1],
        episodes=row[2],
    )


def _episode_record(thread: str, seq: int, at: str, body: str) -> EpisodeRecord:
    return EpisodeRecord(
        thread=thread,
        seq=seq,
        at=_parse_time(thread, f"episode seq {seq}", at),
        episode=decode_episode(thread, seq, body),
    )


_STATE_QUERY = (
    f"SELECT message_count, total_tokens, version, last_seq, {_COUNTERS} FROM threads WHERE thread = ?"
)


def _state(thread: str, row: tuple[Any, ...] | None) -> tuple[ThreadStats, PressureCounters]:
    if row is None:
        return ThreadStats(), PressureCounters()
    return _stats(thread, row[:4]), _counters(thread, row[4:])


class _Job:
    """One call for a store's worker thread.

    ``claim`` holds a single token: the worker takes it to start the call, a
    cancelled caller takes it to skip a call not yet started. ``list.pop`` is
    atomic, so exactly one of them gets it.
    """

    __slots__ = ("claim", "fn", "notify", "outcome", "upkeep", "waiter")

    def __init__(self, fn: Callable[[], object], *, upkeep: bool = False) -> None:
        self.fn = fn
        self.upkeep = upkeep
        """Posted for the thread's upkeep after it (``_Worker.post``): no caller's call."""
        self.claim = [True]
        self.notify: Callable[[], object] = _nothing
        self.outcome: tuple[bool, Any] | None = None
        self.waiter: asyncio.Future[None] | None = None

    def take(self) -> bool:
        """Take the token: true for the first taker only (the worker to run, or a caller to skip)."""
        try:
            self.claim.pop()
        except IndexError:
            return False
        return True

    def result(self) -> Any:
        assert self.outcome is not None
        done, value = self.outcome
        if done:
            return value
        raise value


def _nothing() -> None:
    pass


def _checkpoint(conn: sqlite3.Connection) -> bool:
    """Copy what no reader still needs from the WAL into the database file, waiting for nobody.

    True if the whole WAL was copied: the next write then starts it over from its beginning.
    """
    busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return not busy and frames == copied


def _notify_loop(loop: asyncio.AbstractEventLoop, job: _Job) -> None:
    """In the worker thread: have ``loop`` wake the caller of ``job``."""
    try:
        loop.call_soon_threadsafe(_wake, job)
    except RuntimeError:
        pass  # the loop was closed: nobody waits for this call any more


def _notify_trio(token: Any, task: Any) -> None:
    """In the worker thread: have the trio run behind ``token`` reschedule the waiting ``task``."""
    import trio

    try:
        token.run_sync_soon(trio.lowlevel.reschedule, task)
    except trio.RunFinishedError:
        pass  # the run ended: nobody waits for this call any more


def _wake(job: _Job) -> None:
    """On the caller's loop: the call ended."""
    if job.waiter is not None:
        wake(job.waiter)


class _Stopped(Exception):
    """A call made to a worker thread after it was told to end (the store was closed meanwhile)."""


class _Worker:
    """The thread that runs a store's calls on its writing connection, in order, one at a time.

    ``after(idle)`` runs in the thread after each call was handed back, with
    whether no other call is waiting.
    """

    def __init__(self, name: str, after: Callable[[bool], None] = lambda idle: None) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._after = after
        # Jobs submitted and not yet through (their upkeep included), and of them the callers'
        # calls not yet handed back (posted upkeep is none): written under the lock.
        self._pending = 0
        self._calls = 0
        self._stopped = False
        self._pending_lock = threading.Lock()
        self.hold = False
        """Set by ``after`` for upkeep that the event loop's own writes must wait for."""
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            if not job.take():  # its caller was cancelled before it started: it never runs
                self._handed_back(job)
                self._done()
                continue
            try:
                job.outcome = (True, job.fn())
            except BaseException as exc:  # handed to the caller, which raises it
                job.outcome = (False, exc)
            # The notifier holds the job (a cycle) and the call holds the step's
            # episodes and rows: dropped here, they are freed by reference counting
            # the moment the caller is done, not left for the garbage collector.
            notify, job.notify, job.fn = job.notify, _nothing, _nothing
            self._handed_back(job)
            notify()
            try:
                self._after(jobs.empty())
            except Exception:  # upkeep only: the thread must go on serving calls
                _logger.exception("%s: upkeep after a call failed", self.thread.name)
            self._done()

    def _handed_back(self, job: _Job) -> None:
        if not job.upkeep:
            with self._pending_lock:
                self._calls -= 1

    def _done(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _submit(self, job: _Job) -> bool:
        """Queue ``job``; false (nothing queued) once ``stop`` was called: the thread would never run it."""
        with self._pending_lock:
            if self._stopped:
                return False
            self._pending += 1
            self._calls += not job.upkeep
            # Under the lock: a job that ``stop`` does not see stopped is queued before its end.
            self._jobs.put(job)
        return True

    @property
    def idle(self) -> bool:
        """No call is waiting or running, nor upkeep (a call submitted now would start at once)."""
        return self._pending == 0

    @property
    def free(self) -> bool:
        """No caller's call is waiting or running: writes may go on beside upkeep that does not hold them.

        Upkeep (posted, or after a call already handed back) orders no write:
        a write made beside it commits as it would have a moment earlier.
        """
        return self._calls == 0 and not self.hold

    def post(self, fn: Callable[[], object]) -> None:
        """Have the thread run ``fn()`` after the calls already submitted, not waiting for it."""
        self._submit(_Job(fn, upkeep=True))

    def stop(self) -> None:
        """End the thread after the calls already submitted; a call submitted later raises ``_Stopped``."""
        with self._pending_lock:
            self._stopped = True
            self._jobs.put(None)

    async def run(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` in the thread, with ``anyio.to_thread.run_sync``'s cancellation (never abandoned)."""
        # A caller already cancelled submits nothing: the thread could start the call
        # before the caller's first checkpoint noticed the cancellation.
        await anyio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn)
        if current_async_library() == "asyncio":
            loop = asyncio.get_running_loop()
            waiter = job.waiter = loop.create_future()
            job.notify = partial(_notify_loop, loop, job)
            if not self._submit(job):
                raise _Stopped
            try:
                await waiter
            except asyncio.CancelledError:
                if job.take():
                    job.notify = job.fn = _nothing
                    raise  # it never runs
                # As anyio.to_thread.run_sync: wait, shielded, and return what the call
                # returned; the cancelled scope raises at the caller's next checkpoint.
                # A plain asyncio cancel (no cancelled anyio scope) is raised at once.
                if await _wait_out(job, loop) or anyio.current_effective_deadline() != -math.inf:
                    raise
        else:  # trio: rescheduled through the run's token, so no pool thread waits for the call
            import trio

            lowlevel = trio.lowlevel
            job.notify = partial(_notify_trio, lowlevel.current_trio_token(), lowlevel.current_task())
            if not self._submit(job):
                raise _Stopped

            def abort(raise_cancel: object) -> trio.lowlevel.Abort:
                if job.take():  # not started: it never runs, and the cancellation is raised now
                    job.notify = job.fn = _nothing
                    return lowlevel.Abort.SUCCEEDED
                # It runs: woken when it ends with its result, the cancellation raised at the
                # caller's next checkpoint (as trio.to_thread.run_sync does).
                return lowlevel.Abort.FAILED

            await lowlevel.wait_task_rescheduled(abort)
        return cast(_T, job.result())


async def _wait_out(job: _Job, loop: asyncio.AbstractEventLoop) -> bool:
    """Wait, shielded, until the worker thread has finished ``job``, which has started.

    True if a plain asyncio cancel (which the shield does not hold back) came meanwhile.
    """
    cancelled = False
    with anyio.CancelScope(shield=True):
        while job.outcome is None:
            # The worker sets the outcome before it schedules _wake, which runs on this
            # loop after this fresh waiter is in place.
            waiter = job.waiter = loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                cancelled = True  # the call still runs: raised once it ended
    return cancelled


class SQLiteStore(AsyncResource):
    """A ``Store`` (both memories) in one SQLite file.

    ``busy_timeout`` is how long, in seconds, a call waits for another
    process's transaction before failing. ``compaction_lock`` is a lease row
    timed by the database's own clock, taken and released in short
    transactions; ``lease_seconds`` (default 300) is how long a lease outlives
    a holder that crashed before another worker may take it. A compaction that
    runs longer may see a second one start, and then the fold's version guard
    lets only one of them apply.

    ``synchronous="FULL"`` (the default) syncs the WAL to disk at every
    commit: a committed write survives a crashed process and a power loss.
    ``"NORMAL"`` syncs only at checkpoints: much faster, still safe against a
    crashed process, but a power loss or OS crash may undo the last commits
    (the file stays consistent; the log and the context still agree). At
    ``"NORMAL"`` a step's small writes commit on the event loop's own
    connection when they can without waiting (see the module's docstring).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 30.0,
        lease_seconds: float = 300.0,
        synchronous: Literal["NORMAL", "FULL"] = "FULL",
    ) -> None:
        text = check_path("path", path)
        if text == ":memory:":
            # Each connection would get a database of its own: the reader would see no tables.
            raise ConfigError(
                "path",
                "is SQLite's in-memory database, which the store's second (reader) connection "
                "cannot see; use MemoryStore() for a store in memory, or a file path such as 'agent.db'",
                value=path,
            )
        self.path = Path(text)
        self._busy_timeout = check_seconds(
            "busy_timeout", busy_timeout, example=30, maximum=_MAX_BUSY_TIMEOUT
        )
        self._lease_seconds = check_seconds("lease_seconds", lease_seconds, example=300, maximum=_MAX_LEASE)
        self._synchronous = check_choice("synchronous", synchronous, ("FULL", "NORMAL"))
        # The worker thread opens, uses and closes the connections; it starts on first use.
        # Several event loops, in several threads, may use one store at once (a sync
        # framework runs each call in a loop of its own): it starts, and ends, under a
        # threading lock, so they share one thread. _closing is the one aclose ended.
        self._worker: _Worker | None = None
        self._worker_lock = threading.Lock()
        self._closing: _Worker | None = None
        self._shut = False  # set by the thread once it closed the connections
        self._conn: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        # The point reads' connection (busy_timeout 0), used on the event loop only,
        # from one thread: the first that used it, kept under key 0.
        self._loop_conn: sqlite3.Connection | None = None
        self._loop_reader: sqlite3.Connection | None = None
        self._loop_thread: dict[int, int] = {}
        # One read at a time on the read-only connection, taken in the worker thread that
        # reads (see _read_in_thread): a threading lock, not an anyio one, which belongs to
        # one event loop and would never wake a waiter of another loop in another thread.
        self._read_lock = threading.Lock()
        # Each event loop's reads also take turns on the loop (anyio's lock, one per OS thread,
        # so one per loop), so a loop's waiting reads hold no worker thread.
        self._read_turns = threading.local()
        self._pace = Pacer()
        self._closed = False
        self._leases: set[tuple[str, str]] = set()
        self._calls_since_checkpoint = 0
        # The loop's writes as a checkpoint sees them (set in the loop's thread).
        self._loop_commits = 0
        self._loop_writing = False
        # Calls since the WAL was last copied whole, when the loop's writes beside the checkpoints
        # since kept them from copying it all (the thread's).
        self._calls_left_over = 0
        self._checkpoint_posted = False  # set by the loop, cleared by the thread
        # Per thread, the threads row this store's last step left (see _count_step).
        self._ends: _Ends = {}

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._call(lambda conn: None)
        return self

    async def aclose(self) -> None:
        """Close the connections, release this store's leases and end its thread; idempotent, never cut short.

        Shielded from cancellation, it waits for the calls already made (at
        most ``busy_timeout`` plus a few seconds for one in progress), then
        closes the connections in the store's thread and waits for that thread
        to end, so a store closed by a cancelled task holds no connection and
        no thread afterwards.
        """
        self._closed = True
        self._loop_reader = None
        with self._worker_lock:
            worker, self._worker = self._worker, None
            if worker is not None:
                self._closing = worker
            closing = self._closing
        if closing is None:
            return
        with anyio.move_on_after(self._busy_timeout + _CLOSE_GRACE, shield=True):
            if worker is not None:  # this call ends it; another one (any loop's) waits for its end
                # The on-loop connection's thread is this one, or none, or busy on it right now.
                me = threading.get_ident()
                owned = self._loop_thread.get(0, me) == me
                try:
                    await worker.run(partial(self._close, loop_conn_idle=owned))
                finally:
                    worker.stop()
            if closing.thread.is_alive():
                await to_thread.run_sync(closing.thread.join)

    def _close(self, *, loop_conn_idle: bool = True) -> None:
        """In the worker thread: close the connections, releasing the leases first.

        Unless ``loop_conn_idle`` (the store was closed by a loop of another
        thread than the on-loop connection's), that connection may be in use in
        its thread at this moment: it is only let go of here, and closes when
        that call lets go of it too (at once when none holds it).
        """
        self._shut = True
        conn, self._conn = self._conn, None
        with self._read_lock:  # once the read in progress, if any, has ended
            reader, self._reader = self._reader, None
        loop_conn, self._loop_conn = self._loop_conn, None
        self._loop_reader = None
        if loop_conn is not None and loop_conn_idle:
            loop_conn.close()
        del loop_conn
        if reader is not None:
            reader.close()
        if conn is None:
            return
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

    def _writer(self) -> sqlite3.Connection:
        """In the worker thread: the writing connection, opening all three on first use."""
        if self._conn is None:
            if self._shut:  # a call another thread's loop made as the store closed: never reopened
                raise self._closed_error()
            conn, reader, loop_conn = self._connect()
            self._conn, self._reader, self._loop_conn = conn, reader, loop_conn
            if not self._closed:
                self._loop_reader = loop_conn
        return self._conn

    def _connect(self) -> tuple[sqlite3.Connection, sqlite3.Connection, sqlite3.Connection]:
        """The writing connection, with the file in WAL mode and migrated, and the two read-only ones."""
        opened: list[sqlite3.Connection] = []
        try:
            conn = self._open(self._busy_timeout)
            opened.append(conn)
            self._enter_wal(conn)
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # done between calls: _after_call
            self._migrate(conn)
            reader = self._open(self._busy_timeout)
            opened.append(reader)
            reader.execute("PRAGMA query_only = ON")
            loop_conn = self._open(0.0)
            opened.append(loop_conn)
            if self._synchronous == "NORMAL":  # it also makes the small writes: see _write_on_loop
                loop_conn.execute("PRAGMA synchronous = NORMAL")
                loop_conn.execute("PRAGMA wal_autocheckpoint = 0")
            else:
                loop_conn.execute("PRAGMA query_only = ON")
        except BaseException:
            for each in opened:
                each.close()
            raise
        return conn, opened[1], opened[2]

    def _enter_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL, retrying: the switch skips the busy handler when another opener races."""
        deadline = time.monotonic() + self._busy_timeout
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _open(self, busy_timeout: float) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        except BaseException:
            conn.close()
            raise
        return conn

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

    def _error(self, exc: sqlite3.Error) -> StoreError:
        text = str(exc)
        if text in _LOCKED:  # the busy timeout ran out: say who to look for, and what to change
            text += (
                f" (another connection held a lock on it for all of busy_timeout={self._busy_timeout:g}"
                " seconds; end that process or its transaction and retry, or wait longer with a larger"
                " busy_timeout)"
            )
        return StoreError(f"SQLite database {str(self.path)!r}: {text}")

    async def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` on the writing connection in the store's thread, after the calls made before."""
        if self._closed:
            raise self._closed_error()
        worker = self._worker
        if worker is None:
            worker = self._start_worker()
        try:
            return await worker.run(lambda: fn(self._writer()))
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        except _Stopped:  # closed (by another thread's loop) since the check above
            raise self._closed_error() from None

    def _start_worker(self) -> _Worker:
        """The store's worker thread, started unless another thread just did; never once it closed."""
        with self._worker_lock:
            if self._closed:
                raise self._closed_error()
            worker = self._worker
            if worker is None:
                worker = self._worker = _Worker(f"contextfold-sqlite {self.path}", self._after_call)
            return worker

    async def _encoded_in_thread(
        self, encode: Callable[[], _E], write: Callable[[sqlite3.Connection, _E], _T]
    ) -> tuple[_E, _T]:
        """``encode()``, then ``write`` of what it made, as one call in the store's thread.

        For a batch that would stall the loop (see ``heavy_batch``). Encoded in
        the call itself rather than in a thread of its own first, the write
        keeps its place among the store's writes: one made after it, while it
        was being encoded, cannot commit first on the loop.
        """

        def run(conn: sqlite3.Connection) -> tuple[_E, _T]:
            encoded = encode()
            return encoded, write(conn, encoded)

        return await self._call(run)

    def _after_call(self, idle: bool) -> None:
        """In the worker thread, after a call was handed back: checkpoint the WAL when it is due."""
        self._calls_since_checkpoint += 1
        calls = self._calls_since_checkpoint
        if calls < _CHECKPOINT_EVERY or (not idle and calls < 4 * _CHECKPOINT_EVERY):
            return
        conn = self._conn
        if conn is None:
            return
        self._calls_since_checkpoint = 0
        try:
            worker = self._worker
            if worker is None or self._loop_writer is None:
                _checkpoint(conn)
            elif self._checkpoint_beside_the_loop(conn):
                self._calls_left_over = 0
            else:
                # Counted in calls, not checkpoints: on a loaded machine a checkpoint can come
                # up to four times later than due, and the WAL stays within the same bound.
                self._calls_left_over += calls
                if self._calls_left_over >= _SECOND_PASS_AFTER * _CHECKPOINT_EVERY:
                    # Started over whatever it copied: what another process's reader keeps in
                    # the WAL no held pass can copy, and the loop's writes would wait for nothing.
                    self._checkpoint_holding_the_loop(conn, worker)
                    self._calls_left_over = 0
        except sqlite3.Error as exc:  # the next one copies what this one did not
            _logger.debug("checkpoint of %s failed, done again later: %s", self.path, exc)

    def _checkpoint_beside_the_loop(self, conn: sqlite3.Connection) -> bool:
        """A checkpoint pass, the loop's writes going on beside it; True if it copied everything.

        The pass copies the frames that were in the WAL when it began. If the
        loop wrote meanwhile, their frames are left for the next checkpoint
        (SQLite starts the WAL over only at a write that finds every frame
        copied); once such checkpoints have left ``_SECOND_PASS_AFTER``
        intervals' calls, a second pass copies them with the loop's writes
        waiting.
        """
        commits = self._loop_commits
        copied_all = _checkpoint(conn)
        # The flag first: a write that lowered it had counted its commit already.
        return copied_all and not self._loop_writing and self._loop_commits == commits

    def _checkpoint_holding_the_loop(self, conn: sqlite3.Connection, worker: _Worker) -> None:
        """A checkpoint pass with the loop's writes held (they go to this thread), so it copies all it may."""
        # Raised before the loop's flag is looked at: a write that checks ``free`` after
        # this sees it, and one that checked before has raised its flag and ends first.
        worker.hold = True
        try:
            deadline = time.monotonic() + 1.0
            while self._loop_writing and time.monotonic() < deadline:
                time.sleep(0.0001)
            _checkpoint(conn)
        finally:
            worker.hold = False

    def _wal_is_behind(self) -> bool:
        """Whether the calls not yet copied back reach the WAL's bound (a thread starved of CPU).

        The loop's writes then go to the thread, after its checkpoint, instead
        of growing the WAL while the thread cannot run.
        """
        behind = self._calls_left_over + self._calls_since_checkpoint
        return behind >= (_SECOND_PASS_AFTER + 1) * _CHECKPOINT_EVERY

    def _posted_checkpoint_starts(self) -> None:
        """In the worker thread: the empty call the loop posted is running, its checkpoint next."""
        self._checkpoint_posted = False

    @property
    def _loop_writer(self) -> sqlite3.Connection | None:
        """The on-loop connection when it also writes (``synchronous="NORMAL"``), else ``None``."""
        return self._loop_reader if self._synchronous == "NORMAL" else None

    def _on_loop_thread(self) -> bool:
        """Whether this is the thread that first used the on-loop connection (no other may)."""
        me = threading.get_ident()
        return self._loop_thread.setdefault(0, me) == me

    async def _swap_write(self, run: Callable[[sqlite3.Connection, int | None], _T], size: int) -> _T:
        """A fold's or replacement's transaction: on the loop if it removes few rows, else in the thread."""

        def bounded(conn: sqlite3.Connection) -> _T:
            return run(conn, _SWAP_ON_LOOP_ROWS)

        def whole(conn: sqlite3.Connection) -> _T:
            return run(conn, None)

        try:
            return await self._write(bounded, size, whole)
        except _TooLargeForTheLoop:  # found on the loop, rolled back: nothing was written
            return await self._call(whole)

    async def _write(
        self,
        fn: Callable[[sqlite3.Connection], _T],
        size: int,
        in_thread: Callable[[sqlite3.Connection], _T] | None = None,
    ) -> _T:
        """``fn`` (one write transaction of ``size`` bytes): on the loop when it can be, else as ``_call``.

        ``in_thread`` is the transaction the worker thread makes instead, when it differs.
        """
        if size <= _WRITE_ON_LOOP_BYTES and self._loop_writer is not None:
            # Paced before the write, so a cancellation cannot fall between the commit and
            # the caller: it stops the write before it begins.
            await self._pace()
            done, result = self._write_on_loop(fn)
            if done:
                return cast(_T, result)
        return await self._call(fn if in_thread is None else in_thread)

    def _write_on_loop(self, fn: Callable[[sqlite3.Connection], _T]) -> tuple[bool, _T | None]:
        """``(True, fn(conn))`` on the busy_timeout-0 connection, or ``(False, None)`` to use the worker.

        Only when no call of this store is waiting or running in its worker
        thread, so the writes keep the order they were made in; the thread's
        upkeep is no call, and they run beside it unless it holds them (a
        checkpoint's second pass, see ``_after_call``). Any SQLite error (the
        write lock held by another process answers busy at once) falls back,
        its transaction rolled back: the worker's write waits as long as it
        may and reports it.
        """
        conn, worker = self._loop_writer, self._worker
        if conn is None or worker is None or not self._on_loop_thread():
            return False, None
        # Raised before the worker is looked at: a checkpoint that holds the loop's writes
        # then sees this one and waits for it (_checkpoint_holding_the_loop).
        self._loop_writing = True
        try:
            if not worker.free or self._wal_is_behind():
                return False, None
            result = fn(conn)
            self._loop_commits += 1
        except sqlite3.Error:
            if conn.in_transaction:  # its ROLLBACK failed too: try once more, else give up the connection
                with contextlib.suppress(sqlite3.Error):
                    conn.rollback()
                if conn.in_transaction:
                    self._loop_reader = None
            return False, None
        finally:
            self._loop_writing = False
        self._calls_since_checkpoint += 1
        if self._calls_since_checkpoint >= _CHECKPOINT_EVERY and not self._checkpoint_posted:
            # The worker checkpoints after it (_after_call). One at a time: the writes go on
            # beside it, and a queue of them would read as a busy thread that defers it.
            self._checkpoint_posted = True
            worker.post(self._posted_checkpoint_starts)
        return True, result

    async def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` on the read-only connection in a worker thread, beside the writes."""
        if self._reader is None:
            await self._call(lambda conn: None)  # opens the file
        turns: anyio.Lock | None = getattr(self._read_turns, "lock", None)
        if turns is None:
            turns = self._read_turns.lock = anyio.Lock()
        async with turns:
            try:
                return await to_thread.run_sync(self._read_in_thread, fn)
            except sqlite3.Error as exc:
                raise self._error(exc) from exc

    def _read_in_thread(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """In a worker thread: ``fn`` on the read-only connection, which serves one read at a time.

        The lock is taken here, in the thread, rather than on the event loop: a
        ``threading.Lock`` serves every loop and thread that uses the store
        (an anyio lock belongs to one loop, and a waiter of another loop, in
        another thread, is never woken), and the thread, not the loop, waits
        for the read before it.
        """
        with self._read_lock:
            reader = self._reader
            if self._closed or reader is None:
                raise self._closed_error()
            return fn(reader)

    async def _point_row(self, query: str, thread: str) -> tuple[Any, ...] | None:
        """The row ``query`` finds for ``thread``, or ``None``: on the event loop if SQLite answers at once.

        One statement on the busy_timeout-0 connection, run in place: the
        step's check pays for the lookup, not for layers around it. When that
        connection is not open, belongs to another thread, or answers any
        SQLite error (busy, locked or worse), the read is done in a worker
        thread, which waits as long as it may and reports the error.
        """
        reader = self._loop_reader
        if reader is not None and self._on_loop_thread():
            try:
                rows = reader.execute(query, (thread,)).fetchall()
            except sqlite3.Error:
                pass
            else:
                return rows[0] if rows else None
        return await self._read(partial(_one, query=query, params=(thread,)))

    # short-term -----------------------------------------------------------

    @counted_write
    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        check_thread(thread)

        def run(conn: sqlite3.Connection, encoded: list[_Encoded]) -> int:
            with _transaction(conn, "IMMEDIATE"):
                return _append_rows(conn, thread, [(body, count) for body, count, _ in encoded])

        if heavy_batch(messages):
            encoded, first = await self._encoded_in_thread(partial(encode_rows, messages, tokens), run)
        else:
            encoded = encode_rows(messages, tokens)
            first = await self._write(partial(run, encoded=encoded), sum(len(body) for body, _, _ in encoded))
        return _stored(first, encoded, [None] * len(encoded))

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
                    f"SELECT m.seq, m.tokens, {_BODY}, m.episode_seq {_WITH_EPISODES} "
                    "WHERE m.thread = ? ORDER BY m.seq DESC",
                    (thread,),
                )
                try:
                    for seq, tokens, body, episode_seq in rows:
                        if not window.offer(seq, tokens, body, episode_seq):
                            break
                finally:
                    rows.close()
            return ContextWindow(
                thread=thread,
                messages=window.messages(),
                version=stats.version,
                total_tokens=stats.total_tokens,
                complete=not window.full,
                last_seq=stats.last_seq,
            )

        return await self._read(run)

    async def tail(self, thread: str, *, after_seq: int) -> ContextWindow:
        check_thread(thread)
        after = check_after_seq(after_seq)

        def run(conn: sqlite3.Connection) -> ContextWindow:
            with _transaction(conn, "DEFERRED"):
                stats = _read_stats(conn, thread)
                rows = conn.execute(
                    f"SELECT m.seq, m.tokens, {_BODY}, m.episode_seq {_WITH_EPISODES} "
                    "WHERE m.thread = ? AND m.seq > ? ORDER BY m.seq",
                    (thread, tail_from(after)),
                ).fetchall()
            return ContextWindow(
                thread=thread,
                messages=tuple(stored_message(thread, *row) for row in rows),
                version=stats.version,
                total_tokens=stats.total_tokens,
                complete=after == 0,
                last_seq=stats.last_seq,
            )

        return await self._read(run)

    async def stats(self, thread: str) -> ThreadStats:
        check_thread(thread)
        return _stats(thread, await self._point_row(_STATS_QUERY, thread))

    async def state(self, thread: str, *, now: datetime | None = None) -> ThreadState:
        check_thread(thread)
        when = utc(now, "now")
        stats, counters = _state(thread, await self._point_row(_STATE_QUERY, thread))
        return trusted(ThreadState, stats=stats, pressure=counters.pressure(when, stats.total_tokens))

    @counted_write
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

        def swap(rows: list[tuple[str, int]]) -> Callable[[sqlite3.Connection, int | None], ThreadStats]:
            def run(conn: sqlite3.Connection, most: int | None = None) -> ThreadStats:
                with _transaction(conn, "IMMEDIATE"):
                    return _swap(conn, thread, through_seq, expected_version, rows, None, most)

            return run

        encode = partial(encode_messages, replacement, tokens, field="replacement")
        if heavy_batch(replacement):
            _, stats = await self._encoded_in_thread(encode, lambda conn, rows: swap(rows)(conn, None))
            return stats
        rows = encode()
        return await self._swap_write(swap(rows), sum(len(body) for body, _ in rows))

    @asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        check_thread(thread)
        owner = uuid.uuid4().hex

        def take(conn: sqlite3.Connection) -> bool:
            # One statement, timed by the database: the lease is free, expired, or refused.
            taken = conn.execute(
                f"""INSERT INTO compaction_leases (thread, owner, expires_at) VALUES (?, ?, {_NOW} + ?)
                ON CONFLICT (thread) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at
                WHERE compaction_leases.expires_at <= {_NOW}""",
                (thread, owner, self._lease_seconds),
            ).rowcount
            if taken == 1:
                self._leases.add((thread, owner))
            return taken == 1

        def release(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM compaction_leases WHERE thread = ? AND owner = ?", (thread, owner))
            self._leases.discard((thread, owner))

        if not await self._write(take, 0):
            yield False
            return
        try:
            yield True
        finally:
            with anyio.move_on_after(self._busy_timeout + _CLOSE_GRACE, shield=True):
                if not self._closed:
                    await self._write(release, 0)

    # episodic -------------------------------------------------------------

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        check_thread(thread)
        when = utc(at, "at")
        body = encode_episode(episode)

        def run(conn: sqlite3.Connection) -> int:
            with _transaction(conn, "IMMEDIATE"):
                return _record_rows(conn, thread, [episode], [body], when)[0]

        seq = await self._write(run, len(body))
        return EpisodeRecord(thread=thread, seq=seq, at=when, episode=episode)

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        """Episodes of ``thread`` with ``seq >= from_seq``, oldest first, read in batches.

        A ``forget`` of the thread ends the replay: at its next batch (each
        reads the thread's tombstones with its rows), and at its next episode
        when this process forgot it. Its seqs start over, and a replay must
        not splice the new log onto the old one.
        """
        check_thread(thread)
        first = check_from_seq(from_seq)

        def read_batch(start: int, conn: sqlite3.Connection) -> tuple[int | None, list[EpisodeRecord]]:
            rows = conn.execute(
                _REPLAY_QUERY, {"thread": thread, "start": start, "limit": _REPLAY_BATCH}
            ).fetchall()
            return (rows[0][3] if rows else None), [_episode_record(thread, *row[:3]) for row in rows]

        def read_tombstones(conn: sqlite3.Connection) -> int:
            return int(conn.execute(_TOMBSTONES_QUERY, {"thread": thread}).fetchone()[0])

        async def batch(start: int) -> tuple[int | None, list[EpisodeRecord]]:
            return await self._read(partial(read_batch, start))

        async def tombstones() -> int:
            return await self._read(read_tombstones)

        # Closed with the replay: a consumer that stops early leaves no generator to the collector.
        replayed = until_forgotten(thread, first, batch, _REPLAY_BATCH, lambda record: record.seq, tombstones)
        async with aclosing(replayed):
            async for record in replayed:
                yield record

    async def pressure(
        self,
        thread: str,
        *,
        now: datetime | None = None,
        estimated_context_tokens: int | None = None,
    ) -> EpisodicCompactionPressure:
        check_thread(thread)
        when = utc(now, "now")
        counters = _counters(thread, await self._point_row(_COUNTERS_QUERY, thread))
        return counters.pressure(when, estimated_context_tokens)

    async def latest_checkpoint(self, thread: str) -> EpisodeRecord | None:
        check_thread(thread)

        def run(conn: sqlite3.Connection) -> EpisodeRecord | None:
            row = _one(
                conn,
                """SELECT e.seq, e.at, e.body FROM threads AS t
                JOIN episodes AS e ON e.thread = t.thread AND e.seq = t.boundary_seq
                WHERE t.thread = ?""",
                (thread,),
            )
            return None if row is None else _episode_record(thread, *row)

        return await self._read(run)

    # both memories --------------------------------------------------------

    @counted_write
    async def record_and_append(
        self,
        thread: str,
        episodes: Sequence[Episode],
        messages: Sequence[Message],
        tokens: Sequence[int],
        *,
        message_episodes: Sequence[int] | None = None,
    ) -> list[StoredMessage]:
        check_thread(thread)
        encode = partial(encode_recording, episodes, messages, tokens, message_episodes)
        if heavy_batch(messages):
            when = datetime.now(UTC)
            recording, (first, linked, _) = await self._encoded_in_thread(
                encode, lambda conn, recording: _write_step(conn, thread, recording, when, self._ends)
            )
            return _stored(first, recording.rows, linked)
        return (await self._write_recording(thread, encode()))[0]

    async def _write_recording(
        self, thread: str, recording: Recording
    ) -> tuple[list[StoredMessage], ThreadStats | None]:
        """``record_and_append`` of a step checked and encoded already, in one transaction.

        Also the thread's stats as the transaction left them, when its write
        learned them (see ``_count_step``): a read right after the commit.
        """
        check_thread(thread)
        slot = begin_write(thread)
        try:
            encoded, shared = recording.rows, recording.shared
            size = sum(map(len, recording.bodies))
            if not all(shared):  # a row whose JSON its episode does not hold is written apart
                for (body, _, _), share in zip(encoded, shared, strict=True):
                    size += 0 if share else len(body)
            when, ends = datetime.now(UTC), self._ends
            first, linked, end = await self._write(
                lambda conn: _write_step(conn, thread, recording, when, ends), size
            )
            stats = (
                None
                if end is None
                else trusted(
                    ThreadStats, message_count=end[3], total_tokens=end[4], version=end[2], last_seq=end[1]
                )
            )
            return _stored(first, encoded, linked), stats
        finally:
            end_write(slot)

    @counted_write
    async def fold(
        self,
        thread: str,
        *,
        checkpoint: SummaryCheckpoint,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
    ) -> EpisodeRecord:
        check_thread(thread)
        body = check_checkpoint(checkpoint)
        check_replace(through_seq, expected_version)
        when = datetime.now(UTC)

        def swap(rows: list[tuple[str, int]]) -> Callable[[sqlite3.Connection, int | None], int]:
            summary_at = summary_index(replacement, checkpoint)  # encoding checked it is messages

            def run(conn: sqlite3.Connection, most: int | None = None) -> int:
                seqs: list[int] = []

                def record(count: int, first: _Replaced, last: _Replaced) -> list[int | None]:
                    seqs.extend(_record_rows(conn, thread, [checkpoint], [body], when))
                    return fold_links(
                        checkpoint,
                        seqs[0],
                        size=len(rows),
                        summary_at=summary_at,
                        count=count,
                        first=first,
                        last=last,
                    )

                with _transaction(conn, "IMMEDIATE"):
                    _swap(conn, thread, through_seq, expected_version, rows, record, most)
                return seqs[0]

            return run

        encode = partial(encode_messages, replacement, tokens, field="replacement")
        if heavy_batch(replacement):
            _, seq = await self._encoded_in_thread(encode, lambda conn, rows: swap(rows)(conn, None))
        else:
            rows = encode()
            seq = await self._swap_write(swap(rows), len(body) + sum(len(row) for row, _ in rows))
        return trusted(EpisodeRecord, thread=thread, seq=seq, at=when, episode=checkpoint)

    @counted_write
    async def record_and_replace(
        self,
        thread: str,
        episodes: Sequence[Episode],
        *,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
        message_episodes: Sequence[int | None] | None = None,
        stands_for: Sequence[int | None] | None = None,
    ) -> ThreadStats:
        check_thread(thread)
        check_replace(through_seq, expected_version)
        when = datetime.now(UTC)

        def swap(
            encoded: tuple[Recording, list[int | None]],
        ) -> Callable[[sqlite3.Connection, int | None], ThreadStats]:
            recording, kept = encoded
            rows = [(body, count) for body, count, _ in recording.rows]

            def run(conn: sqlite3.Connection, most: int | None = None) -> ThreadStats:
                def record(count: int, first: _Replaced, last: _Replaced) -> list[int | None]:
                    seqs = _record_rows(conn, thread, recording.episodes, recording.bodies, when)
                    replaced = (
                        conn.execute(
                            "SELECT seq, episode_seq FROM messages WHERE thread = ? AND seq <= ?",
                            (thread, through_seq),
                        ).fetchall()
                        if any(seq is not None for seq in kept)
                        else []
                    )
                    return edit_links(recording.links, seqs, kept, dict(replaced))

                with _transaction(conn, "IMMEDIATE"):
                    return _swap(conn, thread, through_seq, expected_version, rows, record, most)

            return run

        encode = partial(encode_edit, episodes, replacement, tokens, message_episodes, stands_for)
        if heavy_batch(replacement):
            _, stats = await self._encoded_in_thread(encode, lambda conn, encoded: swap(encoded)(conn, None))
            return stats
        encoded = encode()
        recording = encoded[0]
        size = sum(map(len, recording.bodies)) + sum(len(body) for body, _, _ in recording.rows)
        return await self._swap_write(swap(encoded), size)

    @counted_write
    async def forget(self, thread: str) -> Tombstone:
        check_thread(thread)
        when = datetime.now(UTC)

        def run(conn: sqlite3.Connection) -> Tombstone:
            with _transaction(conn, "IMMEDIATE"):
                (messages,) = conn.execute(
                    "SELECT count(*) FROM messages WHERE thread = ?", (thread,)
                ).fetchone()
                (episodes,) = conn.execute(
                    "SELECT count(*) FROM episodes WHERE thread = ?", (thread,)
                ).fetchone()
                conn.execute("INSERT INTO forgetting (thread) VALUES (?)", (thread,))
                conn.execute("DELETE FROM episodes WHERE thread = ?", (thread,))
                conn.execute("DELETE FROM forgetting WHERE thread = ?", (thread,))
                conn.execute("DELETE FROM messages WHERE thread = ?", (thread,))
                # The version and seq counter go on, so a cache of the forgotten context never
                # matches; the log starts over. The row holds the log's counters too: a thread that
                # never held a message nor was replaced had no context, and its version stays.
                conn.execute(
                    """UPDATE threads SET message_count = 0, total_tokens = 0,
                        version = CASE WHEN last_seq > 0 OR version > 0 THEN version + 1 ELSE version END,
                        last_episode_seq = 0, total_user_messages = 0, user_messages_since_boundary = 0,
                        run_completed_since_boundary = 0, user_messages_after_latest_run_completed = 0,
                        boundary_seq = NULL, first_at = NULL
                    WHERE thread = ?""",
                    (thread,),
                )
                conn.execute(
                    "INSERT INTO tombstones (thread, forgotten_at, messages, episodes) VALUES (?, ?, ?, ?)",
                    (thread, when.isoformat(), messages, episodes),
                )
            return Tombstone(thread=thread, forgotten_at=when, messages=messages, episodes=episodes)

        tombstone = await self._call(run)
        forgot(thread)
        return tombstone

    async def tombstones(self, thread: str) -> list[Tombstone]:
        check_thread(thread)

        def run(conn: sqlite3.Connection) -> list[Tombstone]:
            rows = conn.execute(
                "SELECT forgotten_at, messages, episodes FROM tombstones WHERE thread = ? ORDER BY rowid",
                (thread,),
            ).fetchall()
            return [_tombstone(thread, row) for row in rows]

        return await self._read(run)

    async def threads(self) -> list[ThreadInfo]:
        def run(conn: sqlite3.Connection) -> list[ThreadInfo]:
            rows = conn.execute(
                """SELECT t.thread, t.message_count, t.total_tokens, t.last_episode_seq, e.at
                FROM threads AS t
                LEFT JOIN episodes AS e ON e.thread = t.thread AND e.seq = t.last_episode_seq
                WHERE t.message_count > 0 OR t.last_episode_seq > 0"""
            ).fetchall()
            return [
                ThreadInfo(
                    thread=thread,
                    message_count=count,
                    total_tokens=total,
                    episodes=episodes,
                    last_activity=None if at is None else _parse_time(thread, "the newest episode", at),
                )
                for thread, count, total, episodes, at in rows
            ]

        return by_activity(await self._read(run))
