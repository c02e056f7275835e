"""The ShortTermStore contract, on every backend."""

from __future__ import annotations

import random
import string
from typing import Any

import anyio
import pytest

from contextfold import ConfigError, ConflictError, InvalidMessageError, Message, Role, StoreError, ToolCall
from contextfold.episodes import UserMessageEpisode
from contextfold.messages import SUMMARY_METADATA_KEY
from contextfold.stores import MAX_THREAD_BYTES, ThreadStats

from .conftest import SQL_BACKENDS, OpenStore, RawSQL


def users(count: int, start: int = 0) -> list[Message]:
    return [Message.user(f"message {n}", metadata={"n": n}) for n in range(start, start + count)]


def summary(text: str = "the story so far") -> Message:
    return Message.system(text, metadata={SUMMARY_METADATA_KEY: True})


async def snapshot(store: Any, thread: str) -> tuple[Any, ...]:
    window = await store.load(thread)
    return (await store.stats(thread), window.messages, window.version)


async def test_round_trip_keeps_every_field(store: Any) -> None:
    """Messages of every role, with tool calls, content parts and metadata, load back equal."""
    messages = [
        Message.system("be brief"),
        Message.user([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]),
        Message.assistant(None, tool_calls=[ToolCall(id="c1", name="grep", arguments='{"q": "é"}')]),
        Message.tool("c1", "found 3", metadata={"is_error": False}),
        Message(role=Role.ASSISTANT, content="done", name="bot", metadata={"nested": {"k": [1, None]}}),
    ]
    stored = await store.append("t", messages, [3, 5, 7, 2, 1])
    window = await store.load("t")
    assert window.plain == messages
    assert window.tokens == [3, 5, 7, 2, 1]
    assert [m.seq for m in window.messages] == [1, 2, 3, 4, 5]
    assert list(window.messages) == stored
    assert window.complete and window.total_tokens == 18 and window.version == 0


async def test_appends_continue_the_sequence(store: Any) -> None:
    """Each append numbers its messages right after the thread's newest one, in order."""
    first = await store.append("t", users(3), [1, 1, 1])
    second = await store.append("t", users(2, start=3), [1, 1])
    assert [m.seq for m in first] == [1, 2, 3]
    assert [m.seq for m in second] == [4, 5]
    window = await store.load("t")
    assert [m.message.metadata["n"] for m in window.messages] == [0, 1, 2, 3, 4]


async def test_empty_append_changes_nothing(store: Any) -> None:
    """Appending no messages returns nothing and leaves the thread as it was."""
    await store.append("t", users(2), [4, 4])
    assert await store.append("t", [], []) == []
    assert await store.stats("t") == ThreadStats(message_count=2, total_tokens=8, version=0, last_seq=2)


async def test_unknown_thread_is_empty(store: Any) -> None:
    """A thread never written to loads as an empty, complete window at version 0."""
    window = await store.load("nobody")
    assert window.messages == () and window.complete
    assert window.version == 0 and window.total_tokens == 0
    assert await store.stats("nobody") == ThreadStats()


async def test_stats_track_count_tokens_and_newest_seq(store: Any) -> None:
    """stats() reports message count, token total and newest seq as messages are appended."""
    await store.append("t", users(3), [10, 20, 30])
    await store.append("t", users(1), [5])
    assert await store.stats("t") == ThreadStats(message_count=4, total_tokens=65, version=0, last_seq=4)


async def test_windowed_load_returns_the_newest_messages_that_fit(store: Any) -> None:
    """load(max_tokens=N) returns the newest suffix whose tokens sum to at most N."""
    await store.append("t", users(5), [5, 5, 5, 5, 5])
    window = await store.load("t", max_tokens=12)
    assert [m.seq for m in window.messages] == [4, 5]
    assert not window.complete
    assert window.total_tokens == 25


async def test_windowed_load_that_reaches_the_start_is_complete(store: Any) -> None:
    """A window whose limit covers every message is marked complete."""
    await store.append("t", users(3), [4, 4, 4])
    window = await store.load("t", max_tokens=12)
    assert [m.seq for m in window.messages] == [1, 2, 3]
    assert window.complete


