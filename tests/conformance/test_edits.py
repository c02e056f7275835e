"""An edit of the conversation, on every backend: the log records it and the context takes it, or neither.

``Store.record_and_replace`` records the episodes of an edit (the conversation
withdrawn from a message on, and what stays of it recorded again) and swaps
the working context's prefix in one transaction; ``integrations._edits.follow``
plans the edit and writes it that way, holding the thread's ``sync`` lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from contextfold import (
    Compactor,
    ConfigError,
    ConflictError,
    Message,
    RunOptions,
    StoreError,
    SummarizeOptions,
)
from contextfold.episodes import (
    HistoryClearedEpisode,
    MessagesRetractedEpisode,
    SystemMessageEpisode,
    UserMessageEpisode,
    conversation,
)
from contextfold.integrations._edits import Edit, Row, follow, kept, said, withdrawal
from contextfold.stores import StoredMessage, ThreadStats
from contextfold.tokens import ApproximateCounter

from .conftest import SQL_BACKENDS, RawSQL, dialect
from .test_failures import CANCEL_AFTER, cancelled_after
from .test_store import FAIL_MESSAGE_INSERT, everything

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))

# The database refuses the episode that withdraws the conversation: the log's half of an edit.
FAIL_WITHDRAWAL = {
    "sqlite": [
        "CREATE TRIGGER fail_withdrawal BEFORE INSERT ON episodes "
        "WHEN NEW.kind IN ('messages_retracted', 'history_cleared') "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
    ],
    "postgres": [
        "CREATE FUNCTION injected_failure() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'injected failure'; END $$",
        "CREATE TRIGGER fail_withdrawal BEFORE INSERT ON episodes FOR EACH ROW "
        "WHEN (NEW.kind IN ('messages_retracted', 'history_cleared')) EXECUTE FUNCTION injected_failure()",
    ],
}

PROMPT = Message.system("be careful")
REDACTED = Message.user("c, redacted")


async def prompt_and_say(store: Any, thread: str, *texts: str) -> None:
    """Record and append a system prompt, then one user message per text, each linked to its episode."""
    messages = [PROMPT, *(Message.user(text) for text in texts)]
    episodes = [SystemMessageEpisode(message=PROMPT), *(UserMessageEpisode(message=m) for m in messages[1:])]
    await store.record_and_append(
        thread, episodes, messages, [10] * len(messages), message_episodes=list(range(len(messages)))
    )


async def redact(store: Any, thread: str, **options: Any) -> ThreadStats:
    """After ``prompt_and_say(..., "a", "b", "c")``: remove b and rewrite c in one write.

    ``options`` replace the call's keyword arguments.
    """
    arguments: dict[str, Any] = {
        "through_seq": 4,
        "expected_version": 0,
        "replacement": [PROMPT, Message.user("a"), REDACTED],
        "tokens": [10, 10, 4],
        "message_episodes": [None, None, 1],
        "stands_for": [1, 2, None],
    }
    episodes = [MessagesRetractedEpisode(count=2), UserMessageEpisode(message=REDACTED)]
    stats: ThreadStats = await store.record_and_replace(thread, episodes, **{**arguments, **options})
    return stats


async def agree(store: Any, thread: str) -> list[str]:
    """The context's texts, once known to be what a replay of the log gives."""
    replayed = conversation([record async for record in store.replay(thread)])
    context = (await store.load(thread)).plain
    assert [m.text for m in replayed] == [m.text for m in context]
    return [m.text for m in context]


