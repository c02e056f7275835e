"""Killing a process in the middle of its writes, many times: no torn thread, log and context agree.

Three tests per SQL backend:

* a churning child (``record_and_append`` of a step, then a lease and a
  ``fold``) is SIGKILLed at random moments, and after each kill the thread
  must pass :func:`check_agreement`;
* a child is SIGKILLed at chosen points inside one ``record_and_append`` or
  one ``fold`` (see the second half of this module), and the thread must be
  exactly as it was before the call, or exactly as the call would leave it;
* a child holding a short compaction lease is SIGKILLed, and another worker
  takes the thread over once the lease has run out.

The working context and the log agree when the context is the latest
checkpoint's summary followed by exactly the message episodes recorded after
what that checkpoint covers (``log_through_seq``), each row pointing at the
episode that recorded it; and every checkpoint in the log was applied.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

import test_store_concurrency as concurrency
from contextfold import Message
from contextfold._episodes import EpisodeRecord
from contextfold.episodes import SummaryCheckpoint, UserMessageEpisode
from contextfold.messages import SUMMARY_METADATA_KEY
from contextfold.stores import SQLiteStore
from test_sqlite_store import thread_settled
from test_store_concurrency import Snapshot, check_agreement, plan_fold

pytestmark = pytest.mark.slow

# Enough random moments to land in records and folds alike; the chosen points below cover each statement.
RANDOM_KILLS = 40
STEP = 3
THREAD = "crash 'test' ✓"
LEASE_SECONDS = 0.3
# Imported once by the fork server, not by every child (pytest and psycopg take ~0.5 s).
PRELOAD = ["__main__", "contextfold", "contextfold.stores._postgres", "test_store_crash"]

Target = dict[str, str]

target = concurrency.target  # the same fresh SQLite file or PostgreSQL schema per test


def open_target(target: Target, *, app: str | None = None, lease_seconds: float = LEASE_SECONDS) -> Any:
    if target["backend"] == "sqlite":
        return SQLiteStore(target["path"], lease_seconds=lease_seconds)
    if target["backend"] == "sqlite-normal":  # a step's writes commit on the loop's own connection
        return SQLiteStore(target["path"], lease_seconds=lease_seconds, synchronous="NORMAL")
    from contextfold.stores import PostgresStore

    params = [f"application_name={app}"] if app else []
    if target.get("check_client"):
        params.append("options=-c%20client_connection_check_interval%3D20")
    url = target["url"] + ("?" + "&".join(params) if params else "")
    return PostgresStore(url, schema=target["schema"], min_size=1, max_size=3, lease_seconds=lease_seconds)


def step_messages(count: int = STEP) -> list[Message]:
    return [Message.user(f"hello {uuid.uuid4().hex[:8]}") for _ in range(count)]


async def record_step(store: Any, messages: Sequence[Message]) -> None:
    await concurrency.record_step(store, THREAD, messages)


async def snapshot(store: Any) -> Snapshot:
    return await concurrency.snapshot(store, THREAD)


async def churn(target: Target, app: str, started: Any) -> None:
    async with open_target(target, app=app) as store:
        while True:
            await record_step(store, step_messages())
            async with store.compaction_lock(THREAD) as mine:
                if mine:
                    window = await store.load(THREAD)
                    if len(window.messages) >= 2 * STEP:
                        await store.fold(THREAD, **plan_fold(window))
            started.set()


def churn_in_process(target: Target, app: str, started: Any) -> None:
    anyio.run(churn, target, app, started)


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_sigkill_at_random_moments_never_tears_a_thread(target: Target) -> None:
    """After each of many SIGKILLs at random moments, the thread is whole and agrees with its log."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    rng = random.Random(20261201)
    previous: list[EpisodeRecord] = []
    version = 0
    async with open_target(target) as store:
        for _ in range(RANDOM_KILLS):
            started = context.Event()
            app = f"cf_churn_{uuid.uuid4().hex[:8]}"
            child = context.Process(target=churn_in_process, args=(target, app, started), daemon=True)
            child.start()
            try:
                assert await anyio.to_thread.run_sync(started.wait, 60), "the child never got going"
                # A random moment within the child's next few operations.
                await anyio.sleep(rng.uniform(0, 0.03))
            finally:
                os.kill(child.pid or 0, signal.SIGKILL)
                await anyio.to_thread.run_sync(child.join)
            assert child.exitcode == -signal.SIGKILL
            if target["backend"] == "postgres":
                # A statement the child had sent still runs to its end on the server.
                await _wait_for_sessions(target["url"], app, waiting=False)

            seen = await snapshot(store)
            check_agreement(seen)
            assert seen.records[: len(previous)] == previous, "the episodic log lost or changed an episode"
            assert seen.window.version >= version
            previous, version = seen.records, seen.window.version
    assert version > 0, "no fold ever committed"