async def test_windowed_load_stops_at_the_first_message_that_does_not_fit(store: Any) -> None:
    """The window is a suffix: an older small message is not taken past a large one that did not fit."""
    await store.append("t", users(4), [1, 100, 1, 1])
    window = await store.load("t", max_tokens=50)
    assert [m.seq for m in window.messages] == [3, 4]
    assert not window.complete


async def test_windowed_load_with_zero_budget_is_empty(store: Any) -> None:
    """max_tokens=0 loads no messages but still reports the thread's totals."""
    await store.append("t", users(2), [1, 1])
    window = await store.load("t", max_tokens=0)
    assert window.messages == () and not window.complete and window.total_tokens == 2


@pytest.mark.parametrize("limit", [-1, 1.5, True, "10"])
async def test_windowed_load_rejects_a_bad_limit(store: Any, limit: Any) -> None:
    """A max_tokens that is not a whole number >= 0 is a ConfigError naming max_tokens."""
    with pytest.raises(ConfigError) as caught:
        await store.load("t", max_tokens=limit)
    assert caught.value.key == "max_tokens"


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_windowed_load_does_not_read_past_the_window(store: Any, raw_sql: RawSQL) -> None:
    """A windowed load never parses rows older than the window, so a corrupt old row does not matter."""
    await store.append("t", users(50), [1] * 50)
    await raw_sql("UPDATE messages SET body = ? WHERE thread = ? AND seq = ?", ["{broken", "t", 3])
    window = await store.load("t", max_tokens=10)
    assert [m.seq for m in window.messages] == list(range(41, 51))
    with pytest.raises(StoreError, match=r"thread 't'.*seq 3"):
        await store.load("t")


async def test_replace_prefix_swaps_the_prefix_for_the_replacement(store: Any) -> None:
    """replace_prefix drops seq <= through_seq, puts the replacement at through_seq and keeps the rest."""
    await store.append("t", users(6), [10, 10, 10, 10, 10, 10])
    stats = await store.replace_prefix(
        "t", through_seq=4, expected_version=0, replacement=[summary()], tokens=[7]
    )
    assert stats == ThreadStats(message_count=3, total_tokens=27, version=1, last_seq=6)
    window = await store.load("t")
    assert [m.seq for m in window.messages] == [4, 5, 6]
    assert window.plain[0] == summary()
    assert [m.message.metadata["n"] for m in window.messages[1:]] == [4, 5]
    assert window.version == 1 and window.total_tokens == 27
    assert await store.stats("t") == stats


async def test_replacement_messages_end_at_the_cut(store: Any) -> None:
    """Several replacement messages take the seqs ending at through_seq, before every kept message."""
    await store.append("t", users(5), [1, 1, 1, 1, 1])
    await store.replace_prefix(
        "t", through_seq=3, expected_version=0, replacement=[summary("a"), summary("b")], tokens=[2, 2]
    )
    window = await store.load("t")
    assert [m.seq for m in window.messages] == [2, 3, 4, 5]
    assert window.plain[:2] == [summary("a"), summary("b")]


async def test_empty_replacement_drops_the_prefix(store: Any) -> None:
    """An empty replacement simply removes the prefix."""
    await store.append("t", users(4), [1, 2, 3, 4])
    stats = await store.replace_prefix("t", through_seq=2, expected_version=0, replacement=[], tokens=[])
    assert stats == ThreadStats(message_count=2, total_tokens=7, version=1, last_seq=4)
    assert [m.seq for m in (await store.load("t")).messages] == [3, 4]


async def test_appends_after_a_replacement_keep_counting_up(store: Any) -> None:
    """Sequence numbers keep counting from the newest message after a prefix replacement."""
    await store.append("t", users(4), [1, 1, 1, 1])
    await store.replace_prefix("t", through_seq=4, expected_version=0, replacement=[summary()], tokens=[1])
    stored = await store.append("t", users(1, start=4), [1])
    assert [m.seq for m in stored] == [5]
    assert [m.seq for m in (await store.load("t")).messages] == [4, 5]