async def test_record_and_replace_records_the_edit_and_swaps_the_prefix(store: Any) -> None:
    """The log withdraws and records again, the context takes the edit, and each row links as it should."""
    await prompt_and_say(store, "t", "a", "b", "c")  # rows 1..4, episodes 1..4
    stats = await redact(store, "t")
    assert stats == ThreadStats(message_count=3, total_tokens=24, version=1, last_seq=4)
    window = await store.load("t")
    assert [(m.seq, m.message, m.tokens, m.episode_seq) for m in window.messages] == [
        (2, PROMPT, 10, 1),  # kept: its own episode
        (3, Message.user("a"), 10, 2),
        (4, REDACTED, 4, 6),  # recorded again: the episode that did
    ]
    log = [record async for record in store.replay("t")]
    assert [r.episode for r in log[4:]] == [
        MessagesRetractedEpisode(count=2),
        UserMessageEpisode(message=REDACTED),
    ]
    assert [r.seq for r in log] == [1, 2, 3, 4, 5, 6]
    assert conversation(log) == window.plain
    assert (await store.pressure("t")).total_user_messages == 4
    assert await store.stats("t") == stats


async def test_record_and_replace_leaves_the_messages_after_the_cut(store: Any) -> None:
    """Messages appended after the context was loaded keep their rows and links; the episodes follow them."""
    await prompt_and_say(store, "t", "a", "b", "c")
    window = await store.load("t")
    await prompt_and_say(store, "t", "late")  # rows 5, 6; episodes 5, 6
    await store.record_and_replace(
        "t",
        [UserMessageEpisode(message=Message.user("a again"))],
        through_seq=2,
        expected_version=window.version,
        replacement=[Message.user("a again")],
        tokens=[3],
        message_episodes=[0],
    )
    after = await store.load("t")
    assert [(m.seq, m.message.text, m.episode_seq) for m in after.messages] == [
        (2, "a again", 7),
        (3, "b", 3),
        (4, "c", 4),
        (5, "be careful", 5),
        (6, "late", 6),
    ]
    assert after.total_tokens == 3 + 4 * 10


async def test_a_row_standing_for_no_replaced_row_links_no_episode(store: Any) -> None:
    """Without an episode of its own, a row links only what the replaced row it names linked."""
    await prompt_and_say(store, "t", "a", "b", "c")
    await store.record_and_replace(
        "t",
        [HistoryClearedEpisode()],
        through_seq=3,
        expected_version=0,
        replacement=[Message.user("x"), Message.user("y"), Message.user("z")],
        tokens=[1, 1, 1],
        stands_for=[2, 4, None],  # row 4 is after the cut
    )
    assert [(m.seq, m.episode_seq) for m in (await store.load("t")).messages] == [
        (1, 2),
        (2, None),
        (3, None),
        (4, 4),
    ]


async def test_rows_numbered_0_and_below_keep_their_links_through_a_second_edit(store: Any) -> None:
    """An edit that adds rows numbers them down past seq 1; the next edit's ``stands_for`` may name them.

    ``stands_for`` took only seqs of 1 and above, so after a first edit had
    numbered a row 0 (an abandoned call's result put in place, say) every
    later edit naming it was a ``ConfigError``: each compaction check of the
    thread failed from then on.
    """
    await prompt_and_say(store, "t", "a")  # rows 1, 2; episodes 1, 2
    first = [PROMPT, Message.user("a"), Message.user("b")]
    await store.record_and_replace(
        "t",
        [UserMessageEpisode(message=first[2])],
        through_seq=2,
        expected_version=0,
        replacement=first,
        tokens=[10, 10, 1],
        message_episodes=[None, None, 0],
        stands_for=[1, 2, None],
    )
    assert [(m.seq, m.episode_seq) for m in (await store.load("t")).messages] == [(0, 1), (1, 2), (2, 3)]
    second = [PROMPT, Message.user("a"), Message.user("b"), Message.user("c")]
    await store.record_and_replace(
        "t",
        [UserMessageEpisode(message=second[3])],
        through_seq=2,
        expected_version=1,
        replacement=second,
        tokens=[10, 10, 1, 1],
        message_episodes=[None, None, None, 0],
        stands_for=[0, 1, 2, None],
    )
    window = await store.load("t")
    assert [(m.seq, m.message.text, m.episode_seq) for m in window.messages] == [
        (-1, "be careful", 1),
        (0, "a", 2),
        (1, "b", 3),
        (2, "c", 4),
    ]
    assert await agree(store, "t") == ["be careful", "a", "b", "c"]


