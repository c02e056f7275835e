"""The PostgreSQL backend: one schema shared by many workers on many hosts.

Needs the ``contextfold[postgres]`` extra (psycopg 3 and psycopg-pool). Every
operation is one statement, or one short transaction, on a pooled connection:

* A thread's working context is a run of ``messages`` rows keyed by
  ``(thread, seq)``; its ``threads`` row holds the counters ``stats()`` reads
  and is row-locked by every append and fold, so writers on any host get
  distinct sequence numbers and a fold sees a stable prefix.
* The episodic log is the ``episodes`` table; a trigger makes the database
  refuse UPDATE, DELETE and TRUNCATE on it, except the DELETE of a thread's
  episodes in the transaction that wrote its tombstone (``forget``). Pressure
  counters live in ``episode_threads`` and change in the same statement that
  appends the episode.
* ``record_and_append`` and ``fold`` are one statement each (one round trip):
  episodes, counters and working-context rows commit together or not at all.
  Whenever a statement locks both counter rows of a thread, it locks the
  ``threads`` row first, so writers never deadlock.
* ``compaction_lock`` is a lease row in ``compaction_leases`` that expires on
  the server's clock (``lease_seconds``, 300 s by default). Taking and
  releasing it are one short statement each; no connection is held while the
  compaction runs, so a crashed holder's lease simply runs out.
* Every pooled session has a ``statement_timeout`` (30 s by default), and
  every section shielded from cancellation ends by a deadline.
* The pool belongs to the event loop that opened the store (psycopg_pool wakes
  only that loop's tasks). A call made on another loop, in another thread (a
  sync framework runs each call in a loop of its own), takes its connection
  from a second pool (of up to ``max_size`` more connections, opened as such
  calls need them) that lives on a loop in a thread of its own (``_Away``),
  and runs its statements on its own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import math
import os
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager, contextmanager
from datetime import UTC, datetime
from functools import partial
from typing import Any, Self, TypeVar

import anyio
import psycopg
from anyio.lowlevel import checkpoint
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from .._episodes import (
    Episode,
    EpisodeRecord,
    RunCompletedEpisode,
    SummaryCheckpoint,
)
from .._errors import ConfigError, ConflictError, StoreClosedError, StoreError
from .._messages import Message
from .._pacing import wake
from .._policy import EpisodicCompactionPressure
from .._resource import AsyncResource
from .._secrets import masked_url, url_passwords
from .._threads import holding
from ._base import ContextWindow, StoredMessage, ThreadInfo, ThreadState, ThreadStats, Tombstone
from ._rows import (
    PressureCounters,
    Recording,
    Window,
    begin_write,
    check_after_seq,
    check_checkpoint,
    check_from_seq,
    check_max_tokens,
    check_replace,
    check_seconds,
    check_text,
    check_thread,
    check_total,
    counted_write,
    decode_episode,
    encode_edit,
    encode_episodes,
    encode_messages,
    encode_recording,
    end_write,
    forgot,
    missing_seq_conflict,
    off_loop_if_heavy,
    stored_message,
    summary_index,
    tail_from,
    trusted,
    until_forgotten,
    utc,
    version_conflict,
)

__all__ = ["DEFAULT_LEASE_SECONDS", "DEFAULT_STATEMENT_TIMEOUT", "PostgresStore"]

SCHEMA_VERSION = 2
"""The newest schema this code writes; a database at a higher version is refused."""

DEFAULT_LEASE_SECONDS = 300.0
"""How long a compaction lease outlives a holder that never released it."""
DEFAULT_STATEMENT_TIMEOUT = 30.0
"""Seconds the server lets one statement of a pooled session run."""

_REPLAY_BATCH = 500
_CONNECT_TIMEOUT_SECONDS = 10
_GRACE_SECONDS = 5.0
"""How long a shielded section waits beyond ``statement_timeout`` for the server's answer."""
_CLOSE_SECONDS = 10.0
_IDENTIFIER_MAX_BYTES = 63
_MAX_SECONDS = 86_400.0 * 366
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

