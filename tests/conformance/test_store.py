"""The Store contract (both memories in one backend), on every backend."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from contextfold import ConfigError, ConflictError, InvalidMessageError, Message, StoreError, ToolCall
from contextfold._episodes import RunCompletedEpisode
from contextfold.episodes import (
    LlmCallEpisode,
    SummaryCheckpoint,
    ToolCallEpisode,
    ToolResultEpisode,
    UserMessageEpisode,
)
from contextfold.messages import SUMMARY_METADATA_KEY
from contextfold.stores import Store, ThreadStats

from .conftest import SQL_BACKENDS, OpenStore, RawSQL, dialect
from .test_failures import CANCEL_AFTER, INJECT, cancelled_after

INT64_MAX = 2**63 - 1


def said(text: str) -> UserMessageEpisode:
    return UserMessageEpisode(message=Message.user(text))


def summary(text: str = "the story so far") -> Message:
    return Message.system(text, metadata={SUMMARY_METADATA_KEY: True})


def checkpoint(through_seq: int, text: str = "the story so far") -> SummaryCheckpoint:
    return SummaryCheckpoint(trigger="token_budget", from_seq=1, through_seq=through_seq, summary=text)


async def say(store: Any, thread: str, *texts: str, tokens: int = 10) -> list[Any]:
    """Record and append one user message per text, each linked to its episode."""
    messages = [Message.user(text) for text in texts]
    return list(
        await store.record_and_append(
            thread,
            [UserMessageEpisode(message=m) for m in messages],
            messages,
            [tokens] * len(messages),
            message_episodes=list(range(len(messages))),
        )
    )


async def everything(store: Any, thread: str) -> tuple[Any, ...]:
    """All a thread holds, in both memories, as the store reports it."""
    window = await store.load(thread)
    return (
        window,
        await store.stats(thread),
        [r async for r in store.replay(thread)],
        await store.pressure(thread, now=datetime(2030, 1, 1, tzinfo=UTC)),
        await store.latest_checkpoint(thread),
    )


async def test_every_backend_is_a_store(store: Any) -> None:
    """Each bundled backend implements the Store protocol."""
    assert isinstance(store, Store)


async def test_state_is_the_stats_and_the_pressure(store: Any) -> None:
    """state() gives the thread's stats and its pressure, with the context's tokens as the estimate."""
    await say(store, "t", "a", "b", tokens=7)
    await store.record("t", RunCompletedEpisode())
    await say(store, "t", "c", tokens=7)
    now = datetime.now(UTC) + timedelta(days=3)
    state = await store.state("t", now=now)
    assert state.stats == await store.stats("t")
    assert state.stats.total_tokens == 21 and state.stats.message_count == 3
    assert state.pressure == await store.pressure("t", now=now, estimated_context_tokens=21)
    assert state.pressure.total_user_messages == 3
    assert state.pressure.user_messages_after_latest_run_completed == 1
    assert state.pressure.conversation_age_days == 3


async def test_state_of_an_unknown_thread_is_empty(store: Any) -> None:
    """An unknown thread's state is zero stats and zero pressure."""
    state = await store.state("nobody")
    assert state.stats == ThreadStats()
    assert state.pressure.total_user_messages == 0
    assert state.pressure.estimated_context_tokens == 0


async def test_state_rejects_a_naive_now(store: Any) -> None:
    """state(now=...) needs a timezone-aware time."""
    with pytest.raises(ConfigError, match="now"):
        await store.state("t", now=datetime(2030, 1, 1))


async def test_load_reports_the_newest_seq(store: Any) -> None:
    """A loaded window carries the seq of the thread's newest message, windowed or not."""
    await store.append("t", [Message.user(str(n)) for n in range(5)], [1] * 5)
    assert (await store.load("t")).last_seq == 5
    assert (await store.load("t", max_tokens=2)).last_seq == 5
    assert (await store.load("empty")).last_seq == 0


async def test_tail_returns_the_messages_after_a_seq(store: Any) -> None:
    """tail(after_seq=n) returns the messages after seq n, with the thread's version, total and newest seq."""
    await store.append("t", [Message.user(str(n)) for n in range(6)], [2] * 6)
    tail = await store.tail("t", after_seq=4)
    assert [m.seq for m in tail.messages] == [5, 6]
    assert [m.message.text for m in tail.messages] == ["4", "5"]
    assert (tail.version, tail.total_tokens, tail.last_seq, tail.complete) == (0, 12, 6, False)
    whole = await store.tail("t", after_seq=0)
    assert whole.complete and whole.messages == (await store.load("t")).messages
    assert (await store.tail("t", after_seq=6)).messages == ()