async def test_record_and_replace_without_episodes_is_a_linked_replace_prefix(store: Any) -> None:
    """With no episode to record it swaps the prefix, and a thread without a log gets none."""
    await store.append("t", [Message.user("a"), Message.user("b")], [1, 1])
    stats = await store.record_and_replace(
        "t", [], through_seq=1, expected_version=0, replacement=[Message.user("a2")], tokens=[2]
    )
    assert stats == ThreadStats(message_count=2, total_tokens=3, version=1, last_seq=2)
    assert [r async for r in store.replay("t")] == []
    assert (await store.pressure("t", now=datetime(2100, 1, 1, tzinfo=UTC))).conversation_age_days == 0
    assert [info.episodes for info in await store.threads()] == [0]


@pytest.mark.parametrize(("through_seq", "version"), [(4, 1), (9, 0), (1, 7)])
async def test_a_conflicting_record_and_replace_writes_nothing(
    store: Any, through_seq: int, version: int
) -> None:
    """An edit whose version moved or whose seq is gone raises ConflictError and records no episode."""
    await prompt_and_say(store, "t", "a", "b", "c")
    before = await everything(store, "t")
    with pytest.raises(ConflictError):
        await redact(store, "t", through_seq=through_seq, expected_version=version)
    assert await everything(store, "t") == before


async def test_an_edit_after_a_fold_of_the_same_read_conflicts(store: Any) -> None:
    """A replacement that lands between the load and the edit makes the edit conflict, leaving it alone."""
    await prompt_and_say(store, "t", "a", "b", "c")
    window = await store.load("t")
    await store.replace_prefix(
        "t", through_seq=2, expected_version=window.version, replacement=[PROMPT], tokens=[10]
    )
    after_replace = await everything(store, "t")
    with pytest.raises(ConflictError):
        await redact(store, "t", expected_version=window.version)
    assert await everything(store, "t") == after_replace


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"message_episodes": [0, 2, None]}, "message_episodes\\[1\\]"),
        ({"message_episodes": [None]}, "message_episodes"),
        ({"stands_for": [1, True, None]}, "stands_for\\[1\\]"),
        ({"stands_for": [1, "2", None]}, "stands_for\\[1\\]"),
        ({"stands_for": [1]}, "stands_for"),
    ],
)
async def test_record_and_replace_rejects_bad_links_before_writing(
    store: Any, options: dict[str, Any], key: str
) -> None:
    """Links that index no episode, or seqs that are not whole numbers, are ConfigErrors; none is written."""
    await prompt_and_say(store, "t", "a", "b", "c")
    before = await everything(store, "t")
    with pytest.raises(ConfigError, match=key):
        await redact(store, "t", **options)
    assert await everything(store, "t") == before


async def test_a_cancelled_record_and_replace_is_applied_whole_or_not_at_all(store: Any) -> None:
    """Cancelling record_and_replace() at any point leaves the log and the context both edited or both not."""
    outcomes = set()
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        await prompt_and_say(store, thread, "a", "b", "c")
        before = await everything(store, thread)

        async def edit(thread: str = thread) -> None:
            await redact(store, thread)

        finished = await cancelled_after(turns, edit)
        after = await everything(store, thread)
        if after == before:
            outcomes.add("old")
            assert not finished
        else:
            outcomes.add("new")
            assert after[1] == ThreadStats(message_count=3, total_tokens=24, version=1, last_seq=4)
            assert len(after[2]) == 6
        assert await agree(store, thread) in (
            ["be careful", "a", "b", "c"],
            ["be careful", "a", "c, redacted"],
        )
    assert outcomes == {"old", "new"}