async def test_messages_appended_after_the_load_survive_a_replacement(store: Any) -> None:
    """A replacement guarded by an older load keeps the messages appended since (never loses them)."""
    await store.append("t", users(4), [1, 1, 1, 1])
    window = await store.load("t")
    await store.append("t", users(3, start=4), [1, 1, 1])
    await store.replace_prefix(
        "t",
        through_seq=window.messages[-1].seq,
        expected_version=window.version,
        replacement=[summary()],
        tokens=[1],
    )
    after = await store.load("t")
    assert [m.seq for m in after.messages] == [4, 5, 6, 7]
    assert [m.message.metadata["n"] for m in after.messages[1:]] == [4, 5, 6]


async def test_stale_version_is_a_conflict_and_changes_nothing(store: Any) -> None:
    """A replacement guarded by a version another replacement already moved past raises ConflictError."""
    await store.append("t", users(6), [1] * 6)
    await store.replace_prefix("t", through_seq=2, expected_version=0, replacement=[summary()], tokens=[1])
    before = await snapshot(store, "t")
    with pytest.raises(ConflictError, match="version 1"):
        await store.replace_prefix(
            "t", through_seq=4, expected_version=0, replacement=[summary("late")], tokens=[1]
        )
    assert await snapshot(store, "t") == before


@pytest.mark.parametrize("through_seq", [3, 9])
async def test_unknown_through_seq_is_a_conflict_and_changes_nothing(store: Any, through_seq: int) -> None:
    """Cutting at a seq the thread does not hold (already folded, or not yet written) raises ConflictError."""
    await store.append("t", users(6), [1] * 6)
    await store.replace_prefix("t", through_seq=4, expected_version=0, replacement=[summary()], tokens=[1])
    before = await snapshot(store, "t")
    with pytest.raises(ConflictError, match=f"seq {through_seq}"):
        await store.replace_prefix(
            "t", through_seq=through_seq, expected_version=1, replacement=[summary()], tokens=[1]
        )
    assert await snapshot(store, "t") == before


async def test_replacing_in_an_empty_thread_is_a_conflict(store: Any) -> None:
    """A thread without messages has no prefix to replace."""
    with pytest.raises(ConflictError):
        await store.replace_prefix("t", through_seq=1, expected_version=0, replacement=[], tokens=[])
    assert await store.stats("t") == ThreadStats()


@pytest.mark.parametrize(
    ("messages", "tokens", "error", "field"),
    [
        (users(2), [1], ConfigError, "tokens"),
        (users(3), [1, 1, -1], ConfigError, "tokens[2]"),
        (users(2), [1, 1.5], ConfigError, "tokens[1]"),
        ([*users(1), {"role": "user", "content": "hi"}], [1, 1], InvalidMessageError, "messages[1]"),
        ([*users(1), Message.model_construct(role="wizard")], [1, 1], InvalidMessageError, "messages[1]"),
    ],
    ids=["count-mismatch", "negative", "fraction", "dict", "invalid-message"],
)
async def test_bad_append_is_rejected_before_writing(
    store: Any, messages: list[Any], tokens: list[Any], error: type[Exception], field: str
) -> None:
    """An append with a bad token count or an invalid message raises, naming the field, and writes nothing."""
    await store.append("t", users(1), [1])
    before = await snapshot(store, "t")
    with pytest.raises(error) as caught:
        await store.append("t", messages, tokens)
    assert str(caught.value).startswith(field)
    assert await snapshot(store, "t") == before


async def test_bad_replacement_is_rejected_before_writing(store: Any) -> None:
    """A replacement with a token count per message missing raises ConfigError and changes nothing."""
    await store.append("t", users(4), [1] * 4)
    before = await snapshot(store, "t")
    with pytest.raises(ConfigError, match="tokens"):
        await store.replace_prefix("t", through_seq=2, expected_version=0, replacement=[summary()], tokens=[])
    with pytest.raises(InvalidMessageError, match=r"replacement\[0\]"):
        await store.replace_prefix(
            "t", through_seq=2, expected_version=0, replacement=["summary"], tokens=[1]
        )
    with pytest.raises(ConfigError, match="through_seq"):
        await store.replace_prefix("t", through_seq="2", expected_version=0, replacement=[], tokens=[])
    with pytest.raises(ConflictError, match="no message with seq 0"):  # a seq, but not one the thread holds
        await store.replace_prefix("t", through_seq=0, expected_version=0, replacement=[], tokens=[])
    assert await snapshot(store, "t") == before