async def test_cache_plus_tail_is_the_working_context(store: Any) -> None:
    """A cached window plus tail(after_seq=its last_seq) equals a fresh load while the version holds."""
    await store.append("t", [Message.user(str(n)) for n in range(3)], [1] * 3)
    cached = await store.load("t")
    await store.append("t", [Message.user("new")], [1])
    tail = await store.tail("t", after_seq=cached.last_seq)
    assert tail.version == cached.version
    assert cached.messages + tail.messages == (await store.load("t")).messages


async def test_tail_after_a_fold_shows_the_new_version(store: Any) -> None:
    """After a fold, tail reports the new version, so a cache built before it is known stale."""
    await say(store, "t", "a", "b", "c")
    cached = await store.load("t")
    await store.fold(
        "t", checkpoint=checkpoint(2), through_seq=2, expected_version=0, replacement=[summary()], tokens=[3]
    )
    tail = await store.tail("t", after_seq=cached.last_seq)
    assert tail.version == cached.version + 1
    assert (tail.messages, tail.total_tokens) == ((), 13)


async def test_tail_rejects_a_bad_after_seq(store: Any) -> None:
    """after_seq must be a whole number >= 0 within 64 bits."""
    for bad in (-1, 1.5, None, INT64_MAX + 1):
        with pytest.raises(ConfigError, match="after_seq"):
            await store.tail("t", after_seq=bad)


async def test_record_and_append_writes_the_log_and_the_context(store: Any) -> None:
    """record_and_append records every episode and appends every message, each linked to its episode."""
    await store.record("t", said("earlier"))
    reply = Message.assistant("hello")
    question = Message.user("hi")
    stored = await store.record_and_append(
        "t", [said("hi"), RunCompletedEpisode()], [question, reply], [3, 4], message_episodes=[0, 1]
    )
    assert [(m.seq, m.message, m.tokens, m.episode_seq) for m in stored] == [
        (1, question, 3, 2),
        (2, reply, 4, 3),
    ]
    assert (await store.load("t")).messages == tuple(stored)
    log = [r async for r in store.replay("t")]
    assert [r.seq for r in log] == [1, 2, 3]
    assert log[1].episode == said("hi") and log[2].episode == RunCompletedEpisode()
    assert (await store.pressure("t")).total_user_messages == 2
    assert await store.stats("t") == ThreadStats(message_count=2, total_tokens=7, last_seq=2)


async def test_a_tool_step_with_its_starts_between_the_messages_reads_back_in_order(store: Any) -> None:
    """A step's reply, two tool starts and two results in one call: links skip the starts, text reads back."""
    calls = [
        ToolCall(id="a", name="grep", arguments='{"q": "x"}'),
        ToolCall(id="b", name="ls", arguments="{}"),
    ]
    reply = Message.assistant("looking", tool_calls=calls)
    results = [Message.tool("a", "x found " * 40), Message.tool("b", "README.md")]
    episodes = [
        LlmCallEpisode(reply=reply, model="m"),
        ToolCallEpisode(call=calls[0]),
        ToolResultEpisode(message=results[0]),
        ToolCallEpisode(call=calls[1]),
        ToolResultEpisode(message=results[1]),
    ]
    await say(store, "t", "go")
    stored = await store.record_and_append(
        "t", episodes, [reply, *results], [5, 6, 7], message_episodes=[0, 2, 4]
    )
    assert [(m.seq, m.episode_seq) for m in stored] == [(2, 2), (3, 4), (4, 6)]
    assert [m.message for m in (await store.load("t")).messages][1:] == [reply, *results]
    log = [r async for r in store.replay("t")]
    assert [r.episode for r in log][1:] == episodes
    assert [m.message for m in (await store.tail("t", after_seq=1)).messages] == [reply, *results]
    # The log's counters and the context's stats count the whole step (SQLite: in one statement).
    before = (await store.load("t")).tokens[0]
    assert await store.stats("t") == ThreadStats(message_count=4, total_tokens=before + 18, last_seq=4)
    await say(store, "t", "next")
    assert [r.seq async for r in store.replay("t")] == [1, 2, 3, 4, 5, 6, 7]
    pressure = await store.pressure("t")
    assert (pressure.total_user_messages, pressure.user_messages_since_boundary) == (2, 2)


