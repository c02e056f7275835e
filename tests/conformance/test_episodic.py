"""The EpisodicStore contract, on every backend: an append-only log with O(1) pressure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from contextfold import ConfigError, InvalidMessageError, Message, ToolCall, Usage
from contextfold.episodes import (
    LlmCallEpisode,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    SystemMessageEpisode,
    ToolCallEpisode,
    ToolResultEpisode,
    UserMessageEpisode,
)
from contextfold.planning import EpisodicCompactionPressure
from contextfold.stores import MAX_THREAD_BYTES

from .conftest import SQL_BACKENDS, RawSQL

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def said(text: str) -> UserMessageEpisode:
    return UserMessageEpisode(message=Message.user(text))


def checkpoint(through_seq: int = 4) -> SummaryCheckpoint:
    return SummaryCheckpoint(
        trigger="unfinished_turns", from_seq=1, through_seq=through_seq, summary="so far"
    )


ALL_KINDS = [
    said("hello"),
    SystemMessageEpisode(message=Message.system("be brief")),
    LlmCallEpisode(
        reply=Message.assistant("hi"),
        request_messages=2,
        request_tokens=40,
        model="m",
        usage=Usage(input_tokens=40, output_tokens=2),
    ),
    ToolCallEpisode(call=ToolCall(id="c1", name="grep", arguments='{"q": 1}')),
    ToolResultEpisode(message=Message.tool("c1", "3 hits")),
    RunCompletedEpisode(clean=False),
    SummaryCheckpoint(
        trigger="context_pressure",
        from_seq=1,
        through_seq=5,
        summary="s",
        model="m",
        usage=Usage(input_tokens=9, output_tokens=3),
        degraded=True,
        dropped_messages=5,
        tokens_before=100,
        tokens_after=20,
    ),
    ManualRecoveryBoundary(reason="operator reset", through_seq=5),
]


async def replayed(store: Any, thread: str, from_seq: int = 0) -> list[Any]:
    return [record async for record in store.replay(thread, from_seq=from_seq)]


async def test_every_episode_kind_replays_as_recorded(store: Any) -> None:
    """Each kind of episode replays equal to what was recorded, with seqs 1, 2, ... and its time."""
    records = [
        await store.record("t", episode, at=T0 + timedelta(minutes=n)) for n, episode in enumerate(ALL_KINDS)
    ]
    assert [r.seq for r in records] == list(range(1, len(ALL_KINDS) + 1))
    back = await replayed(store, "t")
    assert back == records
    assert [r.episode for r in back] == ALL_KINDS
    assert back[3].at == T0 + timedelta(minutes=3)


async def test_recorded_time_defaults_to_now_in_utc(store: Any) -> None:
    """Without ``at`` an episode is stamped with the current time, timezone-aware."""
    before = datetime.now(UTC) - timedelta(seconds=5)
    record = await store.record("t", said("hi"))
    (back,) = await replayed(store, "t")
    assert before <= back.at <= datetime.now(UTC) + timedelta(seconds=5)
    assert back.at.utcoffset() == timedelta(0)
    assert abs(back.at - record.at) < timedelta(seconds=5)


async def test_times_in_other_zones_are_kept_as_the_same_instant(store: Any) -> None:
    """An ``at`` in another timezone replays as the same instant."""
    tokyo = datetime(2026, 3, 1, 9, 30, tzinfo=timezone(timedelta(hours=9)))
    await store.record("t", said("hi"), at=tokyo)
    (back,) = await replayed(store, "t")
    assert back.at == tokyo


async def test_naive_times_are_rejected(store: Any) -> None:
    """A naive ``at`` is a ConfigError and records nothing."""
    with pytest.raises(ConfigError) as caught:
        await store.record("t", said("hi"), at=datetime(2026, 1, 1))
    assert caught.value.key == "at"
    assert await replayed(store, "t") == []


async def test_replay_starts_at_from_seq(store: Any) -> None:
    """replay(from_seq=n) yields the episodes with seq >= n, oldest first."""
    for n in range(6):
        await store.record("t", said(f"m{n}"))
    assert [r.seq for r in await replayed(store, "t", from_seq=4)] == [4, 5, 6]
    assert await replayed(store, "t", from_seq=7) == []


@pytest.mark.parametrize("from_seq", [-1, 1.5, "2", None])
async def test_replay_rejects_a_bad_from_seq(store: Any, from_seq: Any) -> None:
    """A from_seq that is not a whole number >= 0 is a ConfigError naming from_seq."""
    await store.record("t", said("a"))
    with pytest.raises(ConfigError) as caught:
        [r async for r in store.replay("t", from_seq=from_seq)]
    assert caught.value.key == "from_seq"


async def test_replay_streams_a_long_log_in_order(store: Any) -> None:
    """A log longer than one read batch replays completely and in order."""
    for n in range(700):
        await store.record("t", said(f"m{n}"))
    back = await replayed(store, "t")
    assert [r.seq for r in back] == list(range(1, 701))
    assert [r.episode.message.text for r in back] == [f"m{n}" for n in range(700)]


@pytest.mark.parametrize("forgetter", ["same-store", "another-store"])
async def test_a_replay_running_when_its_thread_is_forgotten_ends_there(
    open_store: Any, forgetter: str
) -> None:
    """A forget ends a replay that was running: it never goes on into the episodes recorded after it.

    Before, on SQLite and PostgreSQL, the replay read on by seq into the new
    log, whose seqs start over: old 1..256, then new 257..700 as one history.
    """
    store = await open_store()
    other = await open_store() if forgetter == "another-store" else store
    for n in range(600):
        await store.record("t", said(f"old{n}"))
    running = store.replay("t")
    first = [await anext(running) for _ in range(3)]
    await other.forget("t")
    for n in range(700):
        await store.record("t", said(f"new{n}"))
    rest = [record async for record in running]
    assert [r.episode.message.text for r in first] == ["old0", "old1", "old2"]
    assert rest == []
    assert [r.episode.message.text for r in await replayed(store, "t")] == [f"new{n}" for n in range(700)]


async def test_a_replay_sees_a_forget_it_was_not_told_of_at_its_next_batch(
    backend: str, store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forget by another process (no count in this one) ends a replay at its next batch, never later."""
    from contextfold.stores import _postgres, _sqlite

    for module in (_sqlite, _postgres):
        monkeypatch.setattr(module, "forgot", lambda thread: None, raising=False)  # as if another process
    for n in range(600):
        await store.record("t", said(f"old{n}"))
    running = store.replay("t")
    first = await anext(running)
    await store.forget("t")
    for n in range(700):
        await store.record("t", said(f"new{n}"))
    rest = [record async for record in running]
    texts = [r.episode.message.text for r in [first, *rest]]
    assert all(text.startswith("old") for text in texts)
    assert texts == [f"old{n}" for n in range(len(texts))]
    # The read-ahead of the batch it was in at most (256 on SQLite, 500 on PostgreSQL), never the whole log.
    assert len(texts) < 600 if backend != "memory" else len(texts) == 1