# Killing at chosen points inside record_and_append and fold -------------------------------
#
# Each round the parent snapshots the thread, and a child makes one call (a step's
# record_and_append, or a fold of the older half) after telling the parent what it
# will write; it is SIGKILLed at one chosen point inside the call. Afterwards the
# thread must be exactly the snapshot, or exactly the snapshot with the call applied.

# SQLite: the child kills itself from the writing connection's own hooks, at the start
# of the n-th statement of the call (BEGIN ... COMMIT), or after its n-th VM instruction.
# A first, unkilled call of each kind counts both, and the points are spread over them.
SQLITE_STEP_POINTS = 8

# PostgreSQL: triggers in the test's schema make the child's server session wait on an
# advisory lock the parent holds, at one point of the call's statement; the parent kills
# the child while it waits, then lets the session go on. A session that checks its
# client (client_connection_check_interval) rolls back; one that does not runs its
# statement to the end and commits, finding its client gone only when it answers.
POSTGRES_POINTS = {
    "record": ["threads", "counters", "episodes", "messages", "at_commit"],
    "fold": ["mid_delete", "counters", "episodes", "messages", "threads", "at_commit"],
}


def _point_lock(schema: str) -> int:
    """The advisory lock key of one test's points; its own, so parallel runs do not wait on each other."""
    return int(uuid.uuid5(uuid.NAMESPACE_URL, schema).hex[:15], 16)


def _postgres_hooks(lock: int) -> list[str]:
    wait = f"""
    CREATE FUNCTION crash_wait() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
    DECLARE
        deleted int;
    BEGIN
        IF NOT EXISTS (SELECT 1 FROM crash_point
                       WHERE name = TG_ARGV[0] AND app = current_setting('application_name')) THEN
            RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;  -- a BEFORE trigger goes on
        END IF;
        IF TG_ARGV[0] = 'mid_delete' THEN
            deleted := coalesce(nullif(current_setting('contextfold_test.deleted', true), ''), '0')::int + 1;
            PERFORM set_config('contextfold_test.deleted', deleted::text, true);
            IF deleted <> 2 THEN  -- wait at the second row, with the first one deleted
                RETURN OLD;
            END IF;
        END IF;
        PERFORM pg_advisory_xact_lock_shared({lock});
        RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    END $$"""
    return [
        "CREATE TABLE crash_point (name text, app text)",
        wait,
        "CREATE TRIGGER crash_threads BEFORE INSERT OR UPDATE ON threads "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('threads')",
        "CREATE TRIGGER crash_counters BEFORE INSERT OR UPDATE ON episode_threads "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('counters')",
        "CREATE TRIGGER crash_episodes BEFORE INSERT ON episodes "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('episodes')",
        "CREATE TRIGGER crash_messages BEFORE INSERT ON messages "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('messages')",
        "CREATE TRIGGER crash_mid_delete BEFORE DELETE ON messages "
        "FOR EACH ROW EXECUTE FUNCTION crash_wait('mid_delete')",
        "CREATE CONSTRAINT TRIGGER crash_at_commit AFTER INSERT OR UPDATE ON threads "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION crash_wait('at_commit')",
    ]


def _arm_sqlite(store: Any, point: tuple[str, int] | str, tell: Any) -> list[int]:
    """Hooks that kill the process at ``point``; they count the statements and steps they see.

    The third count is of the statements the calling thread (the event loop's) ran.
    """
    kind, at = ("count", 0) if point == "never" else point
    seen = [0, 0, 0]
    caller = threading.get_ident()

    def die(where: str) -> None:
        tell.send(("killed", where))
        os.kill(os.getpid(), signal.SIGKILL)

    def statement(text: str) -> None:
        seen[0] += 1
        seen[2] += threading.get_ident() == caller
        if kind == "statement" and seen[0] == at:
            die(f"at the start of statement {at}: {text.split()[0]}")

    def step() -> int:
        seen[1] += 1
        if kind == "step" and seen[1] == at:
            die(f"after VM instruction {at}")
        return 0

    # Both connections that write: the store's thread's, and at NORMAL the loop's own.
    for conn in {id(c): c for c in (store._conn, store._loop_writer) if c is not None}.values():
        conn.set_trace_callback(statement)
        conn.set_progress_handler(step, 1)
    return seen