class _TaggedUserMessage(UserMessageEpisode):
    """A user's own subclass of a message episode: recorded, and counted, as the episode it extends."""


async def test_a_subclassed_user_episode_holding_its_message_counts_as_a_user_message(store: Any) -> None:
    """The episode holds the row's JSON as a plain one would, and the user-message counters count it.

    (SQLite's one-statement step took every such step for a plain one and
    counted it by its exact type, missing the user message.)
    """
    await say(store, "t", "first")
    message = Message.user("second")
    stored = await store.record_and_append(
        "t", [_TaggedUserMessage(message=message)], [message], [3], message_episodes=[0]
    )
    assert [(m.seq, m.episode_seq, m.message) for m in stored] == [(2, 2, message)]
    pressure = await store.pressure("t")
    assert (pressure.total_user_messages, pressure.user_messages_since_boundary) == (2, 2)
    assert [r.episode async for r in store.replay("t")][1] == UserMessageEpisode(message=message)


async def test_record_and_append_without_links_appends_unlinked_messages(store: Any) -> None:
    """Without message_episodes, the messages are appended with no episode seq."""
    stored = await store.record_and_append("t", [said("a")], [Message.user("a")], [1])
    assert stored[0].episode_seq is None
    assert [r.seq async for r in store.replay("t")] == [1]


async def test_record_and_append_with_an_invalid_episode_writes_nothing(store: Any) -> None:
    """An invalid episode after valid ones fails the call before either memory is written."""
    await say(store, "t", "before")
    before = await everything(store, "t")
    with pytest.raises(InvalidMessageError, match=r"episodes\[1\]"):
        await store.record_and_append(
            "t", [said("ok"), Message.user("not an episode")], [Message.user("ok")], [1]
        )
    assert await everything(store, "t") == before


@pytest.mark.parametrize("links", [[0, 0], [2], [-1], ["0"], "0"])
async def test_record_and_append_rejects_bad_links(store: Any, links: Any) -> None:
    """message_episodes must give, for each message, the index of an episode passed with it."""
    with pytest.raises(ConfigError, match="message_episodes"):
        await store.record_and_append(
            "t", [said("a"), said("b")], [Message.user("a")], [1], message_episodes=links
        )
    assert await store.stats("t") == ThreadStats()
    assert [r async for r in store.replay("t")] == []


# The injected trigger that refuses a message row with 666 tokens (and, on PostgreSQL, its function).
FAIL_MESSAGE_INSERT = {"sqlite": INJECT["sqlite"][:1], "postgres": INJECT["postgres"][:2]}


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_record_and_append_failing_in_the_database_writes_neither(
    backend: str, store: Any, raw_sql: RawSQL
) -> None:
    """When the database refuses a message row, the episodes the call recorded before it are rolled back."""
    await say(store, "t", "before")
    before = await everything(store, "t")
    for statement in FAIL_MESSAGE_INSERT[dialect(backend)]:
        await raw_sql(statement, [])
    with pytest.raises(StoreError, match="injected failure"):
        await store.record_and_append(
            "t",
            [said("a"), said("b")],
            [Message.user("a"), Message.user("b")],
            [1, 666],
            message_episodes=[0, 1],
        )
    assert await everything(store, "t") == before


async def test_fold_records_the_checkpoint_and_swaps_the_prefix(store: Any) -> None:
    """fold() logs the checkpoint, swaps the prefix for the summary linked to it and resets the counters."""
    await say(store, "t", "a", "b", "c", "d")
    record = await store.fold(
        "t", checkpoint=checkpoint(3), through_seq=3, expected_version=0, replacement=[summary()], tokens=[5]
    )
    assert record.seq == 5 and record.episode == checkpoint(3)
    window = await store.load("t")
    assert [(m.seq, m.message, m.tokens, m.episode_seq) for m in window.messages] == [
        (3, summary(), 5, 5),
        (4, Message.user("d"), 10, 4),
    ]
    assert (window.version, window.total_tokens) == (1, 15)
    assert await store.latest_checkpoint("t") == record
    assert [r async for r in store.replay("t", from_seq=5)] == [record]
    pressure = await store.pressure("t")
    assert (pressure.user_messages_since_boundary, pressure.total_user_messages) == (0, 4)


