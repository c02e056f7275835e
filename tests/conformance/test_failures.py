"""Failure paths, on every backend: a write that fails or is cancelled leaves the data as it was.

A cancelled caller may find its write either not applied or applied whole; a
failed write is never applied. Either way the stored rows, the counters and
the compaction lock stay consistent, and the store keeps working.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from contextfold import Message, StoreError
from contextfold.episodes import SummaryCheckpoint, UserMessageEpisode
from contextfold.stores import ThreadStats

from .conftest import SQL_BACKENDS, OpenStore, RawSQL, dialect

# Every turn up to 12, then growing by half up to enough turns to outlast the
# slowest operation here (a PostgreSQL transaction of a few round trips), so
# the cancellations land before, at each step of, and after the operation.
# A store that writes on a thread of its own advances while the loop does not,
# so turns alone cannot say how far its write got: the float points cancel
# after that many seconds instead, doubling up to long enough for a write on a
# loaded machine, and a point ends early once the operation has finished.
CANCEL_AFTER: list[int | float] = [
    *range(12),
    *(int(12 * 1.5**n) for n in range(1, 13)),
    *(0.0005 * 2**n for n in range(14)),
]


def users(count: int, start: int = 0) -> list[Message]:
    return [Message.user(f"message {n}") for n in range(start, start + count)]


async def state(store: Any, thread: str) -> tuple[Any, ...]:
    window = await store.load(thread)
    return (await store.stats(thread), window.messages, window.version, window.total_tokens)


async def consistent(store: Any, thread: str) -> None:
    window = await store.load(thread)
    stats = await store.stats(thread)
    assert stats.message_count == len(window.messages)
    assert stats.total_tokens == sum(window.tokens) == window.total_tokens
    assert window.version == stats.version


async def cancelled_after(turns: int | float, operation: Any) -> bool:
    """Run ``operation`` and cancel it after ``turns`` scheduler turns (an int) or seconds (a float).

    Returns whether it finished first; waiting stops as soon as it has.
    """
    finished = anyio.Event()

    async def run() -> None:
        await operation()
        finished.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        if isinstance(turns, float):
            with anyio.move_on_after(turns):
                await finished.wait()
        else:
            for _ in range(turns):
                if finished.is_set():
                    break
                await checkpoint()
        group.cancel_scope.cancel()
    return finished.is_set()


async def test_a_cancelled_replacement_is_applied_whole_or_not_at_all(store: Any) -> None:
    """Cancelling replace_prefix at any point leaves the thread exactly as before or exactly as replaced."""
    outcomes = set()
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        await store.append(thread, users(6), [3] * 6)
        before = await state(store, thread)
        summary = Message.system("summary", metadata={"turns": turns})

        async def replace(thread: str = thread, summary: Message = summary) -> None:
            await store.replace_prefix(
                thread, through_seq=4, expected_version=0, replacement=[summary], tokens=[1]
            )

        finished = await cancelled_after(turns, replace)
        after = await state(store, thread)
        if after == before:
            outcomes.add("old")
            assert not finished
        else:
            outcomes.add("new")
            stats, messages, _, _ = after
            assert stats == ThreadStats(message_count=3, total_tokens=7, version=1, last_seq=6)
            assert [m.seq for m in messages] == [4, 5, 6] and messages[0].message == summary
        await consistent(store, thread)
        async with store.compaction_lock(thread) as mine:
            assert mine, f"the compaction lock stayed taken after a cancel at turn {turns}"
    assert outcomes == {"old", "new"}


async def test_a_cancelled_append_is_applied_whole_or_not_at_all(store: Any) -> None:
    """Cancelling append at any point leaves either none or all of its messages, with matching counters."""
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        await store.append(thread, users(2), [1, 1])

        async def append(thread: str = thread) -> None:
            await store.append(thread, users(3, start=2), [5, 5, 5])

        await cancelled_after(turns, append)
        stats = await store.stats(thread)
        assert (stats.message_count, stats.total_tokens) in ((2, 2), (5, 17))
        await consistent(store, thread)
        (stored,) = await store.append(thread, users(1, start=9), [1])
        assert stored.seq == stats.last_seq + 1


async def test_a_cancelled_record_is_logged_whole_or_not_at_all(store: Any) -> None:
    """Cancelling record at any point leaves the episode either logged with its counters or absent."""
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        await store.record(thread, UserMessageEpisode(message=Message.user("first")))

        async def record(thread: str = thread) -> None:
            await store.record(thread, UserMessageEpisode(message=Message.user("second")))

        await cancelled_after(turns, record)
        logged = [r async for r in store.replay(thread)]
        assert [r.seq for r in logged] == list(range(1, len(logged) + 1)) and len(logged) in (1, 2)
        assert (await store.pressure(thread)).total_user_messages == len(logged)


async def test_a_lock_holder_cancelled_mid_body_releases_the_lock(store: Any, open_store: OpenStore) -> None:
    """A compaction cancelled inside the locked body gives the lock back to every other handle."""
    other = await open_store()
    await store.append("t", users(4), [1] * 4)
    for turns in (0, 1, 5, 20):

        async def compact() -> None:
            async with store.compaction_lock("t") as mine:
                assert mine
                await anyio.sleep_forever()

        await cancelled_after(turns, compact)
        async with other.compaction_lock("t") as theirs:
            assert theirs


INJECT = {
    "sqlite": [
        "CREATE TRIGGER fail_message BEFORE INSERT ON messages WHEN NEW.tokens = 666 "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
        "CREATE TRIGGER fail_threads BEFORE UPDATE ON threads WHEN NEW.total_tokens = 777 "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
        # The log's counters are columns of the threads row, updated before the episode is written.
        "CREATE TRIGGER fail_counters BEFORE UPDATE OF last_episode_seq ON threads "
        "WHEN NEW.last_episode_seq = 3 "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
    ],
    "postgres": [
        "CREATE FUNCTION injected_failure() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'injected failure'; END $$",
        "CREATE TRIGGER fail_message BEFORE INSERT ON messages FOR EACH ROW WHEN (NEW.tokens = 666) "
        "EXECUTE FUNCTION injected_failure()",
        "CREATE TRIGGER fail_threads BEFORE UPDATE ON threads FOR EACH ROW WHEN (NEW.total_tokens = 777) "
        "EXECUTE FUNCTION injected_failure()",
        # PostgreSQL updates the counters first, then inserts the episode, in one statement.
        "CREATE TRIGGER fail_episode BEFORE INSERT ON episodes FOR EACH ROW WHEN (NEW.seq = 3) "
        "EXECUTE FUNCTION injected_failure()",
    ],
}


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_a_write_failing_after_its_first_statement_changes_nothing(
    backend: str, store: Any, raw_sql: RawSQL
) -> None:
    """When the database fails a later statement of a write, its earlier statements are rolled back too."""
    await store.append("t", users(4), [100, 100, 100, 100])
    await store.record("t", UserMessageEpisode(message=Message.user("a")))
    await store.record("t", UserMessageEpisode(message=Message.user("b")))
    messages_before = await state(store, "t")
    log_before = [r async for r in store.replay("t")]
    pressure_before = await store.pressure("t")
    for statement in INJECT[dialect(backend)]:
        await raw_sql(statement, [])

    def replace(tokens: int) -> Any:
        return store.replace_prefix(
            "t", through_seq=2, expected_version=0, replacement=users(1), tokens=[tokens]
        )

    failing = [
        # a message row fails after the first of the batch was written
        lambda: store.append("t", users(2), [1, 666]),
        # the counters fail after the messages were written (400 + 377 = 777)
        lambda: store.append("t", users(2), [300, 77]),
        # the replacement fails to insert after the prefix was deleted
        lambda: replace(666),
        # the counters fail after the prefix was swapped (200 + 577 = 777)
        lambda: replace(577),
        # the second of the episode and its counters fails
        lambda: store.record("t", SummaryCheckpoint(trigger="x", from_seq=1, through_seq=2, summary="s")),
    ]
    for write in failing:
        with pytest.raises(StoreError, match="injected failure"):
            await write()
        assert await state(store, "t") == messages_before
        assert [r async for r in store.replay("t")] == log_before
        assert await store.pressure("t") == pressure_before

    (stored,) = await store.append("t", users(1), [1])
    assert stored.seq == 5