async def test_the_api_has_no_way_to_change_the_log(store: Any) -> None:
    """The store offers no method that updates, deletes or rewrites episodes."""
    words = ("update", "delete", "remove", "truncate", "rewrite", "edit", "clear", "purge")
    public = [name for name in dir(store) if not name.startswith("_")]
    assert [name for name in public if any(word in name.lower() for word in words)] == []


@pytest.mark.parametrize("backend", SQL_BACKENDS)
@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE episodes SET body = '{}' WHERE thread = ?",
        "UPDATE episodes SET at = at WHERE thread = ?",
        "DELETE FROM episodes WHERE thread = ?",
    ],
    ids=["update-body", "update-noop", "delete"],
)
async def test_the_database_rejects_changes_to_the_log(store: Any, raw_sql: RawSQL, statement: str) -> None:
    """Raw SQL that updates or deletes episodes is refused by the database itself."""
    await store.record("t", said("hi"))
    before = await replayed(store, "t")
    with pytest.raises(Exception, match="append-only"):
        await raw_sql(statement, ["t"])
    assert await replayed(store, "t") == before


async def test_invalid_episode_is_rejected_before_writing(store: Any) -> None:
    """An object that is not a valid episode raises InvalidMessageError and records nothing."""
    await store.record("t", said("first"))
    bad = [
        {"kind": "user_message", "message": {"role": "user", "content": "x"}},
        Message.user("not an episode"),
        UserMessageEpisode.model_construct(message="not a message"),
    ]
    for episode in bad:
        with pytest.raises(InvalidMessageError):
            await store.record("t", episode)
    assert [r.seq for r in await replayed(store, "t")] == [1]
    assert (await store.pressure("t")).total_user_messages == 1


def counts(pressure: EpisodicCompactionPressure) -> tuple[int, int, int, int]:
    return (
        pressure.user_messages_since_boundary,
        pressure.run_completed_since_boundary,
        pressure.user_messages_after_latest_run_completed,
        pressure.total_user_messages,
    )