async def test_fold_applies_on_top_of_messages_appended_after_the_load(store: Any) -> None:
    """Messages appended after the window was read survive the fold, after the summary."""
    await say(store, "t", "a", "b", "c")
    window = await store.load("t")
    await say(store, "t", "late 1", "late 2")
    await store.fold(
        "t",
        checkpoint=checkpoint(2),
        through_seq=2,
        expected_version=window.version,
        replacement=[summary()],
        tokens=[1],
    )
    after = await store.load("t")
    assert [m.message.text for m in after.messages] == ["the story so far", "c", "late 1", "late 2"]
    assert after.total_tokens == 31 and after.last_seq == 5
    assert (await store.pressure("t")).user_messages_since_boundary == 0


@pytest.mark.parametrize(("through_seq", "version"), [(2, 1), (9, 0), (0 + 1, 7)])
async def test_a_conflicting_fold_writes_nothing(store: Any, through_seq: int, version: int) -> None:
    """A fold whose version moved or whose seq is gone raises ConflictError and writes no checkpoint."""
    await say(store, "t", "a", "b", "c")
    before = await everything(store, "t")
    with pytest.raises(ConflictError):
        await store.fold(
            "t",
            checkpoint=checkpoint(through_seq),
            through_seq=through_seq,
            expected_version=version,
            replacement=[summary()],
            tokens=[1],
        )
    assert await everything(store, "t") == before


async def test_a_fold_after_another_fold_of_the_same_read_conflicts(store: Any) -> None:
    """The second of two folds made from one read conflicts and leaves the first one's checkpoint alone."""
    await say(store, "t", "a", "b", "c")
    window = await store.load("t")
    first = await store.fold(
        "t",
        checkpoint=checkpoint(2, "one"),
        through_seq=2,
        expected_version=window.version,
        replacement=[summary("one")],
        tokens=[1],
    )
    after_first = await everything(store, "t")
    with pytest.raises(ConflictError):
        await store.fold(
            "t",
            checkpoint=checkpoint(3, "two"),
            through_seq=3,
            expected_version=window.version,
            replacement=[summary("two")],
            tokens=[1],
        )
    assert await everything(store, "t") == after_first
    assert await store.latest_checkpoint("t") == first


async def test_a_fold_of_an_unknown_thread_conflicts_and_writes_nothing(store: Any) -> None:
    """Folding a thread with no messages is a conflict and logs nothing."""
    with pytest.raises(ConflictError):
        await store.fold(
            "t",
            checkpoint=checkpoint(1),
            through_seq=1,
            expected_version=0,
            replacement=[summary()],
            tokens=[1],
        )
    assert [r async for r in store.replay("t")] == []
    assert await store.latest_checkpoint("t") is None


async def test_fold_needs_a_summary_checkpoint(store: Any) -> None:
    """fold() refuses anything but a SummaryCheckpoint before writing."""
    await say(store, "t", "a", "b")
    before = await everything(store, "t")
    with pytest.raises(InvalidMessageError, match="checkpoint"):
        await store.fold(
            "t", checkpoint=said("x"), through_seq=1, expected_version=0, replacement=[summary()], tokens=[1]
        )
    assert await everything(store, "t") == before


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_a_fold_failing_in_the_database_writes_no_checkpoint(
    backend: str, store: Any, raw_sql: RawSQL
) -> None:
    """When the database refuses the summary row, the checkpoint recorded in the same fold is rolled back."""
    await say(store, "t", "a", "b", "c")
    before = await everything(store, "t")
    for statement in FAIL_MESSAGE_INSERT[dialect(backend)]:
        await raw_sql(statement, [])
    with pytest.raises(StoreError, match="injected failure"):
        await store.fold(
            "t",
            checkpoint=checkpoint(2),
            through_seq=2,
            expected_version=0,
            replacement=[summary()],
            tokens=[666],
        )
    assert await everything(store, "t") == before


