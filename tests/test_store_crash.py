"""Killing a process in the middle of its writes, many times: no torn thread, nothing lost.

Two tests. The first kills a churning child at random moments; the second
kills a child at each chosen point inside one ``replace_prefix`` and checks
the exact state it must leave (see the second half of this module).

In the first, a child process loops: record three user messages, append them, take the
compaction lock and fold the older half of the thread into a summary (record
a ``SummaryCheckpoint``, then ``replace_prefix``). The test SIGKILLs it at a
random moment, reopens the database and checks the thread, then starts the
next child on the same data.

The episode is recorded before the message is appended, as the product does,
so a kill between the two may leave the newest recorded messages out of the
working context: the check allows that only for a tail of the log, once.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import test_store_concurrency as concurrency
from contextfold import SUMMARY_METADATA_KEY, Message, SummaryCheckpoint, UserMessageEpisode
from contextfold.stores import ContextWindow, SQLiteStore, StoredMessage
from test_store_concurrency import COVERS, fold_once, message_id

pytestmark = pytest.mark.slow

ROUNDS = 20
BATCH = 3
THREAD = "crash 'test' ✓"

Target = dict[str, str]


def open_target(target: Target, *, clock_offset: float = 0.0) -> Any:
    if target["backend"] == "sqlite":
        return SQLiteStore(target["path"], clock=lambda: time.time() + clock_offset)
    from contextfold.stores import PostgresStore

    return PostgresStore(target["url"], schema=target["schema"], min_size=1, max_size=3)


target = concurrency.target  # the same fresh SQLite file or PostgreSQL schema per test


async def churn(target: Target, started: Any) -> None:
    async with open_target(target) as store:
        while True:
            batch = [Message.user("hello", metadata={"id": uuid.uuid4().hex}) for _ in range(BATCH)]
            for message in batch:
                await store.record(THREAD, UserMessageEpisode(message=message))
            await store.append(THREAD, batch, [2] * BATCH)
            async with store.compaction_lock(THREAD) as mine:
                if mine:
                    await fold_once(store, THREAD)
            started.set()


def churn_in_process(target: Target, started: Any) -> None:
    anyio.run(churn, target, started)


@dataclass
class Seen:
    """What earlier rounds found, which a later round must still find."""

    log: list[str] = field(default_factory=list)
    present: set[str] = field(default_factory=set)
    orphans: set[str] = field(default_factory=set)
    version: int = 0


async def check_thread(store: Any, seen: Seen) -> None:
    window = await store.load(THREAD)
    stats = await store.stats(THREAD)
    seqs = [m.seq for m in window.messages]
    assert seqs == sorted(set(seqs))
    assert stats.message_count == len(window.messages)
    assert stats.total_tokens == sum(window.tokens) == window.total_tokens
    assert stats.last_seq == (seqs[-1] if seqs else 0)
    assert stats.version >= seen.version
    summaries = [m for m in window.plain if m.is_summary]
    assert len(summaries) <= 1 and (not summaries or window.plain[0].is_summary)

    present = {message_id(m) for m in window.plain if not m.is_summary}
    folded = set(summaries[0].metadata[COVERS]) if summaries else set()
    assert not present & folded
    present |= folded
    assert present >= seen.present, "a message that was in the thread is gone"

    records = [record async for record in store.replay(THREAD)]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    log = [message_id(r.episode.message) for r in records if isinstance(r.episode, UserMessageEpisode)]
    assert log[: len(seen.log)] == seen.log, "the episodic log lost or changed an episode"
    checkpoints = sum(isinstance(r.episode, SummaryCheckpoint) for r in records)
    assert checkpoints >= stats.version, "a prefix was replaced without a recorded checkpoint"

    assert present <= set(log), "a message reached the working context without its episode"
    new_orphans = [key for key in log if key not in present and key not in seen.orphans]
    assert len(new_orphans) <= BATCH
    assert log[len(log) - len(new_orphans) :] == new_orphans, "only the newest episodes may miss the context"
    seen.log, seen.present, seen.version = log, present, stats.version
    seen.orphans.update(new_orphans)


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_sigkill_mid_write_never_tears_a_thread(target: Target) -> None:
    """After each of many SIGKILLs at random points, the thread is whole and nothing recorded is missing."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["contextfold", "test_store_crash"])
    rng = random.Random(20261130)
    seen = Seen()
    async with open_target(target):
        pass  # creates the schema once, before the first child
    for _ in range(ROUNDS):
        started = context.Event()
        child = context.Process(target=churn_in_process, args=(target, started), daemon=True)
        child.start()
        try:
            assert await anyio.to_thread.run_sync(started.wait, 60), "the child never got going"
            # A random moment within the child's next few operations.
            await anyio.sleep(rng.uniform(0, 0.05))
        finally:
            os.kill(child.pid or 0, signal.SIGKILL)
            await anyio.to_thread.run_sync(child.join)
        assert child.exitcode == -signal.SIGKILL

        async with open_target(target) as store:
            await check_thread(store, seen)
        if target["backend"] == "sqlite":
            # The killed child may have held the lease; once it expires another worker takes over.
            async with open_target(target, clock_offset=301) as later, later.compaction_lock(THREAD) as mine:
                assert mine
    assert seen.version > 0, "no prefix replacement ever committed"