@pytest.mark.parametrize("backend", SQL_BACKENDS)
@pytest.mark.parametrize("half", ["log", "context"])
async def test_record_and_replace_failing_in_the_database_writes_neither(
    backend: str, half: str, store: Any, raw_sql: RawSQL
) -> None:
    """When the database refuses the withdrawal, or a replacement row, the other half is rolled back too."""
    await prompt_and_say(store, "t", "a", "b", "c")
    before = await everything(store, "t")
    failing = FAIL_WITHDRAWAL if half == "log" else FAIL_MESSAGE_INSERT
    for statement in failing[dialect(backend)]:
        await raw_sql(statement, [])
    with pytest.raises(StoreError, match="injected failure"):
        await redact(store, "t", tokens=[10, 10, 666])
    assert await everything(store, "t") == before


# Following an edit through ``_edits.follow``: the adapters' one path.


async def synced(store: Any, thread: str, *texts: str) -> Compactor:
    """A compactor over ``store`` whose thread holds one user message per text, each keyed by its text."""
    compactor = Compactor(store, options=NEVER_FOLDS, counter=ApproximateCounter())
    await compactor.sync(thread, [Message.user(text) for text in texts], ids=list(texts), compact=False)
    return compactor


def removing(compactor: Compactor, thread: str, key: str) -> Any:
    """The plan that removes the message keyed ``key`` from the context and the conversation."""

    async def plan(window: Sequence[StoredMessage]) -> Edit:
        context = [kept(stored) for stored in window if stored.message.metadata.get("contextfold.key") != key]
        said_now = await said(compactor, thread)
        first = next(n for n, m in enumerate(said_now) if m.metadata.get("contextfold.key") == key)
        again = [m for m in said_now[first + 1 :]]
        return withdrawal(len(said_now), first, again, context)

    return plan


async def test_a_followed_edit_links_what_it_records_again(store: Any) -> None:
    """The kept head keeps its episodes; each message after the removed one links its new episode."""
    compactor = await synced(store, "t", "a", "b", "c", "d")
    await follow(compactor, "t", removing(compactor, "t", "b"))
    assert await agree(store, "t") == ["a", "c", "d"]
    log = [record async for record in store.replay("t")]
    assert [r.episode for r in log[4:5]] == [MessagesRetractedEpisode(count=3)]
    assert [(m.seq, m.episode_seq) for m in (await store.load("t")).messages] == [(2, 1), (3, 6), (4, 7)]
    assert await compactor.context("t") == (await store.load("t")).plain


async def test_an_edit_cancelled_at_any_point_leaves_the_log_and_the_context_agreeing(store: Any) -> None:
    """Cancelling a followed edit anywhere leaves both memories edited, or both as they were."""
    outcomes = set()
    for turns in CANCEL_AFTER:
        thread = f"t{turns}"
        compactor = await synced(store, thread, "a", "b", "c")

        async def edit(compactor: Compactor = compactor, thread: str = thread) -> None:
            await follow(compactor, thread, removing(compactor, thread, "b"))

        await cancelled_after(turns, edit)
        outcomes.add(tuple(await agree(store, thread)))
        # The thread's lock was given back: a step of it goes on.
        await compactor.sync(thread, [Message.user("next")], ids=["next"], compact=False)
    assert outcomes == {("a", "b", "c"), ("a", "c")}


@pytest.mark.parametrize("backend", SQL_BACKENDS)
async def test_an_edit_whose_log_write_fails_leaves_both_memories_as_they_were(
    backend: str, store: Any, raw_sql: RawSQL
) -> None:
    """The database refusing the withdrawal leaves the context unedited too; the edit can be made again."""
    compactor = await synced(store, "t", "a", "b", "c")
    before = await everything(store, "t")
    for statement in FAIL_WITHDRAWAL[dialect(backend)]:
        await raw_sql(statement, [])
    with pytest.raises(StoreError, match="injected failure"):
        await follow(compactor, "t", removing(compactor, "t", "b"))
    assert await everything(store, "t") == before
    assert await compactor.context("t") == before[0].plain
    await raw_sql(
        "DROP TRIGGER fail_withdrawal" + (" ON episodes" if dialect(backend) == "postgres" else ""), []
    )
    await follow(compactor, "t", removing(compactor, "t", "b"))
    assert await agree(store, "t") == ["a", "c"]