async def test_two_handles_folding_one_prefix_at_once_leave_one_checkpoint(
    store: Any, open_store: OpenStore
) -> None:
    """Two handles folding one read at once: one applies, one conflicts, and one checkpoint is logged."""
    other = await open_store()
    await say(store, "t", *"abcdefgh")
    window = await store.load("t")
    results: dict[str, Any] = {}

    async def fold(name: str, handle: Any, through_seq: int) -> None:
        try:
            results[name] = await handle.fold(
                "t",
                checkpoint=checkpoint(through_seq, name),
                through_seq=through_seq,
                expected_version=window.version,
                replacement=[summary(name)],
                tokens=[1],
            )
        except ConflictError as exc:
            results[name] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(fold, "first", store, 4)
        group.start_soon(fold, "second", other, 6)
    winners = [name for name, result in results.items() if not isinstance(result, ConflictError)]
    assert len(winners) == 1, results
    log = [r async for r in store.replay("t")]
    checkpoints = [r for r in log if isinstance(r.episode, SummaryCheckpoint)]
    assert [c.episode.summary for c in checkpoints] == winners
    after = await store.load("t")
    assert after.plain[0] == summary(winners[0]) and after.version == 1


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_a_lease_is_refused_to_another_handle_until_it_expires(
    backend: str, open_store: OpenStore
) -> None:
    """A lease never released (its holder died) is refused to others, then taken once lease_seconds pass."""
    crashed = await open_store(lease_seconds=0.5)
    other = await open_store(lease_seconds=0.5)
    holder = crashed.compaction_lock("t")
    assert await holder.__aenter__()  # never exited, as if the process died in the body
    taken = time.monotonic()
    async with other.compaction_lock("t") as theirs:
        assert not theirs
    with anyio.fail_after(10):
        while True:
            successor = other.compaction_lock("t")
            if await successor.__aenter__():
                break
            await successor.__aexit__(None, None, None)
            await anyio.sleep(0.05)  # polling the database's clock
    assert time.monotonic() - taken >= 0.4
    async with crashed.compaction_lock("t") as again:
        assert not again  # the successor's lease is live
    # The dead holder's exit, late (a process that died never makes it) and here rather than
    # left to the garbage collector, which would run it in whatever test comes next: it must
    # not hand back the lease it lost.
    await holder.__aexit__(None, None, None)
    async with crashed.compaction_lock("t") as again:
        assert not again  # still the successor's
    await successor.__aexit__(None, None, None)


async def test_a_released_lease_is_free_at_once(store: Any, open_store: OpenStore) -> None:
    """A lease released by its holder is taken by another handle at once."""
    other = await open_store()
    async with store.compaction_lock("t") as mine:
        assert mine
        async with other.compaction_lock("t") as theirs:
            assert not theirs
    async with other.compaction_lock("t") as theirs:
        assert theirs


async def test_forget_removes_both_memories_and_leaves_a_tombstone(store: Any) -> None:
    """forget() empties the thread's context and log, and leaves a tombstone with the time and row counts."""
    await say(store, "t", "a", "b", "c")
    await store.record("t", RunCompletedEpisode())
    await say(store, "other", "kept")
    other_before = await everything(store, "other")
    began = datetime.now(UTC) - timedelta(seconds=5)
    tombstone = await store.forget("t")
    assert (tombstone.thread, tombstone.messages, tombstone.episodes) == ("t", 3, 4)
    assert began <= tombstone.forgotten_at <= datetime.now(UTC) + timedelta(seconds=5)
    assert (await store.load("t")).messages == ()
    assert [r async for r in store.replay("t")] == []
    assert await store.latest_checkpoint("t") is None
    state = await store.state("t")
    assert (state.stats.message_count, state.stats.total_tokens, state.pressure.total_user_messages) == (
        0,
        0,
        0,
    )
    assert await store.tombstones("t") == [tombstone]
    assert await everything(store, "other") == other_before
    assert [info.thread for info in await store.threads()] == ["other"]


async def test_a_forgotten_thread_can_be_used_again(store: Any) -> None:
    """After forget(), the thread records and appends anew; its log restarts and its cache key moves on."""
    await say(store, "t", "a", "b")
    before = await store.load("t")
    await store.forget("t")
    stored = await say(store, "t", "fresh")
    window = await store.load("t")
    assert window.plain == [Message.user("fresh")] and window.messages == tuple(stored)
    # The version moved, so a context cached before forget() is never taken for the new one.
    assert window.version > before.version
    log = [r async for r in store.replay("t")]
    assert [(r.seq, r.episode) for r in log] == [(1, said("fresh"))]
    assert stored[0].episode_seq == 1
    second = await store.forget("t")
    assert [t.episodes for t in await store.tombstones("t")] == [2, second.episodes] == [2, 1]


