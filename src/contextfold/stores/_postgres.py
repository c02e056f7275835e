"""The PostgreSQL backend: one schema shared by many workers on many hosts.

Needs the ``contextfold[postgres]`` extra (psycopg 3 and psycopg-pool). Every
operation is one short transaction on a pooled connection:

* A thread's working context is a run of ``messages`` rows keyed by
  ``(thread, seq)``; its ``threads`` row holds the counters ``stats()`` reads
  and is row-locked by every append and prefix replacement, so writers on any
  host get distinct sequence numbers and a replacement sees a stable prefix.
* The episodic log is the ``episodes`` table; a trigger makes the database
  refuse UPDATE, DELETE and TRUNCATE on it. Pressure counters live in
  ``episode_threads`` and change in the same statement that appends the episode.
* ``compaction_lock`` is a session advisory lock on a connection held for the
  body; the server releases it when a crashed holder's connection drops. It
  needs session-level pooling if a pooler sits in between.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Self

import anyio
import psycopg
from anyio.lowlevel import checkpoint
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from .._episodes import (
    Episode,
    EpisodeRecord,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    UserMessageEpisode,
)
from .._errors import ConfigError, ConflictError, StoreClosedError, StoreError
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
    utc,
)

__all__ = ["PostgresStore"]

SCHEMA_VERSION = 1
"""The newest schema this code writes; a database at a higher version is refused."""

_REPLAY_BATCH = 500
_CONNECT_TIMEOUT_SECONDS = 10
_UNLOCK_SECONDS = 10
_IDENTIFIER_MAX_BYTES = 63

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
)
assert len(_MIGRATIONS) == SCHEMA_VERSION


def _key(*parts: str) -> int:
    """A stable signed 64-bit advisory-lock key (Python's ``hash`` differs per process)."""
    digest = hashlib.blake2b("\x00".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _where(dsn: str) -> str:
    """``host:port/dbname`` of a DSN, without credentials, for error messages."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or 5432)
    dbname = str(params.get("dbname") or params.get("user") or "")
    return f"{host}:{port}/{dbname}"


def _as_utc(moment: datetime) -> datetime:
    """A timestamptz read back, in UTC whatever the session's time zone."""
    return moment.astimezone(UTC)


class PostgresStore(AsyncResource):
    """Both stores on PostgreSQL, for many workers on many hosts.

    ``schema`` is created (with its tables) on open if missing, and migrated;
    concurrent first opens are serialized by an advisory lock. The pool keeps
    between ``min_size`` and ``max_size`` connections; ``compaction_lock``
    holds one for its body, so ``max_size`` must be at least 2.
    """

    def __init__(
        self, dsn: str, *, schema: str = "contextfold", min_size: int = 1, max_size: int = 10
    ) -> None:
        if not isinstance(dsn, str) or not dsn.strip():
            raise ConfigError(
                "dsn", "must be a PostgreSQL URL such as postgresql://user@host:5432/dbname", value=dsn
            )
        try:
            given = conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as exc:
            raise ConfigError(
                "dsn", f"is not a valid PostgreSQL connection string ({exc})", value="<hidden>"
            ) from None
        if not isinstance(schema, str) or not schema or "\x00" in schema:
            raise ConfigError("schema", "must be a non-empty name such as 'contextfold'", value=schema)
        if len(schema.encode()) > _IDENTIFIER_MAX_BYTES:
            raise ConfigError(
                "schema",
                f"PostgreSQL names are at most {_IDENTIFIER_MAX_BYTES} bytes; shorten it",
                value=schema,
            )
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ConfigError("min_size", "must be a whole number >= 0", value=min_size)
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < max(2, min_size):
            raise ConfigError(
                "max_size",
                f"must be >= 2 and >= min_size ({min_size}): compaction_lock holds one connection "
                "while the compaction writes through another",
                value=max_size,
            )
        self._dsn = dsn
        # Defaults for what neither the DSN nor the PG* environment says.
        self._connect_options: dict[str, Any] = {"fallback_application_name": "contextfold"}
        if "connect_timeout" not in given and "PGCONNECT_TIMEOUT" not in os.environ:
            self._connect_options["connect_timeout"] = _CONNECT_TIMEOUT_SECONDS
        self._schema = schema
        self._min_size = min_size
        self._max_size = max_size
        self._s = sql.Identifier(schema)
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
        self._closed = False
        self._opening = anyio.Lock()

    def __repr__(self) -> str:
        return f"PostgresStore({_where(self._dsn)!r}, schema={self._schema!r})"

    # lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create or migrate the schema, and start the pool; a second call does nothing."""
        async with self._opening:
            if self._closed:
                raise StoreClosedError(f"{self!r} was closed; create a new PostgresStore")
            if self._pool is None:
                await self._open()

    async def _open(self) -> None:
        try:
            conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True, **self._connect_options)
        except psycopg.OperationalError as exc:
            raise StoreError(
                f"cannot connect to PostgreSQL at {_where(self._dsn)}: {str(exc).strip()}; "
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
        self._pool = pool

    async def aclose(self) -> None:
        """Close the pool; later calls raise ``StoreClosedError``. Closing twice is fine."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

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
        """
        pool = self._require_open(action)
        # The pool hands out an idle connection without yielding, so this is where a
        # caller cancelled before the call began is stopped before anything is sent.
        await checkpoint()
        try:
            try:
                conn = await pool.getconn()
            except PoolClosed as exc:
                raise StoreClosedError(f"{self!r} was closed during {action} of thread {thread!r}") from exc
            except PoolTimeout as exc:
                raise StoreError(
                    f"no PostgreSQL connection free for {action} of thread {thread!r} "
                    f"(pool max_size={self._max_size}); raise max_size or hold fewer compaction locks"
                ) from exc
            try:
                with anyio.CancelScope(shield=write):
                    yield conn
            finally:
                # Shielded: a cancellation landing while the pool takes the connection
                # back would leave it neither pooled nor closed, a pool slot lost for good.
                # The pool rolls back an open transaction and replaces a broken connection.
                with anyio.CancelScope(shield=True):
                    await pool.putconn(conn)
        except psycopg.Error as exc:
            raise StoreError(
                f"PostgreSQL failed during {action} of thread {thread!r}: {str(exc).strip()}"
            ) from exc

    def _q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(s=self._s)

    # short-term --------------------------------------------------------------

    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        """Append messages (with their token counts) after the newest one; return them stored."""
        check_thread(thread)
        rows = encode_messages(messages, tokens)
        if not rows:
            self._require_open("append")
            return []
        counts = [count for _, count in rows]
        # One statement, one round trip: the upsert row-locks the thread, so concurrent
        # appenders get disjoint seqs, and both inserts commit together or not at all.
        query = self._q(
            "WITH t AS ("
            " INSERT INTO {s}.threads AS t (thread, message_count, total_tokens, last_seq)"
            " VALUES (%(thread)s, %(n)s, %(total)s, %(n)s) ON CONFLICT (thread) DO UPDATE SET"
            "  message_count = t.message_count + EXCLUDED.message_count,"
            "  total_tokens = t.total_tokens + EXCLUDED.total_tokens,"
            "  last_seq = t.last_seq + EXCLUDED.last_seq"
            " RETURNING last_seq),"
            " added AS ("
            " INSERT INTO {s}.messages (thread, seq, tokens, body)"
            " SELECT %(thread)s, t.last_seq - %(n)s + u.n, u.tokens, u.body"
            " FROM t, unnest(%(tokens)b::integer[], %(bodies)b::text[])"
            "  WITH ORDINALITY AS u(tokens, body, n))"
            " SELECT last_seq FROM t"
        )
        params = {
            "thread": thread,
            "n": len(rows),
            "total": sum(counts),
            "tokens": counts,
            "bodies": [body for body, _ in rows],
        }
        async with self._connection("append", thread, write=True) as conn:
            cur = await conn.execute(query, params)
            last = await cur.fetchone()
        assert last is not None
        first = int(last[0]) - len(rows) + 1
        return [
            StoredMessage(seq=first + n, message=message, tokens=count)
            for n, (message, count) in enumerate(zip(messages, counts, strict=True))
        ]

    async def _insert_messages(
        self, conn: psycopg.AsyncConnection[Any], thread: str, first: int, rows: list[tuple[str, int]]
    ) -> None:
        await conn.execute(
            self._q(
                "INSERT INTO {s}.messages (thread, seq, tokens, body) "
                "SELECT %s, %s + u.n - 1, u.tokens, u.body "
                "FROM unnest(%b::integer[], %b::text[]) WITH ORDINALITY AS u(tokens, body, n)"
            ),
            (thread, first, [count for _, count in rows], [body for body, _ in rows]),
        )

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
                    if row[4] is None or not window.offer(row[4], row[5], row[6]):
                        break
                asked = rows[0][7] if rows else None
                # Within one statement the counters and the rows come from one snapshot.
                if window.full or asked is None or len(rows) < asked:
                    break
                percent *= 4
        stats = ThreadStats() if not rows else _thread_stats(rows[0][:4])
        return ContextWindow(
            thread=thread,
            messages=window.messages(),
            version=stats.version,
            total_tokens=stats.total_tokens,
            complete=not window.full,
        )

    @property
    def _load_query(self) -> sql.Composed:
        return self._q(
            "SELECT t.message_count, t.total_tokens, t.version, t.last_seq, m.seq, m.tokens, m.body, lim.n"
            " FROM {s}.threads t"
            " CROSS JOIN LATERAL (SELECT CASE"
            "  WHEN %(limit)s::bigint IS NULL OR t.total_tokens <= %(limit)s::bigint THEN NULL"
            "  ELSE %(percent)s::bigint * %(limit)s::bigint * t.message_count"
            "   / (100 * greatest(t.total_tokens, 1)) + 16"
            "  END AS n) lim"
            " LEFT JOIN LATERAL (SELECT seq, tokens, body FROM {s}.messages"
            "  WHERE thread = t.thread ORDER BY seq DESC LIMIT lim.n) m ON true"
            " WHERE t.thread = %(thread)s"
            " ORDER BY m.seq DESC"
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
        rows = encode_messages(replacement, tokens, field="replacement")
        async with self._connection("replace_prefix", thread, write=True) as conn, conn.transaction():
            # Locking the thread row waits out in-flight appends and other replacements.
            stats = await self._stats(conn, thread, for_update=True)
            if stats.version != expected_version:
                raise ConflictError(
                    f"thread {thread!r} is at version {stats.version}, not {expected_version}: another "
                    "compaction replaced its prefix since it was loaded; load it again and retry"
                )
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
                raise ConflictError(
                    f"thread {thread!r} holds no message with seq {through_seq}; load it again and "
                    "cut at a seq the window returned"
                )
            await self._insert_messages(conn, thread, through_seq - len(rows) + 1, rows)
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

    @asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        """Try to become the thread's one compactor, across processes; yields whether it did."""
        check_thread(thread)
        key = _key("contextfold.compaction", self._schema, thread)
        async with self._connection("compaction_lock", thread) as conn:
            # Shielded so that whether the session took the lock is always known, and the
            # unlock below runs for it (the query never waits: it is a try).
            with anyio.CancelScope(shield=True):
                cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
                row = await cur.fetchone()
            acquired = bool(row and row[0])
            try:
                yield acquired
            finally:
                if acquired:
                    # Shielded, so a cancelled holder still unlocks before the connection, which
                    # would otherwise carry the session lock, goes back to the pool. Should the
                    # server not answer in time, the cancelled query makes psycopg close the
                    # connection, and the server drops the lock with the session.
                    with anyio.CancelScope(shield=True, deadline=anyio.current_time() + _UNLOCK_SECONDS):
                        await conn.execute("SELECT pg_advisory_unlock(%s)", (key,))

    # episodic ----------------------------------------------------------------

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        """Append one episode (``at`` defaults to the server's clock) and update the pressure counters."""
        check_thread(thread)
        when = None if at is None else utc(at, "at")
        body = encode_episode(episode)
        # A first episode's counters come from the shared arithmetic; a later one's must be
        # computed by the server, against the locked row, to stay one round trip.
        first = PressureCounters().after(episode, when or datetime.now(UTC))
        params = {
            "thread": thread,
            "at": when,
            "kind": episode.kind,
            "body": body,
            "user": int(isinstance(episode, UserMessageEpisode)),
            "clean_run": isinstance(episode, RunCompletedEpisode) and episode.clean,
            "boundary": isinstance(episode, SummaryCheckpoint | ManualRecoveryBoundary),
            "f_total": first.total_user_messages,
            "f_since": first.user_messages_since_boundary,
            "f_runs": first.run_completed_since_boundary,
            "f_after": first.user_messages_after_latest_run_completed,
            "f_boundary": first.boundary_seq,
        }
        query = self._q(
            "WITH t AS ("
            " INSERT INTO {s}.episode_threads AS e (thread, last_seq, first_at, total_user_messages,"
            "  user_messages_since_boundary, run_completed_since_boundary,"
            "  user_messages_after_latest_run_completed, boundary_seq)"
            " VALUES (%(thread)s, 1, coalesce(%(at)s, now()), %(f_total)s, %(f_since)s, %(f_runs)s,"
            "  %(f_after)s, %(f_boundary)s)"
            " ON CONFLICT (thread) DO UPDATE SET"
            "  last_seq = e.last_seq + 1,"
            "  total_user_messages = e.total_user_messages + %(user)s,"
            "  user_messages_since_boundary = CASE WHEN %(boundary)s THEN 0"
            "   ELSE e.user_messages_since_boundary + %(user)s END,"
            "  run_completed_since_boundary = CASE WHEN %(boundary)s THEN 0"
            "   WHEN %(clean_run)s THEN e.run_completed_since_boundary + 1"
            "   ELSE e.run_completed_since_boundary END,"
            "  user_messages_after_latest_run_completed = CASE WHEN %(boundary)s OR %(clean_run)s THEN 0"
            "   ELSE e.user_messages_after_latest_run_completed + %(user)s END,"
            "  boundary_seq = CASE WHEN %(boundary)s THEN e.last_seq + 1 ELSE e.boundary_seq END"
            " RETURNING last_seq)"
            " INSERT INTO {s}.episodes (thread, seq, at, kind, body)"
            " SELECT %(thread)s, t.last_seq, coalesce(%(at)s, now()), %(kind)s, %(body)s FROM t"
            " RETURNING seq, at"
        )
        async with self._connection("record", thread, write=True) as conn:
            # One statement, so the counters and the episode commit together or not at all.
            cur = await conn.execute(query, params)
            row = await cur.fetchone()
        assert row is not None
        return EpisodeRecord(thread=thread, seq=row[0], at=_as_utc(row[1]), episode=episode)

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        """Episodes of ``thread`` with ``seq >= from_seq``, oldest first, read in batches.

        No connection is held between batches, so a slow consumer does not pin one.
        """
        check_thread(thread)
        after = check_from_seq(from_seq)
        query = self._q(
            "SELECT seq, at, body FROM {s}.episodes WHERE thread = %s AND seq >= %s ORDER BY seq LIMIT %s"
        )
        while True:
            async with self._connection("replay", thread) as conn:
                cur = await conn.execute(query, (thread, after, _REPLAY_BATCH))
                rows = await cur.fetchall()
            for row in rows:
                yield self._episode(thread, row)
            if len(rows) < _REPLAY_BATCH:
                return
            after = rows[-1][0] + 1

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
                self._q(
                    "SELECT last_seq, total_user_messages, user_messages_since_boundary,"
                    " run_completed_since_boundary, user_messages_after_latest_run_completed,"
                    " boundary_seq, first_at FROM {s}.episode_threads WHERE thread = %s"
                ),
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


def _thread_stats(row: Sequence[Any]) -> ThreadStats:
    count, total, version, last_seq = row
    return ThreadStats(message_count=count, total_tokens=total, version=version, last_seq=last_seq)


def _counters(row: tuple[Any, ...]) -> PressureCounters:
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