async def test_pressure_counts_follow_the_episodes(store: Any) -> None:
    """Each episode moves the counters: (since boundary, clean runs, after completion, total users)."""
    steps: list[tuple[Any, tuple[int, int, int, int]]] = [
        (said("a"), (1, 0, 1, 1)),
        (said("b"), (2, 0, 2, 2)),
        (LlmCallEpisode(reply=Message.assistant("ok")), (2, 0, 2, 2)),
        (RunCompletedEpisode(clean=False), (2, 0, 2, 2)),
        (said("c"), (3, 0, 3, 3)),
        (RunCompletedEpisode(clean=True), (3, 1, 0, 3)),
        (said("d"), (4, 1, 1, 4)),
        (checkpoint(), (0, 0, 0, 4)),
        (said("e"), (1, 0, 1, 5)),
        (RunCompletedEpisode(), (1, 1, 0, 5)),
        (said("f"), (2, 1, 1, 6)),
        (ManualRecoveryBoundary(), (0, 0, 0, 6)),
        (said("g"), (1, 0, 1, 7)),
    ]
    for episode, expected in steps:
        await store.record("t", episode)
        assert counts(await store.pressure("t")) == expected, episode


async def test_pressure_of_an_unknown_thread_is_zero(store: Any) -> None:
    """A thread without episodes has no pressure."""
    assert await store.pressure("nobody", now=T0) == EpisodicCompactionPressure()


async def test_pressure_passes_the_context_estimate_through(store: Any) -> None:
    """The caller's estimated_context_tokens is reported back unchanged."""
    await store.record("t", said("a"))
    pressure = await store.pressure("t", estimated_context_tokens=12_345)
    assert pressure.estimated_context_tokens == 12_345


@pytest.mark.parametrize(
    ("later", "days"),
    [
        (timedelta(0), 0),
        (timedelta(hours=23, minutes=59), 0),
        (timedelta(days=1), 1),
        (timedelta(days=2, hours=12), 2),
        (timedelta(days=400), 400),
        (-timedelta(days=3), 0),
    ],
)
async def test_age_is_whole_days_since_the_first_episode(store: Any, later: timedelta, days: int) -> None:
    """conversation_age_days counts whole days from the thread's first episode to ``now``."""
    await store.record("t", said("a"), at=T0)
    await store.record("t", checkpoint(), at=T0 + timedelta(hours=1))
    await store.record("t", said("b"), at=T0 + timedelta(hours=2))
    assert (await store.pressure("t", now=T0 + later)).conversation_age_days == days


async def test_naive_now_is_rejected(store: Any) -> None:
    """A naive ``now`` is a ConfigError naming ``now``."""
    with pytest.raises(ConfigError) as caught:
        await store.pressure("t", now=datetime(2026, 1, 1))
    assert caught.value.key == "now"


async def test_latest_checkpoint_is_the_newest_boundary(store: Any) -> None:
    """latest_checkpoint returns the newest summary checkpoint or manual-recovery boundary."""
    assert await store.latest_checkpoint("t") is None
    await store.record("t", said("a"))
    assert await store.latest_checkpoint("t") is None
    first = await store.record("t", checkpoint(1), at=T0)
    await store.record("t", said("b"))
    assert await store.latest_checkpoint("t") == first
    second = await store.record("t", checkpoint(3), at=T0)
    await store.record("t", RunCompletedEpisode())
    assert await store.latest_checkpoint("t") == second
    manual = await store.record("t", ManualRecoveryBoundary(reason="reset"), at=T0)
    assert await store.latest_checkpoint("t") == manual


async def test_episodic_threads_are_isolated(store: Any) -> None:
    """Episodes, seqs, pressure and checkpoints of one thread do not leak into another."""
    await store.record("a", said("a1"))
    await store.record("a", checkpoint())
    await store.record("b", said("b1"))
    await store.record("b", said("b2"))
    assert [r.seq for r in await replayed(store, "b")] == [1, 2]
    assert [r.thread for r in await replayed(store, "b")] == ["b", "b"]
    assert counts(await store.pressure("b")) == (2, 0, 2, 2)
    assert await store.latest_checkpoint("b") is None
    assert counts(await store.pressure("a")) == (0, 0, 0, 1)


@pytest.mark.parametrize(
    "thread",
    [
        "t" * (MAX_THREAD_BYTES - 1),
        "スレッド 🧵",
        'o\'brien "q"',
        "'; DELETE FROM episodes; --",
        "%s ? $1 {s}",
    ],
)
async def test_odd_thread_ids_keep_their_own_log(store: Any, thread: str) -> None:
    """Long, unicode, quoted and SQL-looking thread ids record, replay and count like any other."""
    await store.record(thread, said("hi"))
    await store.record(thread + "'", said("other"))
    await store.record(thread, checkpoint())
    back = await replayed(store, thread)
    assert [(r.thread, r.seq) for r in back] == [(thread, 1), (thread, 2)]
    assert (await store.pressure(thread)).total_user_messages == 1
    assert (await store.latest_checkpoint(thread)) == back[1]