async def test_forgetting_an_unknown_thread_leaves_an_empty_tombstone(store: Any) -> None:
    """forget() on a thread with no rows still writes a tombstone, with zero counts."""
    tombstone = await store.forget("nobody")
    assert (tombstone.messages, tombstone.episodes) == (0, 0)
    assert await store.tombstones("nobody") == [tombstone]
    assert await store.tombstones("somebody else") == []


async def test_forget_moves_the_version_on_only_for_a_thread_with_a_context(store: Any) -> None:
    """forget() moves the version on for a thread that had a working context, not for one with a log alone."""
    await store.record("log only", RunCompletedEpisode())
    await say(store, "both", "a")
    await store.append("appended", [Message.user("a")], [1])
    await store.append("appended nothing", [], [])  # the memory store made a context of it (version 1)
    threads = ("log only", "both", "appended", "nobody", "appended nothing")
    for thread in threads:
        await store.forget(thread)
    versions = {thread: (await store.stats(thread)).version for thread in threads}
    assert versions == {"log only": 0, "both": 1, "appended": 1, "nobody": 0, "appended nothing": 0}
    assert (await store.load("log only")).version == 0
    await store.forget("appended")
    assert (await store.stats("appended")).version == 2


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_the_log_stays_append_only_after_forget(backend: str, store: Any, raw_sql: RawSQL) -> None:
    """After a forget(), the database still rejects a raw UPDATE or DELETE on any thread's episodes."""
    await say(store, "t", "a", "b")
    await say(store, "u", "c")
    await store.forget("t")
    await say(store, "t", "again")
    for statement in (
        "DELETE FROM episodes WHERE thread = 't'",
        "DELETE FROM episodes WHERE thread = 'u'",
        "UPDATE episodes SET body = '{}' WHERE thread = 'u'",
    ):
        with pytest.raises(Exception, match="append-only"):
            await raw_sql(statement, [])
    assert [r.episode for r in [r async for r in store.replay("t")]] == [said("again")]
    assert [r.episode for r in [r async for r in store.replay("u")]] == [said("c")]


async def test_threads_lists_every_thread_newest_activity_first(store: Any) -> None:
    """threads() lists each thread with its messages, tokens, episodes and last activity, newest first."""
    await store.record("old", said("x"), at=datetime(2020, 1, 1, tzinfo=UTC))
    await say(store, "new", "a", "b", tokens=4)
    await store.append("context only", [Message.user("c")], [9])
    infos = await store.threads()
    assert [info.thread for info in infos] == ["new", "old", "context only"]
    new, old, context_only = infos
    assert (new.message_count, new.total_tokens, new.episodes) == (2, 8, 2)
    assert new.last_activity is not None and new.last_activity > datetime(2025, 1, 1, tzinfo=UTC)
    assert (old.message_count, old.episodes, old.last_activity) == (0, 1, datetime(2020, 1, 1, tzinfo=UTC))
    assert (context_only.message_count, context_only.episodes, context_only.last_activity) == (1, 0, None)


LONE_SURROGATE = "user-\udc80"


def calls(store: Any, thread: str) -> list[Any]:
    """One call of every thread-taking method."""
    return [
        lambda: store.append(thread, [Message.user("a")], [1]),
        lambda: store.load(thread),
        lambda: store.tail(thread, after_seq=0),
        lambda: store.stats(thread),
        lambda: store.state(thread),
        lambda: store.record(thread, said("a")),
        lambda: store.pressure(thread),
        lambda: store.latest_checkpoint(thread),
        lambda: store.record_and_append(thread, [said("a")], [Message.user("a")], [1]),
        lambda: store.replace_prefix(thread, through_seq=1, expected_version=0, replacement=[], tokens=[]),
        lambda: store.fold(
            thread, checkpoint=checkpoint(1), through_seq=1, expected_version=0, replacement=[], tokens=[]
        ),
        lambda: store.forget(thread),
        lambda: store.tombstones(thread),
    ]


async def test_a_thread_id_that_is_not_utf8_is_a_config_error_everywhere(store: Any) -> None:
    """A thread id with a lone surrogate raises ConfigError naming 'thread' from every method."""
    for call in calls(store, LONE_SURROGATE):
        with pytest.raises(ConfigError, match="UTF-8") as caught:
            await call()
        assert caught.value.key == "thread"
    with pytest.raises(ConfigError, match="UTF-8"):
        [r async for r in store.replay(LONE_SURROGATE)]
    with pytest.raises(ConfigError, match="UTF-8"):
        async with store.compaction_lock(LONE_SURROGATE):
            pass
    assert await store.threads() == []