# Killing at chosen points inside replace_prefix -------------------------------------------
#
# Each round a child appends messages, loads the thread, records a checkpoint and
# tells the parent what it read and what it will write; then it calls
# replace_prefix and is SIGKILLed at one chosen point inside it. Whether the
# kill came before the commit was sent decides which state the parent must find:
# exactly the window the child read, or exactly that window with its prefix
# replaced.

# SQLite: the child kills itself from the connection's own hooks, at the start of
# the n-th statement of the replacement (BEGIN ... COMMIT), or after its n-th VM
# instruction (inside the DELETE or the INSERT).
SQLITE_POINTS = [*(("statement", n) for n in range(1, 9)), *(("step", n) for n in (5, 60, 200, 600))]

# PostgreSQL: triggers in the test's schema make the child's server session wait on
# an advisory lock the parent holds, at one point of the replacement; the parent
# kills the child while it waits, then lets the session go on to find its client gone.
POSTGRES_POINTS = ["before_delete", "mid_delete", "after_insert", "after_counters", "at_commit"]


def _point_lock(schema: str) -> int:
    """The advisory lock key of one test's points; its own, so parallel runs do not wait on each other."""
    return int(uuid.uuid5(uuid.NAMESPACE_URL, schema).hex[:15], 16)


def _postgres_hooks(lock: int) -> list[str]:
    return [
        "CREATE TABLE crash_point (name text PRIMARY KEY)",
        # The store's sessions do not have the test's schema on their search path; the function does.
        f"""CREATE FUNCTION crash_wait() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
        DECLARE
            deleted int;
        BEGIN
            IF TG_ARGV[0] = 'before_delete' THEN
                PERFORM set_config('contextfold_test.replacing', 'on', true);
            ELSIF coalesce(current_setting('contextfold_test.replacing', true), '') <> 'on' THEN
                RETURN NULL;
            END IF;
            IF TG_ARGV[0] = 'mid_delete' THEN
                deleted := coalesce(nullif(current_setting('contextfold_test.deleted', true), ''), '0')::int;
                deleted := deleted + 1;
                PERFORM set_config('contextfold_test.deleted', deleted::text, true);
                IF deleted <> 2 THEN  -- wait at the second row, with the first one deleted
                    RETURN OLD;
                END IF;
            END IF;
            IF EXISTS (SELECT 1 FROM crash_point WHERE name = TG_ARGV[0]) THEN
                PERFORM pg_advisory_xact_lock_shared({lock});
            END IF;
            RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
        END $$""",
        "CREATE TRIGGER crash_before_delete BEFORE DELETE ON messages "
        "FOR EACH STATEMENT EXECUTE FUNCTION crash_wait('before_delete')",
        "CREATE TRIGGER crash_mid_delete BEFORE DELETE ON messages "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('mid_delete')",
        "CREATE TRIGGER crash_after_insert AFTER INSERT ON messages "
        "FOR EACH STATEMENT EXECUTE FUNCTION crash_wait('after_insert')",
        "CREATE TRIGGER crash_after_counters AFTER UPDATE ON threads "
        "FOR EACH STATEMENT EXECUTE FUNCTION crash_wait('after_counters')",
        "CREATE CONSTRAINT TRIGGER crash_at_commit AFTER UPDATE ON threads DEFERRABLE INITIALLY DEFERRED "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('at_commit')",
    ]


