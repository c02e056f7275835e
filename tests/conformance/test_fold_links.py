"""Which episode each row links to after a fold, on every backend.

A fold's replacement is the head it keeps (pinned head, previous summary),
the new summary if any, then the kept messages it rewrote in place (masked
or truncated). Each row keeps the episode link of the row it stands for, and
only a new summary links to the checkpoint, so a later fold that drops those
rows still knows which log seqs it covers.
"""

from __future__ import annotations

from typing import Any

import pytest

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.episodes import SummaryCheckpoint, SystemMessageEpisode, UserMessageEpisode
from contextfold.messages import SUMMARY_METADATA_KEY
from contextfold.tokens import ApproximateCounter


def summary(text: str) -> Message:
    return Message.user(text, metadata={SUMMARY_METADATA_KEY: True})


def fold_of(from_seq: int, through_seq: int, text: str = "so far") -> SummaryCheckpoint:
    return SummaryCheckpoint(trigger="token_budget", from_seq=from_seq, through_seq=through_seq, summary=text)


async def prompt_and_say(store: Any, thread: str, *texts: str) -> None:
    """Record and append a system prompt, then one user message per text, each linked to its episode."""
    messages = [Message.system("be careful"), *(Message.user(text) for text in texts)]
    episodes = [
        SystemMessageEpisode(message=messages[0]),
        *(UserMessageEpisode(message=m) for m in messages[1:]),
    ]
    await store.record_and_append(
        thread, episodes, messages, [10] * len(messages), message_episodes=list(range(len(messages)))
    )


async def links(store: Any, thread: str) -> list[tuple[int, int | None]]:
    return [(m.seq, m.episode_seq) for m in (await store.load(thread)).messages]


async def test_a_fold_links_its_checkpoint_to_the_summary_after_the_pinned_head(store: Any) -> None:
    """The head keeps its episodes, the summary gets the checkpoint's, a rewritten row its original's."""
    await prompt_and_say(store, "t", "a", "b", "c", "d")  # seqs 1..5, episodes 1..5
    record = await store.fold(
        "t",
        checkpoint=fold_of(2, 4),
        through_seq=4,
        expected_version=0,
        replacement=[Message.system("be careful"), summary("a and b"), Message.user("c, cut")],
        tokens=[10, 3, 2],
    )
    assert record.seq == 6
    assert await links(store, "t") == [(2, 1), (3, 6), (4, 4), (5, 5)]


async def test_a_fold_that_rewrites_rows_in_place_keeps_each_rows_link(store: Any) -> None:
    """A fold that only masks (no summary, nothing dropped) leaves every row linked to its own episode."""
    await prompt_and_say(store, "t", "a", "b", "c")
    await store.fold(
        "t",
        checkpoint=fold_of(2, 3, text=""),
        through_seq=3,
        expected_version=0,
        replacement=[Message.system("be careful"), Message.user("[masked]"), Message.user("[masked]")],
        tokens=[10, 1, 1],
    )
    assert await links(store, "t") == [(1, 1), (2, 2), (3, 3), (4, 4)]


async def test_a_fold_without_a_summary_keeps_the_previous_summarys_link(store: Any) -> None:
    """A dropping fold after a summarizing one carries the previous summary over with its own link."""
    await prompt_and_say(store, "t", "a", "b", "c", "d", "e")  # seqs 1..6
    first = await store.fold(
        "t",
        checkpoint=fold_of(2, 3),
        through_seq=3,
        expected_version=0,
        replacement=[Message.system("be careful"), summary("a and b")],
        tokens=[10, 3],
    )  # rows: 2 prompt, 3 summary, 4 c, 5 d, 6 e
    await store.fold(
        "t",
        checkpoint=fold_of(4, 5, text=""),
        through_seq=5,
        expected_version=1,
        replacement=[Message.system("be careful"), summary("a and b"), Message.user("d, cut")],
        tokens=[10, 3, 2],
    )
    assert await links(store, "t") == [(3, 1), (4, first.seq), (5, 5), (6, 6)]