async def test_thread_ids_outside_ascii_are_kept(store: Any) -> None:
    """Thread ids with accents, emoji and other scripts work as plain keys."""
    for thread in ("café", "用户-1", "😀"):
        await say(store, thread, "hi")
        assert (await store.load(thread)).plain == [Message.user("hi")]
    assert sorted(info.thread for info in await store.threads()) == sorted(("café", "用户-1", "😀"))


TOO_BIG = INT64_MAX + 1


async def test_integers_past_64_bits_are_config_errors_naming_the_argument(store: Any) -> None:
    """Every integer argument above 2**63 - 1 raises ConfigError naming it, and nothing is written."""
    await say(store, "t", "a", "b")
    before = await everything(store, "t")
    cases: list[tuple[str, Any]] = [
        ("tokens[0]", lambda: store.append("t", [Message.user("x")], [TOO_BIG])),
        ("tokens[0]", lambda: store.record_and_append("t", [said("x")], [Message.user("x")], [TOO_BIG])),
        ("max_tokens", lambda: store.load("t", max_tokens=TOO_BIG)),
        ("after_seq", lambda: store.tail("t", after_seq=TOO_BIG)),
        (
            "through_seq",
            lambda: store.replace_prefix(
                "t", through_seq=TOO_BIG, expected_version=0, replacement=[], tokens=[]
            ),
        ),
        (
            "expected_version",
            lambda: store.replace_prefix(
                "t", through_seq=1, expected_version=TOO_BIG, replacement=[], tokens=[]
            ),
        ),
        (
            "through_seq",
            lambda: store.fold(
                "t",
                checkpoint=checkpoint(1),
                through_seq=TOO_BIG,
                expected_version=0,
                replacement=[],
                tokens=[],
            ),
        ),
        (
            "tokens[0]",
            lambda: store.fold(
                "t",
                checkpoint=checkpoint(1),
                through_seq=1,
                expected_version=0,
                replacement=[summary()],
                tokens=[TOO_BIG],
            ),
        ),
    ]
    for key, call in cases:
        with pytest.raises(ConfigError, match="2\\*\\*63") as caught:
            await call()
        assert caught.value.key == key
    with pytest.raises(ConfigError, match="from_seq"):
        [r async for r in store.replay("t", from_seq=TOO_BIG)]
    assert await everything(store, "t") == before


async def test_the_largest_64_bit_counts_are_stored(store: Any) -> None:
    """A token count of 2**63 - 1 is stored and read back on every backend."""
    (stored,) = await store.append("t", [Message.user("huge")], [INT64_MAX])
    assert stored.tokens == INT64_MAX
    assert (await store.load("t")).tokens == [INT64_MAX]
    assert (await store.stats("t")).total_tokens == INT64_MAX
    assert (await store.load("t", max_tokens=INT64_MAX)).tokens == [INT64_MAX]


async def test_a_token_total_past_64_bits_is_refused(store: Any) -> None:
    """An append taking the thread's token total past 2**63 - 1 raises ConfigError and writes nothing."""
    await store.append("t", [Message.user("huge")], [INT64_MAX])
    before = await everything(store, "t")
    with pytest.raises(ConfigError, match="tokens"):
        await store.append("t", [Message.user("one more")], [1])
    with pytest.raises(ConfigError, match="tokens"):
        await store.record_and_append("t", [said("x")], [Message.user("x")], [1])
    assert await everything(store, "t") == before
    # Counts that each fit but whose sum does not, in one call on another thread.
    a, b = Message.user("a"), Message.user("b")
    for call in (
        lambda: store.append("u", [Message.user("a"), Message.user("b")], [INT64_MAX, INT64_MAX]),
        lambda: store.record_and_append(
            "u", [said("a"), said("b")], [Message.user("a"), Message.user("b")], [INT64_MAX, INT64_MAX]
        ),
        # Each message recorded by its own episode (the step Compactor.append records).
        lambda: store.record_and_append(
            "u",
            [UserMessageEpisode(message=a), UserMessageEpisode(message=b)],
            [a, b],
            [INT64_MAX, INT64_MAX],
            message_episodes=[0, 1],
        ),
    ):
        await store.append("u", [Message.user("first")], [1])  # the thread has rows: the in-place update
        kept = await everything(store, "u")
        with pytest.raises(ConfigError, match="2\\*\\*63"):
            await call()
        assert await everything(store, "u") == kept