async def test_an_edit_a_fold_comes_between_is_planned_again_and_written_once(store: Any) -> None:
    """A replacement between the edit's load and its write conflicts; the edit loads again, then applies."""
    compactor = await synced(store, "t", "a", "b", "c")
    plans = []
    remove_b = removing(compactor, "t", "b")

    async def plan(window: Sequence[StoredMessage]) -> Edit:
        plans.append([stored.seq for stored in window])
        if len(plans) == 1:  # another worker's fold, say, rewrites the head meanwhile
            head = window[0]
            await store.replace_prefix(
                "t",
                through_seq=head.seq,
                expected_version=0,
                replacement=[head.message],
                tokens=[head.tokens],
            )
        return await remove_b(window)

    await follow(compactor, "t", plan)
    assert plans == [[1, 2, 3], [1, 2, 3]]
    assert await agree(store, "t") == ["a", "c"]
    withdrawals = [r async for r in store.replay("t") if isinstance(r.episode, MessagesRetractedEpisode)]
    assert len(withdrawals) == 1
    assert (await store.stats("t")).version == 2


async def test_a_step_of_the_thread_waits_for_an_edit_under_way(store: Any) -> None:
    """A sync started while an edit is between its reads and its write lands after the write, and stays."""
    compactor = await synced(store, "t", "a", "b", "c")
    stepped = anyio.Event()
    remove_b = removing(compactor, "t", "b")

    async def step() -> None:
        await compactor.sync("t", [Message.user("meanwhile")], ids=["m"], compact=False)
        stepped.set()

    async with anyio.create_task_group() as group:

        async def plan(window: Sequence[StoredMessage]) -> Edit:
            edit = await remove_b(window)  # the log is read: the worst moment for a step to land
            group.start_soon(step)
            for _ in range(200):
                await checkpoint()
            assert not stepped.is_set()
            return edit

        await follow(compactor, "t", plan)
    assert stepped.is_set()
    assert await agree(store, "t") == ["a", "c", "meanwhile"]
    withdrawn = [r async for r in store.replay("t") if isinstance(r.episode, MessagesRetractedEpisode)]
    assert [r.episode.count for r in withdrawn] == [2]


async def test_an_edit_with_nothing_to_replace_records_its_episodes(store: Any) -> None:
    """An empty context (nothing to cut) still records the edit's episodes, in one write."""
    compactor = Compactor(store, options=NEVER_FOLDS, counter=ApproximateCounter())
    await store.record("t", UserMessageEpisode(message=Message.user("only logged")))

    async def plan(window: Sequence[StoredMessage]) -> Edit:
        assert list(window) == []
        return Edit([HistoryClearedEpisode()], [Row(Message.user("x"), None)])

    await follow(compactor, "t", plan)
    assert await agree(store, "t") == []


async def test_a_step_on_another_event_loop_waits_for_an_edit_under_way(store: Any) -> None:
    """An edit made on an event loop of its own (LangChain's invoke) holds back a sync on this loop."""
    compactor = await synced(store, "t", "a", "b", "c")
    planning, planned = threading.Event(), threading.Event()
    remove_b = removing(compactor, "t", "b")

    async def plan(window: Sequence[StoredMessage]) -> Edit:
        edit = await remove_b(window)
        planning.set()
        await anyio.to_thread.run_sync(planned.wait)
        return edit

    def edit_on_a_loop_of_its_own() -> None:
        anyio.run(follow, compactor, "t", plan)

    stepped = anyio.Event()

    async def step() -> None:
        await compactor.sync("t", [Message.user("meanwhile")], ids=["m"], compact=False)
        stepped.set()

    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, edit_on_a_loop_of_its_own)
        await anyio.to_thread.run_sync(planning.wait)
        group.start_soon(step)
        try:
            for _ in range(200):
                await checkpoint()
            assert not stepped.is_set()
        finally:
            planned.set()
    assert await agree(store, "t") == ["a", "c", "meanwhile"]