async def test_a_summarizing_fold_after_another_links_only_the_new_summary(store: Any) -> None:
    """The second summary replaces the first and links to the second checkpoint; the head keeps its own."""
    await prompt_and_say(store, "t", "a", "b", "c", "d", "e")
    await store.fold(
        "t",
        checkpoint=fold_of(2, 3),
        through_seq=3,
        expected_version=0,
        replacement=[Message.system("be careful"), summary("a and b")],
        tokens=[10, 3],
    )  # rows: 2 prompt, 3 summary, 4 c, 5 d, 6 e
    second = await store.fold(
        "t",
        checkpoint=fold_of(4, 5, text="a to d"),
        through_seq=5,
        expected_version=1,
        replacement=[Message.system("be careful"), summary("a to d")],
        tokens=[10, 3],
    )
    assert await links(store, "t") == [(4, 1), (5, second.seq), (6, 6)]


async def test_replace_prefix_links_its_replacement_to_no_episode(store: Any) -> None:
    """Without a checkpoint to say which rows a replacement stands for, its rows link no episode."""
    await prompt_and_say(store, "t", "a", "b")
    await store.replace_prefix(
        "t",
        through_seq=2,
        expected_version=0,
        replacement=[Message.system("be careful"), Message.user("[masked]")],
        tokens=[10, 1],
    )
    assert await links(store, "t") == [(1, None), (2, None), (3, 3)]


async def test_the_compactors_fold_links_the_summary_and_keeps_the_prompts_episode(store: Any) -> None:
    """After a Compactor fold the system prompt links its own episode and the summary the checkpoint."""
    options = RunOptions(
        max_history_tokens=4000,
        compaction=SummarizeOptions(trigger_token_budget=2000, min_recent_messages=2),
    )
    compactor = Compactor(store, options=options, counter=ApproximateCounter())
    [prompt] = await compactor.append("t", [Message.system("You are a careful assistant.")])
    result = None
    for n in range(40):
        await compactor.append("t", [Message.user(f"note {n} " + "word " * 40)])
        result = await compactor.maybe_compact("t")
        if result is not None and result.compacted:
            break
    assert result is not None and result.checkpoint_seq is not None
    head, folded = (await store.load("t")).messages[:2]
    assert head.message.role.value == "system" and head.episode_seq == prompt.episode_seq
    assert folded.message.is_summary and folded.episode_seq == result.checkpoint_seq


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-compactors", "one-compactor"])
async def test_masked_rows_summarized_later_give_their_checkpoints_a_log_range(
    store: Any, fresh: bool
) -> None:
    """mask_then_summarize: a checkpoint folding rows an earlier fold masked names their log seqs.

    With a fresh Compactor at each step the rows a fold plans over are the ones
    the store linked; with one Compactor, the ones its cached context linked.
    """
    options = SummarizeOptions(trigger_token_budget=2000, mode="mask_then_summarize", min_recent_messages=2)
    counter = ApproximateCounter()
    compactor = Compactor(store, options=options, counter=counter)
    await compactor.append("t", [Message.system("sys")])
    for n in range(30):
        if fresh:
            compactor = Compactor(store, options=options, counter=counter)
        await compactor.append("t", [Message.user(f"question {n} " + "word " * 10)])
        await compactor.maybe_compact("t")
        call = ToolCall(id=f"c{n}", name="read", arguments="{}")
        await compactor.append(
            "t",
            [
                Message.assistant("reading " + "word " * 10, tool_calls=[call]),
                Message.tool(call.id, "data " * 150),
            ],
        )
    summarized = [
        record.episode
        async for record in store.replay("t")
        if isinstance(record.episode, SummaryCheckpoint) and record.episode.dropped_messages
    ]
    assert len(summarized) > 1
    newest = 0
    for checkpoint in summarized:
        assert checkpoint.log_from_seq is not None and checkpoint.log_through_seq is not None
        assert checkpoint.log_through_seq - checkpoint.log_from_seq + 1 >= checkpoint.dropped_messages
        assert checkpoint.log_from_seq > newest  # no original message is covered twice
        newest = checkpoint.log_through_seq