async def call_then_die(target: Target, op: str, point: Any, app: str, tell: Any) -> None:
    async with open_target(target, app=app) as store:
        if op == "record":
            messages = step_messages()
            tell.send(("before", [m.model_dump_json() for m in messages]))
        else:
            plan = plan_fold(await store.load(THREAD))
            tell.send(("before", plan["checkpoint"].model_dump_json(), plan["through_seq"]))
        seen = _arm_sqlite(store, point, tell) if target["backend"].startswith("sqlite") else [0, 0, 0]
        if target["backend"] == "sqlite-normal":
            await thread_settled(store)  # so the record is made on the loop, as a step's would be
        if op == "record":
            await record_step(store, messages)
        else:
            await store.fold(THREAD, **plan)
        tell.send(("counted", *seen))
        tell.send(("returned", f"after {op} returned"))
        os.kill(os.getpid(), signal.SIGKILL)


def call_then_die_in_process(target: Target, op: str, point: Any, app: str, tell: Any) -> None:
    anyio.run(call_then_die, target, op, point, app, tell)


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
            await anyio.sleep(0.005)  # polling the server's view of another process


@dataclass
class Killer:
    """Runs one child to its chosen point; returns what it said."""

    target: Target
    context: Any
    holder: Any = None
    """PostgreSQL only: the parent's connection that holds the point's advisory lock."""

    async def round(self, op: str, point: Any, *, check_client: bool = False) -> list[Any]:
        app = f"cf_crash_{uuid.uuid4().hex[:8]}"
        child_target = dict(self.target)
        if self.holder is not None:
            if check_client:
                child_target["check_client"] = "yes"
            await _raw(
                self.target["url"],
                self.target["schema"],
                ["DELETE FROM crash_point", f"INSERT INTO crash_point VALUES ('{point}', '{app}')"],
            )
            await self.holder.execute(f"SELECT pg_advisory_lock({_point_lock(self.target['schema'])})")
        ours, theirs = self.context.Pipe(duplex=False)
        child = self.context.Process(
            target=call_then_die_in_process, args=(child_target, op, point, app, theirs), daemon=True
        )
        child.start()
        theirs.close()
        try:
            if self.holder is not None and point != "never":
                await _wait_for_sessions(self.target["url"], app, waiting=True)
                os.kill(child.pid or 0, signal.SIGKILL)
                if check_client:
                    # The server checks for its client every 20 ms while the statement waits; the
                    # lock is released only once it has noticed and ended the session, or on a
                    # loaded machine the statement would go on and commit before any check ran.
                    await _wait_for_sessions(self.target["url"], app, waiting=False)
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
        if self.holder is not None:
            # The session goes on once unlocked and ends when it finds its client gone.
            await _wait_for_sessions(self.target["url"], app, waiting=False)
        return told


def applied(op: str, told: list[Any], before: Snapshot) -> tuple[tuple[Any, ...], list[Any]]:
    """The working-context rows and the episodes the call would leave, had it committed."""
    last_episode = len(before.records)
    rows = [(m.seq, m.message, m.tokens, m.episode_seq) for m in before.window.messages]
    episodes = [r.episode for r in before.records]
    if op == "record":
        messages = [Message.model_validate_json(body) for body in told[0][1]]
        last = before.window.last_seq
        rows += [(last + n, m, 2, last_episode + n) for n, m in enumerate(messages, start=1)]
        episodes += [UserMessageEpisode(message=m) for m in messages]
    else:
        checkpoint = SummaryCheckpoint.model_validate_json(told[0][1])
        through = told[0][2]
        summary = Message.system(checkpoint.summary, metadata={SUMMARY_METADATA_KEY: True})
        rows = [(through, summary, 1, last_episode + 1), *(row for row in rows if row[0] > through)]
        episodes.append(checkpoint)
    return tuple(rows), episodes