def _arm_sqlite(store: Any, point: tuple[str, int], tell: Any) -> None:
    kind, at = point
    seen = 0

    def die(where: str) -> None:
        tell.send(("killed", where))
        os.kill(os.getpid(), signal.SIGKILL)

    def statement(text: str) -> None:
        nonlocal seen
        seen += 1
        if seen == at:
            die(f"at the start of statement {at}: {text.split()[0]}")

    def step() -> int:
        nonlocal seen
        seen += 1
        if seen == at:
            die(f"after VM instruction {at}")
        return 0

    if kind == "statement":
        store._conn.set_trace_callback(statement)
    else:
        store._conn.set_progress_handler(step, 1)


async def replace_then_die(target: Target, point: Any, tell: Any) -> None:
    async with open_target(target) as store:
        batch = [Message.user(f"m{n}", metadata={"id": uuid.uuid4().hex}) for n in range(6)]
        for message in batch:
            await store.record(THREAD, UserMessageEpisode(message=message))
        await store.append(THREAD, batch, [2] * len(batch))
        window = await store.load(THREAD)
        cut = window.messages[: len(window.messages) // 2]
        through = cut[-1].seq
        covered: list[str] = []
        for stored in cut:
            message = stored.message
            covered += message.metadata[COVERS] if message.is_summary else [message_id(message)]
        summary = Message.system("so far", metadata={SUMMARY_METADATA_KEY: True, COVERS: covered})
        checkpoint = SummaryCheckpoint(trigger="test", from_seq=cut[0].seq, through_seq=through, summary="s")
        recorded = await store.record(THREAD, checkpoint)
        tell.send(("before", window.model_dump_json(), through, summary.model_dump_json(), recorded.seq))
        if target["backend"] == "sqlite" and point != "never":
            _arm_sqlite(store, point, tell)
        await store.replace_prefix(
            THREAD, through_seq=through, expected_version=window.version, replacement=[summary], tokens=[1]
        )
        tell.send(("returned", "after replace_prefix returned"))
        os.kill(os.getpid(), signal.SIGKILL)


def replace_then_die_in_process(target: Target, point: Any, tell: Any) -> None:
    anyio.run(replace_then_die, target, point, tell)


async def _raw(url: str, schema: str, statements: Sequence[str]) -> list[tuple[Any, ...]]:
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        rows: list[tuple[Any, ...]] = []
        for statement in statements:
            cur = await conn.execute(statement)  # type: ignore[arg-type]
            rows = await cur.fetchall() if cur.description else []
        return rows


async def _wait_for_sessions(url: str, app: str, *, waiting: bool) -> None:
    """Until the child's server session waits on the point's lock, or until it has no session left."""
    condition = "wait_event = 'advisory'" if waiting else "true"
    query = f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}' AND {condition}"
    with anyio.fail_after(30):
        while ((await _raw(url, "public", [query]))[0][0] > 0) != waiting:
            await anyio.sleep(0.01)  # polling the server's view of another process