@pytest.mark.parametrize("thread", ["", None, 7, "a\x00b"])
async def test_a_thread_must_be_a_non_empty_string(store: Any, thread: Any) -> None:
    """A thread id that is not a non-empty string without NUL is a ConfigError naming ``thread``."""
    with pytest.raises(ConfigError) as caught:
        await store.append(thread, users(1), [1])
    assert caught.value.key == "thread"
    with pytest.raises(ConfigError):
        await store.record(thread, UserMessageEpisode(message=Message.user("x")))


async def test_a_replacement_longer_than_the_prefix_numbers_down_from_the_cut(store: Any) -> None:
    """Replacement messages outnumbering the folded ones end at through_seq, going below 1 if need be."""
    await store.append("t", users(3), [1, 1, 1])
    stats = await store.replace_prefix(
        "t",
        through_seq=1,
        expected_version=0,
        replacement=[summary("a"), summary("b"), summary("c")],
        tokens=[2, 2, 2],
    )
    assert stats == ThreadStats(message_count=5, total_tokens=8, version=1, last_seq=3)
    window = await store.load("t")
    assert [m.seq for m in window.messages] == [-1, 0, 1, 2, 3]
    assert window.plain[:3] == [summary("a"), summary("b"), summary("c")]
    assert [m.seq for m in (await store.load("t", max_tokens=4)).messages] == [1, 2, 3]


async def test_the_complete_tail_and_a_later_cut_reach_rows_numbered_below_1(store: Any) -> None:
    """``tail(after_seq=0)`` is the whole context, seqs 0 and below included, and a cut may end there.

    A replacement longer than the rows it replaces (an edit that adds a
    message to a thread never folded) numbers down past 1. ``tail`` from 0
    read only seqs above 0, so a compactor rebuilding its cached context lost
    those messages, and a ``replace_prefix`` through seq 0 was refused as a
    bad argument.
    """
    await store.append("t", users(2), [1, 1])
    await store.replace_prefix(
        "t", through_seq=2, expected_version=0, replacement=[summary("a"), *users(2)], tokens=[2, 1, 1]
    )
    window = await store.tail("t", after_seq=0)
    assert window.complete and [m.seq for m in window.messages] == [0, 1, 2]
    assert window.plain == (await store.load("t")).plain
    assert [m.seq for m in (await store.tail("t", after_seq=1)).messages] == [2]
    await store.replace_prefix("t", through_seq=0, expected_version=1, replacement=[summary("b")], tokens=[2])
    assert [(m.seq, m.message) for m in (await store.load("t")).messages] == [
        (0, summary("b")),
        *[(seq, message) for seq, message in zip([1, 2], users(2), strict=True)],
    ]


LONGEST = "".join(random.Random(7).choices(string.ascii_letters + string.digits, k=MAX_THREAD_BYTES - 1))
"""An id one byte short of the limit (so ``+ "x"`` fits) that does not compress, as ``"t" * 5000`` did."""