# Each entry takes the schema from version N to N+1; ``{s}`` is the schema identifier.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE {s}.threads (
            thread text PRIMARY KEY,
            message_count bigint NOT NULL DEFAULT 0,
            total_tokens bigint NOT NULL DEFAULT 0,
            version bigint NOT NULL DEFAULT 0,
            last_seq bigint NOT NULL DEFAULT 0
        )
        """,
        """
        CREATE TABLE {s}.messages (
            thread text NOT NULL,
            seq bigint NOT NULL,
            tokens integer NOT NULL CHECK (tokens >= 0),
            body text NOT NULL,
            PRIMARY KEY (thread, seq)
        )
        """,
        """
        CREATE TABLE {s}.episodes (
            thread text NOT NULL,
            seq bigint NOT NULL,
            at timestamptz NOT NULL DEFAULT now(),
            kind text NOT NULL,
            body text NOT NULL,
            PRIMARY KEY (thread, seq)
        )
        """,
        """
        CREATE TABLE {s}.episode_threads (
            thread text PRIMARY KEY,
            last_seq bigint NOT NULL,
            first_at timestamptz NOT NULL,
            total_user_messages bigint NOT NULL,
            user_messages_since_boundary bigint NOT NULL,
            run_completed_since_boundary bigint NOT NULL,
            user_messages_after_latest_run_completed bigint NOT NULL,
            boundary_seq bigint
        )
        """,
        """
        CREATE FUNCTION {s}.reject_episode_change() RETURNS trigger LANGUAGE plpgsql AS $body$
        BEGIN
            RAISE EXCEPTION 'the episodic log is append-only: % on %.% is not allowed',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING HINT = 'record a new episode (for example a manual_recovery boundary) instead';
        END
        $body$
        """,
        """
        CREATE TRIGGER episodes_append_only BEFORE UPDATE OR DELETE ON {s}.episodes
            FOR EACH ROW EXECUTE FUNCTION {s}.reject_episode_change()
        """,
        """
        CREATE TRIGGER episodes_no_truncate BEFORE TRUNCATE ON {s}.episodes
            FOR EACH STATEMENT EXECUTE FUNCTION {s}.reject_episode_change()
        """,
    ),
    (
        # 64-bit token counts like the other backends, and the episode that recorded each message.
        "ALTER TABLE {s}.messages ALTER COLUMN tokens TYPE bigint, ADD COLUMN episode_seq bigint",
        """
        CREATE TABLE {s}.compaction_leases (
            thread text PRIMARY KEY,
            owner uuid NOT NULL,
            expires_at timestamptz NOT NULL
        )
        """,
        """
        CREATE TABLE {s}.tombstones (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            thread text NOT NULL,
            forgotten_at timestamptz NOT NULL DEFAULT now(),
            messages bigint NOT NULL,
            episodes bigint NOT NULL,
            xact xid8 NOT NULL DEFAULT pg_current_xact_id()
        )
        """,
        "CREATE INDEX tombstones_thread ON {s}.tombstones (thread, xact)",
        # The one removal the log permits: deleting a thread's episodes in the transaction
        # that left its tombstone. UPDATE and TRUNCATE stay refused, whoever issues them.
        """
        CREATE OR REPLACE FUNCTION {s}.reject_episode_change() RETURNS trigger LANGUAGE plpgsql AS $body$
        BEGIN
            IF TG_OP = 'DELETE' AND TG_LEVEL = 'ROW' THEN
                IF EXISTS (SELECT 1 FROM {s}.tombstones
                           WHERE thread = OLD.thread AND xact = pg_current_xact_id()) THEN
                    RETURN OLD;
                END IF;
            END IF;
            RAISE EXCEPTION 'the episodic log is append-only: % on %.% is not allowed',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING HINT = 'record a new episode (for example a manual_recovery boundary) instead, '
                    'or erase a whole thread with forget()';
        END
        $body$
        """,
        """
        CREATE FUNCTION {s}.reject_tombstone_change() RETURNS trigger LANGUAGE plpgsql AS $body$
        BEGIN
            RAISE EXCEPTION 'tombstones are append-only: % on %.% is not allowed',
                TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME;
        END
        $body$
        """,
        """
        CREATE TRIGGER tombstones_append_only BEFORE UPDATE OR DELETE ON {s}.tombstones
            FOR EACH ROW EXECUTE FUNCTION {s}.reject_tombstone_change()
        """,
        """
        CREATE TRIGGER tombstones_no_truncate BEFORE TRUNCATE ON {s}.tombstones
            FOR EACH STATEMENT EXECUTE FUNCTION {s}.reject_tombstone_change()
        """,
    ),
)
assert len(_MIGRATIONS) == SCHEMA_VERSION


def _key(*parts: str) -> int:
    """A stable signed 64-bit advisory-lock key (Python's ``hash`` differs per process)."""
    digest = hashlib.blake2b("\x00".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


_T = TypeVar("_T")

_Pool = AsyncConnectionPool[psycopg.AsyncConnection[Any]]
_Conn = psycopg.AsyncConnection[Any]


async def _outcome(done: concurrent.futures.Future[_T]) -> _T:
    """What ``done`` (a call running on another thread's event loop) returns, awaited on this loop.

    A cancelled caller stops waiting; the call itself goes on to its end.
    """
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def notify(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # this loop closed: nobody waits any more
            loop.call_soon_threadsafe(wake, waiter)

    done.add_done_callback(notify)
    await waiter
    return done.result()


def _cancel_on(loop: asyncio.AbstractEventLoop, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` on ``loop``, the loop of the task it belongs to, from any thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        scope.cancel()
        return
    with contextlib.suppress(RuntimeError):  # that loop closed: nobody waits there any more
        loop.call_soon_threadsafe(scope.cancel)


class _Away:
    """The pool of the calls made on event loops other than the one that opened the store.

    ``AsyncConnectionPool`` belongs to the loop it was opened on: its lock, its
    waiting clients and its maintenance queue wake only that loop's tasks, so
    a task of a loop in another thread that waits there is never woken. This
    pool lives on an event loop in a thread of its own that runs nothing else,
    so no caller's code ever blocks it (a sync call made on the opening loop's
    thread blocks that loop). A caller takes a connection from it and puts it
    back through that loop, and runs its statements on its own loop in
    between: a psycopg connection waits on whichever loop awaits it.
    """

    def __init__(self, make_pool: Callable[[], _Pool], name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self._pool = self._submit(self._open(make_pool))

    def _serve(self) -> None:
        loop = self.loop
        try:
            loop.run_forever()
            # Calls submitted before the stop may not have ended: each does now (the pool
            # is closed, so at once), and what is left after the grace is cancelled.
            pending = asyncio.all_tasks(loop)
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=_CLOSE_SECONDS))
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()

    def _submit(self, call: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        with self._lock:  # so none comes in after the stop, which would never run it
            if not self._stopped:
                return asyncio.run_coroutine_threadsafe(call, self.loop)
        call.close()
        raise PoolClosed("the pool of the calls made on other event loops is closed")

    @staticmethod
    async def _open(make_pool: Callable[[], _Pool]) -> _Pool:
        pool = make_pool()
        await pool.open()  # connects as calls ask, in its background tasks
        return pool

    def _run(self, call: Callable[[_Pool], Coroutine[Any, Any, _T]]) -> concurrent.futures.Future[_T]:
        async def run() -> _T:
            return await call(await asyncio.wrap_future(self._pool))

        return self._submit(run())

    async def getconn(self) -> _Conn:
        done = self._run(lambda pool: pool.getconn())
        try:
            return await _outcome(done)
        except BaseException:
            done.add_done_callback(self._give_back)  # a connection it still gets goes back
            raise

    def _give_back(self, done: concurrent.futures.Future[_Conn]) -> None:
        if not done.cancelled() and done.exception() is None:
            conn = done.result()
            with contextlib.suppress(PoolClosed):  # closed meanwhile: so is the connection, on its end
                self._run(lambda pool: pool.putconn(conn))

    async def putconn(self, conn: _Conn) -> None:
        await _outcome(self._run(lambda pool: pool.putconn(conn)))

    async def aclose(self) -> None:
        """Close the pool, then end the loop and its thread."""
        try:
            await _outcome(self._run(lambda pool: pool.close(timeout=_CLOSE_SECONDS)))
        finally:
            with self._lock:
                self._stopped = True
                self.loop.call_soon_threadsafe(self.loop.stop)
            await anyio.to_thread.run_sync(self._thread.join, 2 * _CLOSE_SECONDS)


def _where(dsn: str) -> str:
    """``host:port/dbname`` of a DSN, without credentials, for error messages."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or 5432)
    dbname = str(params.get("dbname") or params.get("user") or "")
    where = f"{host}:{port}/{dbname}"
    for password in url_passwords(dsn):  # a URL libpq split elsewhere than at its '@' (a '/' in the password)
        where = where.replace(password, "***")
    return where


_URL_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*)://")
_QUOTED = re.compile(r'"([^"]*)"')
_ACCEPTED = "a postgresql:// (or postgres://) URL such as postgresql://user:password@host:5432/dbname"


def _scrubbed(dsn: str, error: psycopg.Error) -> str:
    """Why psycopg refused ``dsn``, with no part of its password in the text.

    libpq quotes the parts of a DSN it could not read (the whole DSN, a
    user-info token, a query value): each quoted part is masked like the DSN,
    and one that is a piece of a password is shown as ``***``. A password
    still found anywhere after that drops psycopg's text altogether.
    """
    passwords = url_passwords(dsn)

    def clean(quoted: re.Match[str]) -> str:
        part = quoted.group(1)
        if part and any(part in password for password in passwords):
            return '"***"'
        part = masked_url(part)
        for password in passwords:
            part = part.replace(password, "***")
        return f'"{part}"'

    reason = " ".join(_QUOTED.sub(clean, str(error)).split())
    if any(len(password) >= 4 and password in reason for password in passwords):
        return "libpq could not parse it"
    return reason


def _as_utc(moment: datetime) -> datetime:
    """A timestamptz read back, in UTC whatever the session's time zone."""
    return moment.astimezone(UTC)


def _pool_size(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= 10_000:
        raise ConfigError(key, f"must be a whole number from {minimum} to 10000", value=value)
    return value


def _batch(episodes: Sequence[Episode], bodies: list[str] | None = None) -> dict[str, Any]:
    """A batch of episodes as the parameters of one counters upsert.

    The counters after a batch are either the old ones plus what the batch
    adds, or, past a reset in the batch, just what it adds after the last
    reset; ``PressureCounters`` from zero gives the second, the flags say which.
    """
    bodies = encode_episodes(episodes) if bodies is None else bodies
    fresh = PressureCounters()
    for episode in episodes:
        fresh = fresh.after(episode, _EPOCH)
    reset_boundary = fresh.boundary_seq is not None
    return {
        "e_n": len(episodes),
        "e_kinds": [episode.kind for episode in episodes],
        "e_bodies": bodies,
        "e_total": fresh.total_user_messages,
        "e_since": fresh.user_messages_since_boundary,
        "e_runs": fresh.run_completed_since_boundary,
        "e_after": fresh.user_messages_after_latest_run_completed,
        "e_boundary": fresh.boundary_seq,
        "e_reset_boundary": reset_boundary,
        "e_reset_after": reset_boundary
        or any(isinstance(episode, RunCompletedEpisode) and episode.clean for episode in episodes),
    }


# The counters upsert and the episode insert of a batch (``_batch``). ``{source}`` is
# the FROM clause that gates them (and orders their row lock after the threads row's).
_RECORD_CTES = """
    e AS (
        INSERT INTO {s}.episode_threads AS e (thread, last_seq, first_at, total_user_messages,
            user_messages_since_boundary, run_completed_since_boundary,
            user_messages_after_latest_run_completed, boundary_seq)
        SELECT %(thread)s, %(e_n)s, coalesce(%(at)s::timestamptz, now()), %(e_total)s, %(e_since)s,
            %(e_runs)s, %(e_after)s, %(e_boundary)s::bigint {source}
        ON CONFLICT (thread) DO UPDATE SET
            last_seq = e.last_seq + EXCLUDED.last_seq,
            total_user_messages = e.total_user_messages + EXCLUDED.total_user_messages,
            user_messages_since_boundary = CASE WHEN %(e_reset_boundary)s
                THEN EXCLUDED.user_messages_since_boundary
                ELSE e.user_messages_since_boundary + EXCLUDED.user_messages_since_boundary END,
            run_completed_since_boundary = CASE WHEN %(e_reset_boundary)s
                THEN EXCLUDED.run_completed_since_boundary
                ELSE e.run_completed_since_boundary + EXCLUDED.run_completed_since_boundary END,
            user_messages_after_latest_run_completed = CASE WHEN %(e_reset_after)s
                THEN EXCLUDED.user_messages_after_latest_run_completed
                ELSE e.user_messages_after_latest_run_completed
                    + EXCLUDED.user_messages_after_latest_run_completed END,
            boundary_seq = CASE WHEN %(e_reset_boundary)s
                THEN e.last_seq + EXCLUDED.boundary_seq ELSE e.boundary_seq END
        RETURNING last_seq),
    recorded AS (
        INSERT INTO {s}.episodes (thread, seq, at, kind, body)
        SELECT %(thread)s, e.last_seq - %(e_n)s + u.n, coalesce(%(at)s::timestamptz, now()), u.kind, u.body
        FROM e, unnest(%(e_kinds)s::text[], %(e_bodies)s::text[]) WITH ORDINALITY AS u(kind, body, n)
        RETURNING seq, at)
"""

# Appends a batch of messages: the upsert row-locks the thread, so concurrent appenders
# get disjoint seqs. ``m_episodes`` holds, per message, the index of its episode in the
# batch recorded by the same statement (or null).
_THREADS_CTE = """
    t AS (
        INSERT INTO {s}.threads AS t (thread, message_count, total_tokens, last_seq)
        VALUES (%(thread)s, %(m_n)s, %(m_total)s, %(m_n)s) ON CONFLICT (thread) DO UPDATE SET
            message_count = t.message_count + EXCLUDED.message_count,
            total_tokens = t.total_tokens + EXCLUDED.total_tokens,
            last_seq = t.last_seq + EXCLUDED.last_seq
        RETURNING last_seq, message_count, total_tokens, version)
"""
_ADDED_CTE = """
    added AS (
        INSERT INTO {s}.messages (thread, seq, tokens, body, episode_seq)
        SELECT %(thread)s, t.last_seq - %(m_n)s + u.n, u.tokens, u.body, {episode_seq}
        FROM t, {episodes}
            unnest(%(m_tokens)s::bigint[], %(m_bodies)s::text[], %(m_episodes)s::bigint[])
            WITH ORDINALITY AS u(tokens, body, episode, n))
"""

_SWAP = """
WITH
    guard AS (
        SELECT thread FROM {s}.threads
        WHERE thread = %(thread)s AND version = %(expected_version)s
            AND EXISTS (SELECT 1 FROM {s}.messages WHERE thread = %(thread)s AND seq = %(through_seq)s)
        FOR UPDATE),
    gone AS (
        DELETE FROM {s}.messages
        WHERE thread = %(thread)s AND seq <= %(through_seq)s AND EXISTS (SELECT 1 FROM guard)
        RETURNING seq, tokens, episode_seq),
    removed AS (
        SELECT count(*) AS n, coalesce(sum(tokens), 0) AS tokens,
            count(*) FILTER (WHERE seq < %(from_seq)s::bigint) AS head
        FROM gone),
    replaced AS (SELECT seq, episode_seq, row_number() OVER (ORDER BY seq) AS i FROM gone),
    {record},
    added AS (
        INSERT INTO {s}.messages (thread, seq, tokens, body, episode_seq)
        SELECT %(thread)s, %(through_seq)s - %(m_n)s + u.n, u.tokens, u.body, {link}
        FROM removed LEFT JOIN e ON true CROSS JOIN
            unnest(%(m_tokens)s::bigint[], %(m_bodies)s::text[]{columns})
                WITH ORDINALITY AS u(tokens, body{names}, n)
            LEFT JOIN replaced AS r ON {stands_for}
        WHERE removed.n > 0),
    swapped AS (
        UPDATE {s}.threads AS t SET
            message_count = t.message_count + %(m_n)s - removed.n,
            total_tokens = t.total_tokens + %(m_total)s - removed.tokens,
            version = t.version + 1
        FROM removed
        WHERE t.thread = %(thread)s AND EXISTS (SELECT 1 FROM guard)
        RETURNING t.version, t.message_count, t.total_tokens, t.last_seq)
SELECT
    (SELECT version FROM swapped),
    (SELECT max(seq) FROM recorded),
    (SELECT max(at) FROM recorded),
    (SELECT version FROM {s}.threads WHERE thread = %(thread)s),
    EXISTS (SELECT 1 FROM {s}.messages WHERE thread = %(thread)s AND seq = %(through_seq)s),
    (SELECT message_count FROM swapped),
    (SELECT total_tokens FROM swapped),
    (SELECT last_seq FROM swapped)
"""
"""A guarded prefix swap that records a batch of episodes (``_RECORD_CTES``) in the same statement.

Every write is gated on one locked, checked row (the thread at
``expected_version``, holding ``through_seq``), so it does all of them or none.
``{link}`` is each replacement row's ``episode_seq``, from the recorded batch
(``e``) and the replaced row it is joined to (``r``, on ``{stands_for}``).
"""

_FOLD_LINK = "CASE WHEN u.n = %(m_summary)s::bigint THEN e.last_seq ELSE r.episode_seq END"
# The head the fold keeps, one for one, then the newest replaced rows (fold_links).
_FOLD_STANDS_FOR = """r.i = CASE WHEN u.n <= removed.head THEN u.n ELSE removed.n - %(m_n)s + u.n END
                AND (u.n <= removed.head OR r.i > removed.head)"""

_EDIT_LINK = "coalesce(e.last_seq - %(e_n)s + 1 + u.episode, r.episode_seq)"
"""The batch's episode that records the row, else the link of the replaced row it stands for (edit_links)."""


def _swap_conflict(
    thread: str, action: str, current: int | None, expected_version: int, found: bool, through_seq: int
) -> ConflictError:
    """Why a guarded swap (``_SWAP``) wrote nothing."""
    if (current or 0) != expected_version:
        return version_conflict(thread, current or 0, expected_version)
    if not found:
        return missing_seq_conflict(thread, through_seq)
    return ConflictError(f"thread {thread!r} changed during the {action}; load it again and retry")


_COUNTER_COLUMNS = (
    "e.last_seq, e.total_user_messages, e.user_messages_since_boundary, e.run_completed_since_boundary,"
    " e.user_messages_after_latest_run_completed, e.boundary_seq, e.first_at"
)


def _message_batch(
    thread: str, messages: Sequence[Message], tokens: Sequence[int], *, field: str = "messages"
) -> dict[str, Any]:
    return _row_params(thread, encode_messages(messages, tokens, field=field))


def _row_params(thread: str, rows: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """Encoded message rows as the parameters of one insert."""
    counts = [count for _, count in rows]
    return {
        "m_n": len(rows),
        "m_total": check_total(thread, sum(counts)),
        "m_tokens": counts,
        "m_bodies": [body for body, _ in rows],
    }


class PostgresStore(AsyncResource):
    """Both stores on PostgreSQL, for many workers on many hosts.

    ``schema`` is created (with its tables) on open if missing, and migrated;
    concurrent first opens are serialized by an advisory lock. The pool keeps
    between ``min_size`` and ``max_size`` connections, and no call holds one
    for longer than its own statements. ``lease_seconds`` bounds how long a
    compaction lease outlives a holder that crashed; a compaction that runs
    longer may see a second one start, and then the version guard of ``fold``
    lets only one of them apply. ``statement_timeout`` (seconds) is set on
    every pooled session; a write the server has not answered within it and
    a few seconds more raises ``StoreError``, its outcome unknown to the caller.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "contextfold",
        min_size: int = 1,
        max_size: int = 10,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT,
    ) -> None:
        if not isinstance(dsn, str) or not dsn.strip() or "\x00" in dsn:
            raise ConfigError("dsn", f"must be {_ACCEPTED}", value="<hidden>")
        try:
            check_text("dsn", dsn, example="postgresql://user@host:5432/dbname")
        except ConfigError as exc:  # its value would be the DSN, password and all
            raise ConfigError("dsn", exc.reason, value=masked_url(dsn)) from None
        scheme = _URL_SCHEME.match(dsn)
        if scheme is not None and scheme.group(1) not in ("postgresql", "postgres"):  # libpq: lower case only
            name = scheme.group(1)
            base, plus, driver = name.partition("+")
            hint = (
                f"; that is SQLAlchemy's form: drop '+{driver}'"
                if plus and base.lower() in ("postgresql", "postgres")
                else ""
            )
            raise ConfigError(
                "dsn",
                f"has the scheme {name!r}, which PostgreSQL does not read; use {_ACCEPTED}{hint}",
                value=masked_url(dsn),
            )
        try:
            given = conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as exc:
            raise ConfigError(
                "dsn",
                f"is not a valid PostgreSQL connection string ({_scrubbed(dsn, exc)}); use {_ACCEPTED}",
                value=masked_url(dsn),
            ) from None
        check_text("schema", schema, example="contextfold")
        if len(schema.encode()) > _IDENTIFIER_MAX_BYTES:
            raise ConfigError(
                "schema",
                f"PostgreSQL names are at most {_IDENTIFIER_MAX_BYTES} bytes; shorten it",
                value=schema,
            )
        self._min_size = _pool_size("min_size", min_size, 0)
        self._max_size = _pool_size("max_size", max_size, max(1, min_size))
        self._lease_seconds = check_seconds("lease_seconds", lease_seconds, example=300, maximum=_MAX_SECONDS)
        self._statement_timeout = check_seconds(
            "statement_timeout", statement_timeout, example=30, maximum=_MAX_SECONDS
        )
        self._dsn = dsn
        # Defaults for what neither the DSN nor the PG* environment says.
        self._connect_options: dict[str, Any] = {"fallback_application_name": "contextfold"}
        if "connect_timeout" not in given and "PGCONNECT_TIMEOUT" not in os.environ:
            self._connect_options["connect_timeout"] = _CONNECT_TIMEOUT_SECONDS
        self._schema = schema
        self._s = sql.Identifier(schema)
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        # The loop that opened the pool, whose calls use it; any other loop's use _away.
        self._home: asyncio.AbstractEventLoop | None = None
        self._away: _Away | None = None
        self._closed = False
        # Held while the store opens or closes: a threading lock, waited for in a worker
        # thread, since open() and aclose() may come from different event loops and threads.
        self._opening = threading.Lock()
        self._away_lock = threading.Lock()
        # The calls waiting for a pooled connection, each with its loop: aclose() ends their waits.
        self._waiting: set[tuple[asyncio.AbstractEventLoop, anyio.CancelScope]] = set()
        self._waiting_lock = threading.Lock()
        self._queries: dict[str, sql.Composed] = {}

    def __repr__(self) -> str:
        return f"PostgresStore({_where(self._dsn)!r}, schema={self._schema!r})"

    # lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create or migrate the schema, and start the pool; a second call does nothing."""
        self._asyncio_loop("open")
        async with holding(self._opening):
            if self._closed:
                raise StoreClosedError(f"{self!r} was closed; create a new PostgresStore")
            if self._pool is None:
                await self._open()

    def _asyncio_loop(self, action: str) -> asyncio.AbstractEventLoop:
        """The running asyncio loop; on any other (trio), a StoreError saying what to do instead.

        Checked before psycopg is called, which would fail with a bare
        ``RuntimeError: no running event loop``.
        """
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            raise StoreError(
                f"PostgresStore runs on asyncio only (psycopg's async driver and pool need its event "
                f"loop), but {action}() was called on another event loop, such as trio; run the program "
                "under asyncio (anyio.run(main) or anyio.run(main, backend='asyncio')), or use "
                "SQLiteStore or MemoryStore, which run on trio too"
            ) from None

    async def _open(self) -> None:
        try:
            conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, **self._connect_options)
        except psycopg.OperationalError as exc:
            raise StoreError(
                f"cannot connect to PostgreSQL at {_where(self._dsn)}: {_scrubbed(self._dsn, exc)}; "
                "check that the server is running and accepts connections there, "
                "or pass PostgresStore the DSN of one that does"
            ) from exc
        async with conn:
            try:
                await self._migrate(conn)
            except psycopg.Error as exc:
                raise StoreError(
                    f"cannot create or migrate schema {self._schema!r} at {_where(self._dsn)}: "
                    f"{str(exc).strip()}; grant the user CREATE on the database, or have an owner "
                    "open the store once to create it"
                ) from exc
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            self._dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            kwargs={"autocommit": True, **self._connect_options},
            configure=self._configure,
            open=False,
            name=f"contextfold-{self._schema}",
        )
        try:
            await pool.open(wait=self._min_size > 0, timeout=_CONNECT_TIMEOUT_SECONDS)
        except PoolTimeout as exc:
            await pool.close()
            raise StoreError(
                f"PostgreSQL at {_where(self._dsn)} did not accept {self._min_size} pooled connections "
                f"within {_CONNECT_TIMEOUT_SECONDS} s; lower min_size or raise the server's max_connections"
            ) from exc
        self._home = asyncio.get_running_loop()
        self._pool = pool

    def _away_pool(self) -> _Away:
        """The pool of the calls made on other event loops than the pool's, started on first use."""
        with self._away_lock:
            if self._closed:
                raise StoreClosedError(f"{self!r} was closed; create a new PostgresStore")
            away = self._away
            if away is None:
                make = partial(
                    AsyncConnectionPool,
                    self._dsn,
                    min_size=0,
                    max_size=self._max_size,
                    kwargs={"autocommit": True, **self._connect_options},
                    configure=self._configure,
                    open=False,
                    name=f"contextfold-{self._schema}-away",
                )
                away = self._away = _Away(make, f"contextfold-postgres {self._schema}")
            return away

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Session settings, so they hold for every statement the pool runs on the connection.
        # Times are read back in UTC: psycopg then needs no time-zone file for the server's
        # zone, which it would read from disk on the event loop at the first timestamp.
        milliseconds = max(1, round(self._statement_timeout * 1000))
        await conn.execute(
            sql.SQL("SET statement_timeout = {}; SET TimeZone = 'UTC'").format(sql.Literal(milliseconds))
        )

    async def aclose(self) -> None:
        """Close the pool; later calls raise ``StoreClosedError``. Closing twice is fine.

        Shielded and bounded: a cancelled caller still closes the pool, and an
        ``open()`` in progress finishes first, so no pool outlives the store.
        """
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + _CONNECT_TIMEOUT_SECONDS * 3):
            with self._waiting_lock:
                self._closed = True
                waiting = list(self._waiting)
            for loop, scope in waiting:
                _cancel_on(loop, scope)
            async with holding(self._opening):
                with self._away_lock:
                    away, self._away = self._away, None
                pool, self._pool = self._pool, None
                try:
                    if away is not None:
                        await away.aclose()
                finally:
                    if pool is not None:
                        await self._close_home(pool)

    async def _close_home(self, pool: _Pool) -> None:
        """Close the pool on the loop that opened it, or here once that loop has stopped."""
        home = self._home
        if home is None or home is asyncio.get_running_loop():
            await pool.close(timeout=_CLOSE_SECONDS)
            return
        if home.is_running():
            closing = pool.close(timeout=_CLOSE_SECONDS)
            try:
                done = asyncio.run_coroutine_threadsafe(closing, home)
            except RuntimeError:  # it closed just now: closed here, below
                closing.close()
            else:
                await _outcome(done)
                return
        # Its background tasks ended with it: the close fails to wait for those tasks on a closed
        # loop, with RuntimeError (Python 3.11) or, from 3.12, a CancelledError that is not ours.
        try:
            await pool.close(timeout=_CLOSE_SECONDS)
        except RuntimeError:
            pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def _migrate(self, conn: psycopg.AsyncConnection[Any]) -> None:
        found = await self._schema_version(conn)
        if found == SCHEMA_VERSION:
            # The common case takes no lock and needs no CREATE privilege.
            return
        async with conn.transaction():
            # Serializes concurrent first opens: CREATE ... IF NOT EXISTS alone still races.
            await conn.execute(
                "SELECT pg_advisory_xact_lock(%s)", (_key("contextfold.schema", self._schema),)
            )
            await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(self._s))
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {}.schema_version "
                    "(only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row), version integer NOT NULL)"
                ).format(self._s)
            )
            found = await self._schema_version(conn) or 0
            self._refuse_newer(found)
            for statements in _MIGRATIONS[found:]:
                for statement in statements:
                    await conn.execute(sql.SQL(statement).format(s=self._s))
            if found < SCHEMA_VERSION:
                await conn.execute(
                    sql.SQL(
                        "INSERT INTO {}.schema_version (version) VALUES (%s) "
                        "ON CONFLICT (only_row) DO UPDATE SET version = EXCLUDED.version"
                    ).format(self._s),
                    (SCHEMA_VERSION,),
                )

    async def _schema_version(self, conn: psycopg.AsyncConnection[Any]) -> int | None:
        cur = await conn.execute(
            "SELECT to_regclass(format('%%I.schema_version', %s::text)) IS NOT NULL", (self._schema,)
        )
        row = await cur.fetchone()
        if not row or not row[0]:
            return None
        cur = await conn.execute(sql.SQL("SELECT version FROM {}.schema_version").format(self._s))
        version_row = await cur.fetchone()
        if version_row is None:
            return None
        found = int(version_row[0])
        self._refuse_newer(found)
        return found

    def _refuse_newer(self, found: int) -> None:
        if found > SCHEMA_VERSION:
            raise StoreError(
                f"schema {self._schema!r} at {_where(self._dsn)} is at version {found}, newer than the "
                f"{SCHEMA_VERSION} this contextfold understands; upgrade contextfold or use another schema"
            )

    def _require_open(self, action: str) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            if self._closed:
                raise StoreClosedError(f"{self!r} was closed; {action} needs an open store")
            raise StoreError(
                f"{self!r} is not open; use 'async with' or 'await store.open()' before {action}"
            )
        return self._pool

    def _closed_during(self, action: str, thread: str) -> StoreClosedError:
        return StoreClosedError(f"{self!r} was closed during {action} of thread {thread!r}")

    @contextmanager
    def _until_closed(self, action: str, thread: str) -> Iterator[anyio.CancelScope]:
        """A scope that ``aclose()`` cancels, around a wait for a pooled connection.

        The pool fails only the clients queued when it closes: one that reached
        its lock while it closed queues after it and would wait out the pool's
        30 s timeout, then fail as if the pool were too small.
        """
        scope = anyio.CancelScope()
        entry = (asyncio.get_running_loop(), scope)
        with self._waiting_lock:
            if self._closed:
                raise self._closed_during(action, thread)
            self._waiting.add(entry)
        try:
            with scope:
                yield scope
        finally:
            with self._waiting_lock:
                self._waiting.discard(entry)

    @asynccontextmanager
    async def _connection(
        self, action: str, thread: str, *, write: bool = False
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection; driver failures become ``StoreError`` naming the action and thread.

        With ``write``, the body is shielded from cancellation once it has a
        connection: a cancelled caller waits for its statement or transaction to
        end. Otherwise psycopg would drop the connection mid-statement and the
        server could still commit the write after the call had returned, to be
        seen (or retried, and then duplicated) by whatever the caller does next.
        The shield lasts at most ``statement_timeout`` and a grace period: the
        server gives up on the statement first, so the deadline only ends the
        wait for a server or network that stopped answering.
        """
        pool = self._require_open(action)
        # The pool hands out an idle connection without yielding, so this is where a
        # caller cancelled before the call began is stopped before anything is sent.
        await checkpoint()
        away = None if self._asyncio_loop(action) is self._home else self._away_pool()
        try:
            try:
                with self._until_closed(action, thread) as waiting:
                    conn = await (pool.getconn() if away is None else away.getconn())
                if waiting.cancelled_caught:
                    raise self._closed_during(action, thread)
            except PoolClosed as exc:
                raise self._closed_during(action, thread) from exc
            except PoolTimeout as exc:
                if self._closed:  # the pool's timeout ran out for a call made before the close
                    raise self._closed_during(action, thread) from exc
                raise StoreError(
                    f"no PostgreSQL connection free for {action} of thread {thread!r} "
                    f"(pool max_size={self._max_size}); raise max_size"
                ) from exc
            try:
                deadline = anyio.current_time() + self._statement_timeout + _GRACE_SECONDS
                with anyio.CancelScope(shield=write, deadline=deadline if write else math.inf) as scope:
                    yield conn
                if scope.cancelled_caught:
                    raise StoreError(
                        f"PostgreSQL did not answer {action} of thread {thread!r} within "
                        f"statement_timeout={self._statement_timeout:g} s and {_GRACE_SECONDS:g} s more; "
                        "whether it was applied is unknown: read the thread before retrying"
                    )
            finally:
                # Shielded: a cancellation landing while the pool takes the connection
                # back would leave it neither pooled nor closed, a pool slot lost for good.
                # The pool rolls back an open transaction and replaces a broken connection.
                with anyio.CancelScope(shield=True, deadline=anyio.current_time() + _GRACE_SECONDS):
                    await (pool.putconn(conn) if away is None else away.putconn(conn))
        except psycopg.errors.NumericValueOutOfRange:
            # Token counts are the only sums the statements can take past 64 bits.
            raise ConfigError(
                "tokens",
                f"would take thread {thread!r}'s token total past 2**63 - 1; pass real token counts",
            ) from None
        except psycopg.errors.QueryCanceled as exc:
            raise StoreError(
                f"PostgreSQL cancelled {action} of thread {thread!r} after "
                f"statement_timeout={self._statement_timeout:g} s ({str(exc).strip()}); nothing of it was "
                "applied: raise statement_timeout, or find what holds the thread's rows locked"
            ) from exc
        except psycopg.Error as exc:
            raise StoreError(
                f"PostgreSQL failed during {action} of thread {thread!r}: {str(exc).strip()}"
            ) from exc

    def _q(self, text: str) -> sql.Composed:
        """``text`` with the schema filled in, composed once per store (the hot path reuses it)."""
        return self._composed(text, lambda: sql.SQL(text).format(s=self._s))

    def _composed(self, key: str, build: Callable[[], sql.Composed]) -> sql.Composed:
        query = self._queries.get(key)
        if query is None:
            query = self._queries[key] = build()
        return query

    async def _one(
        self, action: str, thread: str, query: sql.Composed, params: Any, *, write: bool = False
    ) -> tuple[Any, ...]:
        """The one row ``query`` returns, run as one statement on a pooled connection."""
        async with self._connection(action, thread, write=write) as conn:
            cur = await conn.execute(query, params)
            row: tuple[Any, ...] | None = await cur.fetchone()
        assert row is not None
        return row

    # short-term --------------------------------------------------------------

    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        """Append messages (with their token counts) after the newest one; return them stored."""
        return await self.record_and_append(thread, [], messages, tokens)

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
        """Record ``episodes`` and append ``messages`` in one statement, so one transaction."""
        check_thread(thread)
        recording = await off_loop_if_heavy(
            messages, encode_recording, episodes, messages, tokens, message_episodes
        )
        return (await self._write_recording(thread, recording))[0]

    async def _write_recording(
        self, thread: str, recording: Recording
    ) -> tuple[list[StoredMessage], ThreadStats | None]:
        """``record_and_append`` of a step checked and encoded already, in one statement.

        Also the thread's stats as the statement left them (the threads row it
        updated, locked until the commit): a read right after the commit.
        """
        check_thread(thread)
        slot = begin_write(thread)
        try:
            episodes, bodies, rows, links, _, _ = recording
            params: dict[str, Any] = {
                "thread": thread,
                "at": None,
                **_row_params(thread, [(body, count) for body, count, _ in rows]),
                **_batch(episodes, bodies),
                "m_episodes": links,
            }
            if not params["m_n"]:
                if episodes:
                    await self._record_batch(thread, params)
                else:
                    self._require_open("record_and_append")
                return [], None
            query = self._append_query(recording=bool(episodes))
            async with self._connection("record_and_append", thread, write=True) as conn:
                cur = await conn.execute(query, params)
                row = await cur.fetchone()
            assert row is not None
            first = int(row[0]) - params["m_n"] + 1
            # The episodes took the seqs up to the counters' new last_seq.
            first_episode = None if row[1] is None else int(row[1]) - len(episodes) + 1
            stats = trusted(
                ThreadStats,
                message_count=int(row[2]),
                total_tokens=int(row[3]),
                version=int(row[4]),
                last_seq=int(row[0]),
            )
            # Each row holds the copy its JSON reads back, never the caller's message.
            stored = [
                trusted(
                    StoredMessage,
                    seq=first + n,
                    message=copy,
                    tokens=count,
                    episode_seq=None if link is None or first_episode is None else first_episode + link,
                )
                for n, ((_, count, copy), link) in enumerate(zip(rows, links, strict=True))
            ]
            return stored, stats
        finally:
            end_write(slot)

    def _append_query(self, *, recording: bool) -> sql.Composed:
        return self._composed(f"append recording={recording}", lambda: self._build_append(recording))

    def _build_append(self, recording: bool) -> sql.Composed:
        threads = sql.SQL(_THREADS_CTE).format(s=self._s)
        if not recording:
            added = sql.SQL(_ADDED_CTE).format(
                s=self._s, episodes=sql.SQL(""), episode_seq=sql.SQL("NULL::bigint")
            )
            return sql.SQL(
                "WITH {}, {} SELECT last_seq, NULL, message_count, total_tokens, version FROM t"
            ).format(threads, added)
        # The counters upsert reads ``t``, so the threads row is locked first.
        record = sql.SQL(_RECORD_CTES).format(s=self._s, source=sql.SQL("FROM t"))
        added = sql.SQL(_ADDED_CTE).format(
            s=self._s, episodes=sql.SQL("e,"), episode_seq=sql.SQL("e.last_seq - %(e_n)s + 1 + u.episode")
        )
        return sql.SQL(
            "WITH {}, {}, {} SELECT t.last_seq, (SELECT last_seq FROM e),"
            " t.message_count, t.total_tokens, t.version FROM t"
        ).format(threads, record, added)

    async def _record_batch(self, thread: str, params: dict[str, Any]) -> tuple[int, datetime]:
        """Record the batch ``params`` holds; the seq and time of its newest episode."""
        newest = "WITH {} SELECT (SELECT max(seq) FROM recorded), (SELECT max(at) FROM recorded)"
        query = self._composed(
            "record",
            lambda: sql.SQL(newest).format(sql.SQL(_RECORD_CTES).format(s=self._s, source=sql.SQL(""))),
        )
        seq, at = await self._one("record", thread, query, params, write=True)
        return int(seq), _as_utc(at)

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        """The working context; with ``max_tokens``, only the newest messages that fit.

        One statement reads the thread's counters and, newest first, a quarter
        more messages than the average message size says will fit, so a
        windowed load reads a bounded number of rows and usually costs one round
        trip. If the guess falls short (uneven sizes), it asks again for more.
        """
        check_thread(thread)
        limit = check_max_tokens(max_tokens)
        percent = 125
        async with self._connection("load", thread) as conn:
            while True:
                params = {"thread": thread, "limit": limit, "percent": percent}
                cur = await conn.execute(self._load_query, params)
                rows = await cur.fetchall()
                window = Window(thread, limit)
                for row in rows:
                    if row[4] is None or not window.offer(row[4], row[5], row[6], row[8]):
                        break
                asked = rows[0][7] if rows else None
                # Within one statement the counters and the rows come from one snapshot.
                if window.full or asked is None or len(rows) < asked:
                    break
                percent *= 4
        stats = ThreadStats() if not rows else _thread_stats(rows[0][:4])
        return ContextWindow(
            thread=thread,
            messages=await _decode(len(rows), window.messages),
            version=stats.version,
            total_tokens=stats.total_tokens,
            complete=not window.full,
            last_seq=stats.last_seq,
        )

    @property
    def _load_query(self) -> sql.Composed:
        return self._q(
            "SELECT t.message_count, t.total_tokens, t.version, t.last_seq, m.seq, m.tokens, m.body, lim.n,"
            " m.episode_seq"
            " FROM {s}.threads t"
            " CROSS JOIN LATERAL (SELECT CASE"
            "  WHEN %(limit)s::bigint IS NULL OR t.total_tokens <= %(limit)s::bigint THEN NULL"
            # numeric, so that a limit near 2**63 cannot overflow the product
            "  ELSE least(div(%(percent)s::numeric * %(limit)s::bigint * t.message_count,"
            "   100 * greatest(t.total_tokens, 1)) + 16, t.message_count + 1)::bigint"
            "  END AS n) lim"
            " LEFT JOIN LATERAL (SELECT seq, tokens, body, episode_seq FROM {s}.messages"
            "  WHERE thread = t.thread ORDER BY seq DESC LIMIT lim.n) m ON true"
            " WHERE t.thread = %(thread)s"
            " ORDER BY m.seq DESC"
        )

    async def tail(self, thread: str, *, after_seq: int) -> ContextWindow:
        """Messages with ``seq > after_seq``, oldest first, with the thread's state, in one statement."""
        check_thread(thread)
        after = check_after_seq(after_seq)
        async with self._connection("tail", thread) as conn:
            cur = await conn.execute(
                self._q(
                    "SELECT t.message_count, t.total_tokens, t.version, t.last_seq,"
                    " m.seq, m.tokens, m.body, m.episode_seq"
                    " FROM {s}.threads t LEFT JOIN {s}.messages m ON m.thread = t.thread AND m.seq > %s"
                    " WHERE t.thread = %s ORDER BY m.seq"
                ),
                (tail_from(after), thread),
            )
            rows = await cur.fetchall()
        stats = ThreadStats() if not rows else _thread_stats(rows[0][:4])
        found = [row[4:] for row in rows if row[4] is not None]
        return ContextWindow(
            thread=thread,
            messages=await _decode(len(found), lambda: tuple(stored_message(thread, *row) for row in found)),
            version=stats.version,
            total_tokens=stats.total_tokens,
            complete=after == 0,
            last_seq=stats.last_seq,
        )

    async def stats(self, thread: str) -> ThreadStats:
        """Message count, token total, version and newest seq, from the thread's row."""
        check_thread(thread)
        async with self._connection("stats", thread) as conn:
            return await self._stats(conn, thread)

    async def _stats(
        self, conn: psycopg.AsyncConnection[Any], thread: str, *, for_update: bool = False
    ) -> ThreadStats:
        cur = await conn.execute(
            self._q(
                "SELECT message_count, total_tokens, version, last_seq FROM {s}.threads WHERE thread = %s"
                + (" FOR UPDATE" if for_update else "")
            ),
            (thread,),
        )
        row = await cur.fetchone()
        return ThreadStats() if row is None else _thread_stats(row)

    async def state(self, thread: str, *, now: datetime | None = None) -> ThreadState:
        """The working context's stats and the episodic pressure, in one statement by primary key."""
        check_thread(thread)
        when = utc(now, "now")
        row = await self._one(
            "state",
            thread,
            self._q(
                "SELECT t.message_count, t.total_tokens, t.version, t.last_seq, "
                f"{_COUNTER_COLUMNS} FROM (SELECT %(thread)s::text AS thread) k"
                " LEFT JOIN {s}.threads t ON t.thread = k.thread"
                " LEFT JOIN {s}.episode_threads e ON e.thread = k.thread"
            ),
            {"thread": thread},
        )
        stats = ThreadStats() if row[0] is None else _thread_stats(row[:4])
        counters = PressureCounters() if row[4] is None else _counters(row[4:])
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
        """Atomically swap every message with ``seq <= through_seq`` for ``replacement``."""
        check_thread(thread)
        check_replace(through_seq, expected_version)
        rows = await off_loop_if_heavy(
            replacement, partial(encode_messages, replacement, tokens, field="replacement")
        )
        async with self._connection("replace_prefix", thread, write=True) as conn, conn.transaction():
            # Locking the thread row waits out in-flight appends and other replacements.
            stats = await self._stats(conn, thread, for_update=True)
            if stats.version != expected_version:
                raise version_conflict(thread, stats.version, expected_version)
            cur = await conn.execute(
                self._q(
                    "WITH gone AS (DELETE FROM {s}.messages WHERE thread = %s AND seq <= %s "
                    "RETURNING seq, tokens) "
                    "SELECT count(*), coalesce(sum(tokens), 0), coalesce(bool_or(seq = %s), false) FROM gone"
                ),
                (thread, through_seq, through_seq),
            )
            row = await cur.fetchone()
            assert row is not None
            removed, removed_tokens, found = int(row[0]), int(row[1]), bool(row[2])
            if not found:
                # Raising rolls the transaction back, so the delete above never happened.
                raise missing_seq_conflict(thread, through_seq)
            await conn.execute(
                self._q(
                    "INSERT INTO {s}.messages (thread, seq, tokens, body) "
                    "SELECT %s, %s + u.n - 1, u.tokens, u.body "
                    "FROM unnest(%s::bigint[], %s::text[]) WITH ORDINALITY AS u(tokens, body, n)"
                ),
                (thread, through_seq - len(rows) + 1, [n for _, n in rows], [body for body, _ in rows]),
            )
            cur = await conn.execute(
                self._q(
                    "UPDATE {s}.threads SET message_count = message_count + %s, "
                    "total_tokens = total_tokens + %s, version = version + 1 WHERE thread = %s "
                    "RETURNING message_count, total_tokens, version, last_seq"
                ),
                (len(rows) - removed, sum(count for _, count in rows) - removed_tokens, thread),
            )
            updated = await cur.fetchone()
            assert updated is not None
        return _thread_stats(updated)

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
        """Record ``checkpoint`` and swap the prefix in one statement; on a conflict, write nothing.

        Every write of the statement is gated on one locked, checked row (the
        thread at ``expected_version``, holding ``through_seq``), so it either
        does all of them or none.
        """
        check_thread(thread)
        check_replace(through_seq, expected_version)
        body = check_checkpoint(checkpoint)
        batch = await off_loop_if_heavy(
            replacement, partial(_message_batch, thread, replacement, tokens, field="replacement")
        )
        summary_at = summary_index(replacement, checkpoint)  # once the batch checked it is messages
        params: dict[str, Any] = {
            "thread": thread,
            "at": None,
            "through_seq": through_seq,
            "expected_version": expected_version,
            "from_seq": checkpoint.from_seq,
            "m_summary": None if summary_at is None else summary_at + 1,
            **batch,
            **_batch([checkpoint], [body]),
        }
        query = self._composed("fold", lambda: self._swap_query(_FOLD_LINK, _FOLD_STANDS_FOR, edit=False))
        version, seq, at, current, found, *_ = await self._one("fold", thread, query, params, write=True)
        if version is None:
            raise _swap_conflict(thread, "fold", current, expected_version, found, through_seq)
        return EpisodeRecord(thread=thread, seq=int(seq), at=_as_utc(at), episode=checkpoint)

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
        """Record ``episodes`` and swap the prefix in one statement; on a conflict, write nothing."""
        check_thread(thread)
        check_replace(through_seq, expected_version)
        recording, kept = await off_loop_if_heavy(
            replacement, encode_edit, episodes, replacement, tokens, message_episodes, stands_for
        )
        params: dict[str, Any] = {
            "thread": thread,
            "at": None,
            "through_seq": through_seq,
            "expected_version": expected_version,
            "from_seq": None,
            **_row_params(thread, [(body, count) for body, count, _ in recording.rows]),
            **_batch(recording.episodes, recording.bodies),
            "m_episodes": recording.links,
            "m_stands_for": kept,
        }
        query = self._composed(
            "record_and_replace", lambda: self._swap_query(_EDIT_LINK, "r.seq = u.stands_for", edit=True)
        )
        version, _, _, current, found, count, total, last_seq = await self._one(
            "record_and_replace", thread, query, params, write=True
        )
        if version is None:
            raise _swap_conflict(thread, "edit", current, expected_version, found, through_seq)
        return _thread_stats((count, total, version, last_seq))

    def _swap_query(self, link: str, stands_for: str, *, edit: bool) -> sql.Composed:
        """``_SWAP`` with its links; an edit's batch may be empty, and then records nothing."""
        source = "FROM guard WHERE %(e_n)s > 0" if edit else "FROM guard"
        return sql.SQL(_SWAP).format(
            s=self._s,
            record=sql.SQL(_RECORD_CTES).format(s=self._s, source=sql.SQL(source)),
            link=sql.SQL(link),
            stands_for=sql.SQL(stands_for),
            columns=sql.SQL(", %(m_episodes)s::bigint[], %(m_stands_for)s::bigint[]" if edit else ""),
            names=sql.SQL(", episode, stands_for" if edit else ""),
        )

    @asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        """Try to become the thread's one compactor, across processes; yields whether it did.

        A lease row that expires ``lease_seconds`` after it was taken, on the
        server's clock; an expired lease is taken over. Each of taking and
        releasing is one statement: nothing is held while the body runs.
        """
        check_thread(thread)
        owner = uuid.uuid4()
        row = await self._one(
            "compaction_lock",
            thread,
            self._q(
                "WITH taken AS (INSERT INTO {s}.compaction_leases AS l (thread, owner, expires_at)"
                " VALUES (%(thread)s, %(owner)s, clock_timestamp() + %(seconds)s * interval '1 second')"
                " ON CONFLICT (thread) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at"
                " WHERE l.expires_at <= clock_timestamp() RETURNING owner)"
                " SELECT EXISTS (SELECT 1 FROM taken)"
            ),
            {"thread": thread, "owner": owner, "seconds": self._lease_seconds},
            write=True,
        )
        if not row[0]:
            yield False
            return
        try:
            yield True
        finally:
            # Shielded, so a cancelled holder still hands the lease back; bounded, since
            # a lease the server never hears about expires by itself.
            limit = self._statement_timeout + 2 * _GRACE_SECONDS
            with anyio.CancelScope(shield=True, deadline=anyio.current_time() + limit):
                if self._pool is not None:
                    await self._one(
                        "compaction_lock release",
                        thread,
                        self._q(
                            "WITH gone AS (DELETE FROM {s}.compaction_leases"
                            " WHERE thread = %s AND owner = %s RETURNING 1)"
                            " SELECT count(*) FROM gone"
                        ),
                        (thread, owner),
                        write=True,
                    )

    # episodic ----------------------------------------------------------------

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        """Append one episode (``at`` defaults to the server's clock) and update the pressure counters."""
        check_thread(thread)
        when = None if at is None else utc(at, "at")
        params = {"thread": thread, "at": when, **_batch([episode])}
        seq, recorded_at = await self._record_batch(thread, params)
        return EpisodeRecord(thread=thread, seq=seq, at=recorded_at, episode=episode)

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        """Episodes of ``thread`` with ``seq >= from_seq``, oldest first, read in batches.

        No connection is held between batches, so a slow consumer does not pin one.
        A ``forget`` of the thread ends the replay: at its next batch (each
        reads the thread's tombstones with its rows), and at its next episode
        when this process forgot it. Its seqs start over, and a replay must
        not splice the new log onto the old one.
        """
        check_thread(thread)
        first = check_from_seq(from_seq)
        count = "(SELECT count(*) FROM {s}.tombstones WHERE thread = %(thread)s)"
        query = self._q(
            f"SELECT seq, at, body, {count} FROM {{s}}.episodes"
            " WHERE thread = %(thread)s AND seq >= %(after)s ORDER BY seq LIMIT %(batch)s"
        )

        async def batch(after: int) -> tuple[int | None, list[tuple[Any, ...]]]:
            async with self._connection("replay", thread) as conn:
                cur = await conn.execute(query, {"thread": thread, "after": after, "batch": _REPLAY_BATCH})
                rows = await cur.fetchall()
            return (rows[0][3] if rows else None), rows

        async def tombstones() -> int | None:
            async with self._connection("replay", thread) as conn:
                cur = await conn.execute(self._q(f"SELECT {count}"), {"thread": thread})
                found = await cur.fetchone()
            return None if found is None else int(found[0])

        # Each row is decoded as it is yielded, so a batch is not decoded on the loop at once; and
        # closed with the replay, so a consumer that stops early leaves no generator to the collector.
        rows = until_forgotten(thread, first, batch, _REPLAY_BATCH, lambda row: int(row[0]), tombstones)
        async with aclosing(rows):
            async for row in rows:
                yield self._episode(thread, row[:3])

    def _episode(self, thread: str, row: tuple[Any, ...]) -> EpisodeRecord:
        seq, at, body = row
        return EpisodeRecord(
            thread=thread, seq=seq, at=_as_utc(at), episode=decode_episode(thread, seq, body)
        )

    async def pressure(
        self,
        thread: str,
        *,
        now: datetime | None = None,
        estimated_context_tokens: int | None = None,
    ) -> EpisodicCompactionPressure:
        """Pressure since the latest boundary, from the thread's counters row."""
        check_thread(thread)
        when = utc(now, "now")
        async with self._connection("pressure", thread) as conn:
            cur = await conn.execute(
                self._q(f"SELECT {_COUNTER_COLUMNS} FROM {{s}}.episode_threads e WHERE thread = %s"),
                (thread,),
            )
            row = await cur.fetchone()
        counters = PressureCounters() if row is None else _counters(row)
        return counters.pressure(when, estimated_context_tokens)

    async def latest_checkpoint(self, thread: str) -> EpisodeRecord | None:
        """The newest summary checkpoint or manual-recovery boundary, found by its remembered seq."""
        check_thread(thread)
        async with self._connection("latest_checkpoint", thread) as conn:
            cur = await conn.execute(
                self._q(
                    "SELECT e.seq, e.at, e.body FROM {s}.episode_threads t"
                    " JOIN {s}.episodes e ON e.thread = t.thread AND e.seq = t.boundary_seq"
                    " WHERE t.thread = %s"
                ),
                (thread,),
            )
            row = await cur.fetchone()
        return None if row is None else self._episode(thread, row)

    # both --------------------------------------------------------------------

    @counted_write
    async def forget(self, thread: str) -> Tombstone:
        """Remove every row of ``thread`` and leave a tombstone, in one transaction.

        The tombstone is written first: the log's trigger lets a DELETE of the
        thread's episodes through only in the transaction that wrote it. The
        thread's counters row stays, emptied and one version on, so a fold read
        before the erasure conflicts and seqs keep counting up.
        """
        check_thread(thread)
        key = {"thread": thread}
        async with self._connection("forget", thread, write=True) as conn, conn.transaction():
            # The same lock order as every other writer: threads row, then counters row.
            await conn.execute(self._q("SELECT 1 FROM {s}.threads WHERE thread = %(thread)s FOR UPDATE"), key)
            await conn.execute(
                self._q("SELECT 1 FROM {s}.episode_threads WHERE thread = %(thread)s FOR UPDATE"), key
            )
            cur = await conn.execute(
                self._q(
                    "INSERT INTO {s}.tombstones (thread, messages, episodes) SELECT %(thread)s,"
                    " (SELECT count(*) FROM {s}.messages WHERE thread = %(thread)s),"
                    " (SELECT count(*) FROM {s}.episodes WHERE thread = %(thread)s)"
                    " RETURNING forgotten_at, messages, episodes"
                ),
                key,
            )
            row = await cur.fetchone()
            assert row is not None
            for statement in (
                "DELETE FROM {s}.messages WHERE thread = %(thread)s",
                "DELETE FROM {s}.episodes WHERE thread = %(thread)s",
                "DELETE FROM {s}.episode_threads WHERE thread = %(thread)s",
                "UPDATE {s}.threads SET message_count = 0, total_tokens = 0, version = version + 1"
                " WHERE thread = %(thread)s",
            ):
                await conn.execute(self._q(statement), key)
        forgot(thread)
        return Tombstone(thread=thread, forgotten_at=_as_utc(row[0]), messages=row[1], episodes=row[2])

    async def tombstones(self, thread: str) -> list[Tombstone]:
        """The tombstones ``forget`` left for ``thread``, oldest first."""
        check_thread(thread)
        async with self._connection("tombstones", thread) as conn:
            cur = await conn.execute(
                self._q(
                    "SELECT forgotten_at, messages, episodes FROM {s}.tombstones"
                    " WHERE thread = %s ORDER BY id"
                ),
                (thread,),
            )
            rows = await cur.fetchall()
        return [
            Tombstone(thread=thread, forgotten_at=_as_utc(at), messages=messages, episodes=episodes)
            for at, messages, episodes in rows
        ]

    async def threads(self) -> list[ThreadInfo]:
        """Every thread with a working context or a log, by last activity, newest first."""
        async with self._connection("threads", "*") as conn:
            cur = await conn.execute(
                self._q(
                    "SELECT coalesce(t.thread, e.thread), coalesce(t.message_count, 0),"
                    " coalesce(t.total_tokens, 0), coalesce(e.last_seq, 0), last.at"
                    " FROM {s}.threads t FULL JOIN {s}.episode_threads e ON e.thread = t.thread"
                    " LEFT JOIN LATERAL (SELECT at FROM {s}.episodes"
                    "  WHERE thread = e.thread AND seq = e.last_seq) last ON true"
                    " WHERE t.message_count > 0 OR e.thread IS NOT NULL"
                    " ORDER BY last.at DESC NULLS LAST, 1"
                )
            )
            rows = await cur.fetchall()
        return [
            ThreadInfo(
                thread=name,
                message_count=count,
                total_tokens=total,
                episodes=episodes,
                last_activity=None if at is None else _as_utc(at),
            )
            for name, count, total, episodes, at in rows
        ]


_DECODE_IN_THREAD = 16
"""Rows beyond which decoding moves to a worker thread, off the event loop."""


async def _decode(rows: int, decode: Callable[[], tuple[StoredMessage, ...]]) -> tuple[StoredMessage, ...]:
    """``decode()``, in a worker thread when it has more than a few rows to parse."""
    if rows <= _DECODE_IN_THREAD:
        return decode()
    return await anyio.to_thread.run_sync(decode)


def _thread_stats(row: Sequence[Any]) -> ThreadStats:
    count, total, version, last_seq = row
    return ThreadStats(message_count=count, total_tokens=total, version=version, last_seq=last_seq)


def _counters(row: Sequence[Any]) -> PressureCounters:
    last_seq, total, since, runs, after, boundary_seq, first_at = row
    return PressureCounters(
        last_seq=last_seq,
        total_user_messages=total,
        user_messages_since_boundary=since,
        run_completed_since_boundary=runs,
        user_messages_after_latest_run_completed=after,
        boundary_seq=boundary_seq,
        first_at=_as_utc(first_at),
    )