async def test_a_cancelled_fold_is_applied_whole_or_not_at_all(store: Any) -> None:
    """Cancelling fold() at any point leaves neither the checkpoint nor the swap, or both."""
    outcomes = set()
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        await say(store, thread, *"abcdef")
        before = await everything(store, thread)

        async def fold(thread: str = thread) -> None:
            await store.fold(
                thread,
                checkpoint=checkpoint(4),
                through_seq=4,
                expected_version=0,
                replacement=[summary()],
                tokens=[1],
            )

        finished = await cancelled_after(turns, fold)
        after = await everything(store, thread)
        window, stats, log, _, latest = after
        if after == before:
            outcomes.add("old")
            assert not finished
        else:
            outcomes.add("new")
            assert [m.seq for m in window.messages] == [4, 5, 6] and window.plain[0] == summary()
            assert stats.version == 1 and stats.total_tokens == 21
            assert log[-1].episode == checkpoint(4) and latest == log[-1]
            assert window.messages[0].episode_seq == log[-1].seq
        async with store.compaction_lock(thread) as mine:
            assert mine
    assert outcomes == {"old", "new"}


async def test_a_cancelled_record_and_append_is_applied_whole_or_not_at_all(store: Any) -> None:
    """Cancelling record_and_append() at any point leaves both memories without the step, or both with it."""
    outcomes = set()
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        await say(store, thread, "first")

        async def step(thread: str = thread) -> None:
            await say(store, thread, "second", "third")

        await cancelled_after(turns, step)
        window = await store.load(thread)
        log = [r async for r in store.replay(thread)]
        assert len(window.messages) == len(log) in (1, 3)
        outcomes.add(len(log))
        assert [m.episode_seq for m in window.messages] == [r.seq for r in log]
        assert (await store.pressure(thread)).total_user_messages == len(log)
    assert outcomes == {1, 3}


async def test_the_rows_a_write_returns_do_not_alias_the_callers_messages(store: Any) -> None:
    """append and record_and_append return copies: editing the caller's message afterwards changes neither.

    SQLiteStore and PostgresStore returned rows holding the caller's own
    message objects (MemoryStore copied), so a metadata dict edited after the
    write showed in what the write had returned, and through it in a
    compactor's cached context, which then disagreed with the store.
    """
    plain = Message.user("a", metadata={"n": 1})
    nested = Message.user("b", metadata={"tags": ["x"]})
    appended = await store.append("t", [plain], [1])
    recorded = await store.record_and_append(
        "t", [UserMessageEpisode(message=nested)], [nested], [1], message_episodes=[0]
    )
    plain.metadata["n"] = 2
    nested.metadata["tags"].append("y")
    assert [row.message.metadata for row in appended + recorded] == [{"n": 1}, {"tags": ["x"]}]
    window = await store.load("t")
    assert [row.message for row in window.messages] == [row.message for row in appended + recorded]


async def test_nan_put_into_metadata_after_building_is_refused(store: Any) -> None:
    """A NaN written into a built message's metadata is refused by the store, not stored as null."""
    message = Message.user("hi", metadata={"scores": [0.5]})
    message.metadata["scores"].append(float("nan"))
    for write in (
        lambda: store.append("t", [message], [1]),
        lambda: store.record_and_append("t", [said("hi")], [message], [1]),
    ):
        with pytest.raises(InvalidMessageError, match="finite") as caught:
            await write()
        assert caught.value.field == "messages[0].metadata.scores[1]"
    assert await store.stats("t") == ThreadStats()
    assert [r async for r in store.replay("t")] == []


@pytest.mark.parametrize("episodes", [None, "said", said("not in a list")])
async def test_record_and_append_needs_a_sequence_of_episodes(store: Any, episodes: Any) -> None:
    """episodes must be a sequence of episodes; anything else is a ConfigError naming it, writing nothing."""
    with pytest.raises(ConfigError, match="episodes"):
        await store.record_and_append("t", episodes, [Message.user("a")], [1])
    assert await store.stats("t") == ThreadStats()