@pytest.mark.parametrize(
    "target", ["sqlite", "sqlite-normal", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_sigkill_inside_a_record_or_a_fold_leaves_old_or_new(target: Target) -> None:
    """Killed at each point of record_and_append and fold, the thread is exactly as before or as after."""
    import psycopg

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    killer = Killer(target, context)
    outcomes: dict[str, int] = {"old": 0, "new": 0}
    kills: list[str] = []

    async def kill_once(store: Any, op: str, point: Any, check_client: bool = False) -> list[Any]:
        if op == "fold":
            while len((await store.load(THREAD)).messages) < 2 * STEP:
                await record_step(store, step_messages())
        before = await snapshot(store)
        told = await killer.round(op, point, check_client=check_client)
        kills.append(f"{op} {point}")
        last = {"returned"} if point == "never" else {"killed"} if killer.holder is None else {"before"}
        if isinstance(point, tuple) and point[0] == "step":
            last.add("returned")  # the call may take fewer steps than the counting one did
        assert told[-1][0] in last, f"{op} {point}: the child's last word was {told[-1]}"

        after = await snapshot(store)
        check_agreement(after)
        rows = tuple((m.seq, m.message, m.tokens, m.episode_seq) for m in after.window.messages)
        episodes = [r.episode for r in after.records]
        if (rows, episodes) == applied(op, told, before):
            assert not (check_client and point != "never"), (
                f"{op} {point}: applied, although the server ended the session before it went on"
            )
            outcomes["new"] += 1
        else:
            assert (after.window, after.records) == (before.window, before.records), (
                f"{op} {point}: neither the thread as it was nor as the call leaves it"
            )
            assert told[-1][0] != "returned", f"{op} {point}: a call that returned was not applied"
            outcomes["old"] += 1
        return told

    async with open_target(target) as store:
        if target["backend"] == "postgres":
            await _raw(target["url"], target["schema"], _postgres_hooks(_point_lock(target["schema"])))
            killer.holder = await psycopg.AsyncConnection.connect(target["url"], autocommit=True)
            try:
                for check_client in (True, False):
                    for op, points in POSTGRES_POINTS.items():
                        for point in [*points, "never"]:
                            await kill_once(store, op, point, check_client)
            finally:
                await killer.holder.close()
        else:
            for op in ("record", "fold"):
                # Counted on a thread that holds rows already, as every killed call finds it: the
                # first record of a thread creates its rows and takes more statements.
                await kill_once(store, op, "never")
                told = await kill_once(store, op, "never")
                statements, steps, on_loop = next(said[1:] for said in told if said[0] == "counted")
                # At NORMAL the step's record and a fold of few rows commit on the loop.
                on_the_loop = target["backend"] == "sqlite-normal"
                assert on_loop == (statements if on_the_loop else 0)
                points = [("statement", n) for n in range(1, statements + 1)]
                points += [
                    ("step", max(1, steps * k // SQLITE_STEP_POINTS)) for k in range(1, SQLITE_STEP_POINTS)
                ]
                for point in points:
                    await kill_once(store, op, point)
    assert outcomes["old"] and outcomes["new"], outcomes
    assert len(kills) >= 24, kills


LEASE_HOLDER_SECONDS = 1.0


async def hold_lease(target: Target, held: Any) -> None:
    async with open_target(target, lease_seconds=LEASE_HOLDER_SECONDS) as store:
        async with store.compaction_lock(THREAD) as mine:
            assert mine
            held.set()
            await anyio.sleep_forever()


def hold_lease_in_process(target: Target, held: Any) -> None:
    anyio.run(hold_lease, target, held)


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_killed_lease_holder_is_taken_over_once_its_lease_expires(target: Target) -> None:
    """A SIGKILLed compactor's lease keeps others out until it expires, then another worker takes over."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    async with open_target(target) as store:
        held = context.Event()
        child = context.Process(target=hold_lease_in_process, args=(target, held), daemon=True)
        child.start()
        try:
            assert await anyio.to_thread.run_sync(held.wait, 60), "the child never took the lease"
            taken = time.monotonic()
        finally:
            os.kill(child.pid or 0, signal.SIGKILL)
            await anyio.to_thread.run_sync(child.join)
        async with store.compaction_lock(THREAD) as mine:
            assert not mine, "the dead holder's lease must still exclude others"
        with anyio.fail_after(10):
            while True:
                async with store.compaction_lock(THREAD) as mine:
                    if mine:
                        await record_step(store, step_messages(2 * STEP))
                        await store.fold(THREAD, **plan_fold(await store.load(THREAD)))
                        break
                await anyio.sleep(0.02)  # polling the lease's expiry on the database's clock
        waited = time.monotonic() - taken
        check_agreement(await snapshot(store))
    assert waited >= LEASE_HOLDER_SECONDS * 0.5, f"the lease was taken over after only {waited:.2f} s"