@dataclass
class Killer:
    """Runs one child to its chosen point and reports what it said and whether its commit was sent."""

    target: Target
    context: Any
    holder: Any = None
    """PostgreSQL only: the parent's connection that holds the point's advisory lock."""
    app: str = field(default_factory=lambda: f"cf_crash_{uuid.uuid4().hex[:8]}")

    async def round(self, point: Any) -> tuple[list[Any], bool]:
        child_target = dict(self.target)
        if self.holder is not None:
            child_target["url"] = f"{self.target['url']}?application_name={self.app}"
            await _raw(self.target["url"], self.target["schema"], [
                "DELETE FROM crash_point", f"INSERT INTO crash_point VALUES ('{point}')"
            ])
            await self.holder.execute(f"SELECT pg_advisory_lock({_point_lock(self.target['schema'])})")
        ours, theirs = self.context.Pipe(duplex=False)
        child = self.context.Process(
            target=replace_then_die_in_process, args=(child_target, point, theirs), daemon=True
        )
        child.start()
        theirs.close()
        try:
            if self.holder is not None and point != "never":
                await _wait_for_sessions(self.target["url"], self.app, waiting=True)
                os.kill(child.pid or 0, signal.SIGKILL)
        finally:
            await anyio.to_thread.run_sync(child.join, 60)
            if self.holder is not None:
                await self.holder.execute(f"SELECT pg_advisory_unlock({_point_lock(self.target['schema'])})")
        assert child.exitcode == -signal.SIGKILL
        told = []
        with ours:
            while True:
                try:
                    told.append(ours.recv())
                except EOFError:  # everything the dead child sent has been read
                    break
        if self.holder is None:
            return told, told[-1][0] == "returned"
        # The session goes on once unlocked, finds its client gone and ends: rolled back,
        # unless the client had already sent COMMIT.
        await _wait_for_sessions(self.target["url"], self.app, waiting=False)
        return told, point in ("never", "at_commit")


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_sigkill_at_each_step_of_a_replacement_leaves_old_or_new(target: Target) -> None:
    """Killed at each step of replace_prefix, the thread is exactly as read, or as replaced if committed."""
    import psycopg

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["contextfold", "test_store_crash"])
    async with open_target(target):
        pass  # creates the schema
    killer = Killer(target, context)
    points: list[Any] = [*SQLITE_POINTS, "never"]
    if target["backend"] == "postgres":
        points = [*POSTGRES_POINTS, "never"]
        await _raw(target["url"], target["schema"], _postgres_hooks(_point_lock(target["schema"])))
        killer.holder = await psycopg.AsyncConnection.connect(target["url"], autocommit=True)
    outcomes: dict[str, str] = {}
    log: list[Any] = []
    try:
        for point in points:
            told, committed = await killer.round(point)
            _, read, through, summary, checkpoint_seq = told[0]
            # A PostgreSQL child is killed from outside, so its last word is "before".
            last = "returned" if point == "never" else "killed" if killer.holder is None else "before"
            assert told[-1][0] == last, f"{point}: the child's last word was {told[-1]}"

            before = ContextWindow.model_validate_json(read)
            async with open_target(target) as store:
                after = await store.load(THREAD)
                records = [r async for r in store.replay(THREAD)]
            if committed:
                folded = StoredMessage(seq=through, message=Message.model_validate_json(summary), tokens=1)
                kept = tuple(m for m in before.messages if m.seq > through)
                assert after.messages == (folded, *kept), f"{point}: not the replaced thread"
                assert after.version == before.version + 1
            else:
                assert after == before, f"{point}: the thread changed though the commit was never sent"
            assert records[: len(log)] == log, "the episodic log lost or changed an episode"
            assert records[checkpoint_seq - 1].episode.kind == "summary_checkpoint"
            log = records
            outcomes[str(point)] = "new" if committed else "old"
    finally:
        if killer.holder is not None:
            await killer.holder.close()
    assert set(outcomes.values()) == {"old", "new"}, outcomes