@pytest.mark.parametrize(
    "thread",
    [
        pytest.param(LONGEST + "x", id="at the limit"),
        pytest.param("é" * (MAX_THREAD_BYTES // 2), id="multibyte at the limit"),
    ],
)
async def test_a_thread_id_of_the_longest_size_works(store: Any, thread: str) -> None:
    """An id of ``MAX_THREAD_BYTES`` bytes, counted in UTF-8, is stored and read back on every backend."""
    await store.append(thread, users(2), [1, 2])
    assert (await store.stats(thread)).total_tokens == 3
    assert (await store.load(thread)).thread == thread


@pytest.mark.parametrize(
    "thread",
    [
        pytest.param(LONGEST + "xy", id="one byte over"),
        pytest.param("é" * (MAX_THREAD_BYTES // 2) + "x", id="multibyte one byte over"),
        pytest.param(
            "".join(random.Random(3).choices(string.ascii_letters, k=4000)), id="incompressible 4000"
        ),
    ],
)
async def test_a_thread_id_over_the_limit_is_refused_before_anything_is_written(
    store: Any, thread: str
) -> None:
    """Refused alike on every backend: PostgreSQL's index failed at the first write of a 4,000-byte id."""
    with pytest.raises(ConfigError) as info:
        await store.append(thread, users(1), [1])
    assert info.value.key == "thread"
    assert f"over the {MAX_THREAD_BYTES:,}" in info.value.reason and "sha256" in info.value.reason
    with pytest.raises(ConfigError):
        await store.stats(thread)
    assert await store.threads() == []


async def test_threads_are_isolated(store: Any) -> None:
    """Appends and replacements on one thread leave another thread's messages and counters alone."""
    await store.append("a", users(3), [1, 1, 1])
    await store.append("b", users(2, start=10), [5, 5])
    await store.replace_prefix("a", through_seq=3, expected_version=0, replacement=[summary()], tokens=[1])
    b = await store.load("b")
    assert [m.message.metadata["n"] for m in b.messages] == [10, 11]
    assert await store.stats("b") == ThreadStats(message_count=2, total_tokens=10, version=0, last_seq=2)
    assert (await store.stats("a")).version == 1


ODD_THREADS = [
    pytest.param(LONGEST, id="long"),
    pytest.param("スレッド 🧵 ünïcödé", id="unicode"),
    pytest.param('o\'brien "quoted" `x`', id="quotes"),
    pytest.param("'; DROP TABLE messages; --", id="sql"),
    pytest.param("%s %(x)s {s} ? $1 \\", id="placeholders"),
]


@pytest.mark.parametrize("thread", ODD_THREADS)
async def test_odd_thread_ids_are_plain_keys(store: Any, thread: str) -> None:
    """Long, unicode, quoted and SQL-looking thread ids work as ids and are isolated from similar ones."""
    await store.append(thread, users(3), [1, 2, 3])
    await store.append(thread + "x", users(1), [9])
    await store.replace_prefix(thread, through_seq=2, expected_version=0, replacement=[summary()], tokens=[1])
    window = await store.load(thread, max_tokens=100)
    assert window.thread == thread
    assert [m.seq for m in window.messages] == [2, 3]
    assert await store.stats(thread) == ThreadStats(message_count=2, total_tokens=4, version=1, last_seq=3)
    assert (await store.stats(thread + "x")).total_tokens == 9
    async with store.compaction_lock(thread) as mine:
        assert mine


async def test_compaction_lock_has_one_holder(store: Any, open_store: OpenStore) -> None:
    """While one caller holds a thread's compaction lock, others get False at once, on any handle."""
    other = await open_store()
    async with store.compaction_lock("t") as first:
        async with store.compaction_lock("t") as second, other.compaction_lock("t") as third:
            assert (first, second, third) == (True, False, False)
        async with other.compaction_lock("u") as unrelated:
            assert unrelated
    async with other.compaction_lock("t") as again:
        assert again


async def test_compaction_lock_is_released_when_the_body_raises(store: Any) -> None:
    """An exception inside the lock body releases the lock."""
    with pytest.raises(RuntimeError):
        async with store.compaction_lock("t") as mine:
            assert mine
            raise RuntimeError("summarizer failed")
    async with store.compaction_lock("t") as mine:
        assert mine


async def test_two_replacements_guarded_by_one_read_apply_once(store: Any, open_store: OpenStore) -> None:
    """Two handles racing to replace the same prefix from the same load: one applies, the other conflicts."""
    other = await open_store()
    await store.append("t", users(8), [1] * 8)
    window = await store.load("t")
    results: dict[str, Any] = {}

    async def replace(name: str, handle: Any, through_seq: int) -> None:
        try:
            results[name] = await handle.replace_prefix(
                "t",
                through_seq=through_seq,
                expected_version=window.version,
                replacement=[summary(name)],
                tokens=[1],
            )
        except ConflictError as exc:
            results[name] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(replace, "first", store, 4)
        group.start_soon(replace, "second", other, 6)
    conflicts = [name for name, result in results.items() if isinstance(result, ConflictError)]
    assert len(conflicts) == 1, results
    (winner,) = set(results) - set(conflicts)
    after = await store.load("t")
    assert after.version == 1 and after.plain[0] == summary(winner)
    assert [m.seq for m in after.messages] == list(range(4 if winner == "first" else 6, 9))
