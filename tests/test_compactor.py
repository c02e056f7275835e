"""maybe_compact and compact_now, end to end on real stores."""

from __future__ import annotations

import gc
import json
import logging
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

import contextfold._compactor as compactor_module
from contextfold import (
    Compactor,
    ConfigError,
    EpisodicCompactionConfig,
    InvalidMessageError,
    Message,
    Role,
    RunOptions,
    StoreError,
    SummarizeOptions,
    SummarizerError,
    ToolCall,
    conversation,
)
from contextfold.episodes import ManualRecoveryBoundary, SummaryCheckpoint
from contextfold.messages import SUMMARY_METADATA_KEY, SUMMARY_PREFIX, TRUNCATED_METADATA_KEY
from contextfold.stores import MemoryStore, SQLiteStore, StoredMessage
from contextfold.summarizers import FunctionSummarizer, Summary
from contextfold.tokens import ApproximateCounter, TiktokenCounter

THREAD = "t-1"


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    backend = MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "cf.db")
    async with backend:
        yield backend


@pytest.fixture()
async def another_handle(store: Any) -> AsyncIterator[Any]:
    """What a second worker opens on ``store``: the same ``MemoryStore``, or the SQLite file opened again."""
    if isinstance(store, SQLiteStore):
        async with SQLiteStore(store.path) as other:
            yield other
    else:
        yield store


def options(budget: int = 400, **overrides: Any) -> RunOptions:
    settings: dict[str, Any] = {
        "trigger_token_budget": budget,
        "max_summary_tokens": 60,
        "min_recent_messages": 2,
    }
    settings.update(overrides)
    return RunOptions(max_history_tokens=budget * 2, compaction=SummarizeOptions(**settings))


def recorder() -> FunctionSummarizer:
    async def fn(messages: Sequence[Message], previous: str | None, limit: int) -> Summary:
        names = ",".join(m.metadata.get("n", "?") for m in messages)
        text = f"{previous or ''}|{names}"
        return Summary(text=text[-300:], model="recorder")

    return FunctionSummarizer(fn)


def turn(n: int, size: int = 60) -> list[Message]:
    """One user turn and one tool step with its result, each message tagged with an id."""
    call = ToolCall(id=f"c{n}", name="read_file", arguments=json.dumps({"path": f"src/f{n}.py"}))
    return [
        Message.user(f"task {n}: " + "word " * size, metadata={"n": f"u{n}"}),
        Message.assistant(None, tool_calls=[call], metadata={"n": f"a{n}"}),
        Message.tool(f"c{n}", "line\n" * size, metadata={"n": f"r{n}"}),
    ]


async def grow(compactor: Compactor, turns: range, *, compact: bool = True) -> list[Any]:
    results = []
    for n in turns:
        await compactor.append(THREAD, turn(n))
        if compact:
            results.append(await compactor.maybe_compact(THREAD))
    return results


async def test_no_trigger_returns_none_without_loading_or_tokenizing(store: Any) -> None:
    """Below the budget maybe_compact returns None without loading the thread or counting tokens.

    The first check of a thread in a process reads its context once, as
    ``context()`` would (an unanswered call made before may be abandoned by
    now); the step's appends keep that current, so later checks read none.
    """
    counter = TiktokenCounter()
    compactor = Compactor(store, options=options(budget=100_000), counter=counter)
    await grow(compactor, range(20), compact=False)
    assert await compactor.maybe_compact(THREAD) is None
    await grow(compactor, range(20, 22), compact=False)
    reads = counted_reads(store)
    misses = counter.misses
    assert await compactor.maybe_compact(THREAD) is None
    assert "load" not in reads and "tail" not in reads
    assert counter.misses == misses


def counted_reads(store: Any) -> list[str]:
    """The list each read of ``store`` (tail, load, state, stats) appends its name to, from now on."""
    reads: list[str] = []
    for name in ("tail", "load", "state", "stats"):
        real = getattr(store, name)

        def counting(real: Any = real, name: str = name) -> Any:
            async def read(*args: Any, **kwargs: Any) -> Any:
                reads.append(name)
                return await real(*args, **kwargs)

            return read

        setattr(store, name, counting())
    return reads


@pytest.mark.parametrize("right_after", [False, True], ids=["check-reads", "write-read"])
async def test_a_step_reads_from_the_store_only_its_check(
    store: Any, right_after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Check, context, then append a call with its result: one stats() read at most, no tail or load.

    A batch that makes a tool call and answers it used to re-read the thread's
    tail to find the call open, on every tool step. Right after the step's own
    write (within ``_SEEN_STANDS_FOR``) the write's read of the thread stands
    for the check's, and the step reads nothing.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0 if right_after else 0.05)
    compactor = Compactor(store, options=options(budget=100_000), counter=ApproximateCounter())
    await grow(compactor, range(3))
    await compactor.context(THREAD)
    reads = counted_reads(store)
    for n in range(3, 8):
        if not right_after:
            await anyio.sleep(0.06)  # a model call: the write's read no longer stands for the check
        reads.clear()
        assert await compactor.maybe_compact(THREAD) is None
        context = await compactor.context(THREAD)
        await compactor.append(THREAD, turn(n))
        assert reads == ([] if right_after else ["stats"]), f"step {n} read {reads}"
        assert [m.metadata["n"] for m in context[-3:]] == [f"u{n - 1}", f"a{n - 1}", f"r{n - 1}"]
    assert [m.metadata["n"] for m in await compactor.context(THREAD)][-3:] == ["u7", "a7", "r7"]


async def test_a_naive_now_is_refused_whether_or_not_the_check_reads_the_log(store: Any) -> None:
    """Without the episodic policy the check reads the stats alone, and still refuses a naive ``now``."""
    compactor = Compactor(store, options=options(budget=100_000), counter=ApproximateCounter())
    await grow(compactor, range(2))
    with pytest.raises(ConfigError, match="timezone-aware") as caught:
        await compactor.maybe_compact(THREAD, now=datetime(2026, 1, 1))
    assert caught.value.key == "now"
    assert await compactor.maybe_compact(THREAD, now=datetime(2026, 1, 1, tzinfo=UTC)) is None


@pytest.mark.parametrize("right_after", [False, True], ids=["check-reads", "write-read"])
async def test_a_step_that_folds_sends_the_folded_context_without_reading_it_back(
    store: Any, right_after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a fold, the step's context() is the folded context: no read after the fold.

    The fold consumed the step's check, so context() used to read the thread's
    tail once more (finding no new rows) after every fold. A folding step reads
    the stats once more, under the lease and before the summary (another worker
    may have folded since the check), and nothing after. The check itself
    reads nothing when the step's own write read the thread a moment before.
    """
    monkeypatch.setattr(compactor_module, "_SEEN_STANDS_FOR", 60.0 if right_after else 0.05)
    check = [] if right_after else ["stats"]
    compactor = Compactor(store, options=options(budget=1_500), counter=ApproximateCounter())
    reads = counted_reads(store)
    await compactor.append(THREAD, turn(0))
    await compactor.context(THREAD)  # the cache is filled
    folds = 0
    for n in range(1, 30):
        await compactor.append(THREAD, turn(n))
        if not right_after:
            await anyio.sleep(0.06)  # a model call: the write's read no longer stands for the check
        reads.clear()
        result = await compactor.maybe_compact(THREAD)
        context = await compactor.context(THREAD)
        folded = result is not None and result.compacted
        assert reads == ([*check, "stats"] if folded else check), f"step {n} read {reads}"
        if folded:
            folds += 1
            stored = (await store.load(THREAD)).plain
            assert [(m.role, m.text, m.metadata) for m in context] == [
                (m.role, m.text, m.metadata) for m in stored
            ]
            assert context[0].metadata.get(SUMMARY_METADATA_KEY) is True
            assert context[-1].metadata["n"] == f"r{n}"
    assert folds >= 2


async def test_a_no_op_check_does_not_wait_behind_other_ready_tasks(store: Any) -> None:
    """A no-op maybe_compact lets no other task run: with many busy agents it does not wait a round.

    MemoryStore's state() used to yield to the scheduler, so under 50 busy
    agents on one loop a dictionary lookup waited for all of their steps
    (no-op check p99 13.9 ms in bench_agents, against 0.49 ms on SQLite).
    """
    compactor = Compactor(store, options=options(budget=100_000), counter=ApproximateCounter())
    await grow(compactor, range(3))
    assert await compactor.maybe_compact(THREAD) is None  # the connections are open, the cache warm
    turns = 0
    done = False

    async def busy() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        for _ in range(5):
            group.start_soon(busy)
        await anyio.lowlevel.checkpoint()
        others = turns
        for _ in range(20):
            assert await compactor.maybe_compact(THREAD) is None
        others = turns - others
        done = True
    assert others == 0, f"other tasks ran {others} turns during 20 no-op checks"


async def test_steps_and_folds_leave_no_garbage_for_the_collector(store: Any) -> None:
    """Recording, checking and folding free everything by reference counting: no cycles.

    Every SQLiteStore write used to leave a reference cycle (its job and the
    job's notifier) holding the step's episodes and messages until a
    collection, about 29 objects per step, which made full collections with
    50 agents longer and more frequent.
    """
    compactor = Compactor(store, options=options(), summarizer=recorder(), counter=ApproximateCounter())
    await grow(compactor, range(3))  # the connections are open, the caches warm
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        # What an earlier test's thread lets go of meanwhile is not this test's garbage: only
        # contextfold's own objects made during these steps count.
        before = {id(o) for o in gc.get_objects()}
        results = await grow(compactor, range(3, 15))
        await compactor.context(THREAD)
        gc.collect()
        garbage = [
            type(o).__qualname__
            for o in gc.garbage
            if id(o) not in before and type(o).__module__.startswith("contextfold")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert any(r is not None and r.compacted for r in results)
    assert garbage == []


async def test_compaction_rewrites_to_pinned_head_summary_and_verbatim_tail(store: Any) -> None:
    """A firing trigger leaves [system prompt, summary, ...recent turns verbatim] and records a checkpoint."""
    summarizer = recorder()
    compactor = Compactor(store, options=options(), summarizer=summarizer, counter=ApproximateCounter())
    await compactor.append(THREAD, [Message.system("be careful", metadata={"n": "sys"})])
    await grow(compactor, range(6), compact=False)
    before = await compactor.context(THREAD)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    after = await compactor.context(THREAD)
    assert after[0].text == "be careful"
    assert after[1].is_summary and after[1].text.startswith(SUMMARY_PREFIX)
    assert after[1].role.value == "user"
    tail = after[2:]
    assert tail == before[len(before) - len(tail) :]
    assert result.dropped_messages == len(before) - 1 - len(tail)
    assert result.tokens_after < result.tokens_before
    assert result.reason == "token_count"
    checkpoint = await store.latest_checkpoint(THREAD)
    assert isinstance(checkpoint.episode, SummaryCheckpoint)
    assert checkpoint.episode.dropped_messages == result.dropped_messages
    assert checkpoint.episode.summary == after[1].text.removeprefix(SUMMARY_PREFIX)
    assert (await store.stats(THREAD)).total_tokens == result.tokens_after


async def test_tool_calls_stay_with_their_results(store: Any) -> None:
    """After compaction every kept tool result's call is kept, and no kept call lacks its result."""
    compactor = Compactor(
        store, options=options(budget=300), summarizer=recorder(), counter=ApproximateCounter()
    )
    for n in range(12):
        calls = [ToolCall(id=f"p{n}-{k}", name="search", arguments="{}") for k in range(3)]
        await compactor.append(
            THREAD,
            [Message.user(f"q{n} " * 40, metadata={"n": f"u{n}"}), Message.assistant(None, tool_calls=calls)],
        )
        await compactor.append(THREAD, [Message.tool(c.id, "hit " * 30) for c in reversed(calls)])
        await compactor.maybe_compact(THREAD)
    context = await compactor.context(THREAD)
    calls_kept = {c.id for m in context for c in m.tool_calls}
    results_kept = {m.tool_call_id for m in context if m.tool_call_id}
    assert calls_kept == results_kept
    assert any(m.is_summary for m in context)


async def test_summaries_are_incremental(store: Any) -> None:
    """Each original message reaches the summarizer at most once, and the previous summary is passed on."""
    summarizer = recorder()
    compactor = Compactor(
        store, options=options(budget=300), summarizer=summarizer, counter=ApproximateCounter()
    )
    results = await grow(compactor, range(30))
    assert sum(1 for r in results if r is not None and r.compacted) >= 3
    seen = [m.metadata.get("n") for call in summarizer.calls for m in call[0]]
    assert len(seen) == len(set(seen))
    assert all(not m.is_summary for call in summarizer.calls for m in call[0])
    assert summarizer.calls[0][1] is None
    assert all(call[1] for call in summarizer.calls[1:])


async def test_summarizer_failure_raise_leaves_everything_as_it_was(store: Any) -> None:
    """With on_summarizer_error='raise' a failing summarizer raises SummarizerError and nothing is written."""

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise SummarizerError("provider down", status=503)

    compactor = Compactor(
        store,
        options=options(on_summarizer_error="raise"),
        summarizer=FunctionSummarizer(broken),
        counter=ApproximateCounter(),
    )
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    log = [r async for r in store.replay(THREAD)]
    with pytest.raises(SummarizerError, match="provider down"):
        await compactor.maybe_compact(THREAD)
    assert await store.load(THREAD) == before
    assert [r async for r in store.replay(THREAD)] == log


async def test_summarizer_failure_skip_writes_nothing_and_backs_off(store: Any) -> None:
    """With on_summarizer_error='skip' the step goes on uncompacted and nothing is written."""

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise SummarizerError("provider down", status=503)

    summarizer = FunctionSummarizer(broken)
    compactor = Compactor(
        store,
        options=options(on_summarizer_error="skip"),
        summarizer=summarizer,
        counter=ApproximateCounter(),
    )
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled
    assert await store.load(THREAD) == before
    assert await store.latest_checkpoint(THREAD) is None
    assert await compactor.maybe_compact(THREAD) is None  # backing off: no second call right away
    assert len(summarizer.calls) == 1


async def test_summarizer_failure_fallback_marks_the_checkpoint_degraded(store: Any) -> None:
    """The default policy falls back to the extractive summarizer and marks the checkpoint degraded."""

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise SummarizerError("provider down", status=503)

    compactor = Compactor(
        store, options=options(), summarizer=FunctionSummarizer(broken), counter=ApproximateCounter()
    )
    await grow(compactor, range(6), compact=False)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.degraded
    assert result.summarizer_model == "extractive"
    checkpoint = await store.latest_checkpoint(THREAD)
    assert checkpoint.episode.degraded
    context = await compactor.context(THREAD)
    assert context[0].is_summary and context[0].metadata.get("contextfold.degraded")
    assert "src/f4.py" in context[0].text


@pytest.mark.parametrize("policy", ["fallback", "raise"])
async def test_a_summary_no_store_can_hold_is_the_summarizers_failure(store: Any, policy: str) -> None:
    """A lone surrogate in the summary (a JSON reply may carry one) meets ``on_summarizer_error``.

    It raised the summary message's ``InvalidMessageError`` past the policy,
    at every fold: the thread could never fold again, fallback or not.
    """

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "broken \ud83d pair"

    compactor = Compactor(
        store,
        options=options(on_summarizer_error=policy),
        summarizer=FunctionSummarizer(broken),
        counter=ApproximateCounter(),
    )
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    if policy == "raise":
        with pytest.raises(SummarizerError, match="no store can hold"):
            await compactor.maybe_compact(THREAD)
        assert await store.load(THREAD) == before
        return
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.degraded
    context = await compactor.context(THREAD)
    assert context[0].is_summary and "src/f4.py" in context[0].text


async def test_a_tail_too_big_to_fold_stalls_without_calling_the_summarizer(store: Any) -> None:
    """With only protected turns left the compactor reports a stall and backs off, summarizing nothing."""
    summarizer = recorder()
    compactor = Compactor(
        store,
        options=options(budget=200, min_recent_messages=0, min_recent_turns=2),
        summarizer=summarizer,
        counter=ApproximateCounter(),
    )
    await compactor.append(THREAD, [Message.user("a " * 600), Message.user("b " * 600)])
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled and "min_recent_turns" in result.detail
    assert summarizer.calls == []
    skipped = [await compactor.maybe_compact(THREAD) for _ in range(1)]
    assert skipped == [None]


async def test_oversized_tool_output_is_cut_with_a_marker(store: Any) -> None:
    """A tool output over max_tool_output_tokens is cut, with a marker, to get the request under the limit."""
    compactor = Compactor(
        store,
        options=options(budget=400, max_tool_output_tokens=100),
        summarizer=recorder(),
        counter=ApproximateCounter(),
    )
    call = ToolCall(id="big", name="dump", arguments="{}")
    await compactor.append(
        THREAD,
        [
            Message.user("dump it"),
            Message.assistant(None, tool_calls=[call]),
            Message.tool("big", "x" * 8000),
        ],
    )
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.truncated_messages == 1
    context = await compactor.context(THREAD)
    cut = next(m for m in context if m.tool_call_id == "big")
    assert "tokens of tool output cut by contextfold" in cut.text
    assert cut.metadata[TRUNCATED_METADATA_KEY] == 2000
    assert (await store.stats(THREAD)).total_tokens < 400
    original = [m for m in conversation([r async for r in store.replay(THREAD)]) if m.tool_call_id == "big"]
    assert original[0].text == "x" * 8000


async def test_a_tool_output_is_cut_by_its_text_and_keeps_its_images_whole(store: Any) -> None:
    """A tool output of parts over max_tool_output_tokens has its text cut; an image in it is kept whole."""
    compactor = Compactor(
        store,
        options=options(budget=400, max_tool_output_tokens=100),
        summarizer=recorder(),
        counter=ApproximateCounter(),
    )
    image = {"type": "input_image", "image_url": "https://example.com/shot.png"}  # 1,445 tokens: size unknown
    call = ToolCall(id="big", name="look", arguments="{}")
    alone = ToolCall(id="shot", name="look", arguments="{}")
    text = {"type": "text", "text": "x" * 8000}
    await compactor.append(
        THREAD,
        [
            Message.user("look"),
            Message.assistant(None, tool_calls=[call, alone]),
            Message(role=Role.TOOL, tool_call_id="big", content=[text, image]),
            Message(role=Role.TOOL, tool_call_id="shot", content=[image]),
        ],
    )
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.truncated_messages == 1
    cut, shot = [m for m in await compactor.context(THREAD) if m.role is Role.TOOL]
    assert isinstance(cut.content, list) and cut.content[1:] == [image]
    assert "about 1900 tokens of tool output cut by contextfold" in cut.text
    assert len(cut.text) < 500
    assert shot.content == [image] and TRUNCATED_METADATA_KEY not in shot.metadata


async def test_a_fold_that_meets_another_workers_fold_is_discarded_without_summarizing_again(
    store: Any,
) -> None:
    """A fold meeting another worker's fold writes nothing and never re-sends what that worker folded."""
    calls: list[list[Any]] = []
    folded: list[Any] = []
    other_worker_done = False

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        nonlocal other_worker_done
        calls.append([m.metadata.get("n") for m in messages])
        if not other_worker_done:  # another worker folds the first six messages meanwhile
            other_worker_done = True
            window = await store.load(THREAD)
            folded.extend(m.message.metadata.get("n") for m in window.messages[:6])
            theirs = Message.user("their summary", metadata={SUMMARY_METADATA_KEY: True})
            await store.replace_prefix(
                THREAD,
                through_seq=window.messages[5].seq,
                expected_version=window.version,
                replacement=[theirs],
                tokens=[3],
            )
            await store.append(THREAD, [Message.user("late arrival", metadata={"n": "late"})], [3])
        return "summary of " + ",".join(str(n) for n in calls[-1])

    compactor = Compactor(
        store,
        options=options(budget=300),
        summarizer=FunctionSummarizer(summarize),
        counter=ApproximateCounter(),
    )
    await grow(compactor, range(8), compact=False)
    log_before = [r async for r in store.replay(THREAD)]
    assert await compactor.maybe_compact(THREAD) is None
    assert [r async for r in store.replay(THREAD)] == log_before  # no checkpoint for the discarded fold
    assert await store.latest_checkpoint(THREAD) is None
    assert len(calls) == 1
    context = await compactor.context(THREAD)
    assert context[-1].metadata.get("n") == "late"
    result = await compactor.maybe_compact(THREAD)  # the next check folds on top of the new state
    assert result is not None and result.compacted
    assert not set(calls[1]) & set(folded), "a message the other worker folded was summarized again"
    checkpoints = [r async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)]
    assert len(checkpoints) == 1
    assert (await compactor.context(THREAD))[-1].metadata.get("n") == "late"


async def test_a_programming_error_in_a_summarizer_is_raised_not_turned_into_a_degraded_summary(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A summarizer raising something other than SummarizerError is logged with its traceback and raised."""

    async def buggy(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise KeyError("oops")

    compactor = Compactor(
        store, options=options(), summarizer=FunctionSummarizer(buggy), counter=ApproximateCounter()
    )
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    with pytest.raises(KeyError):
        await compactor.maybe_compact(THREAD)
    assert await store.load(THREAD) == before
    assert any(record.exc_info for record in caplog.records if record.levelname == "ERROR")


async def test_an_empty_summary_follows_the_summarizer_error_policy(store: Any) -> None:
    """A whitespace-only summary is a summarizer failure: the fallback summarizes and the fold is degraded."""

    async def blank(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "  \n "

    compactor = Compactor(
        store, options=options(), summarizer=FunctionSummarizer(blank), counter=ApproximateCounter()
    )
    await grow(compactor, range(6), compact=False)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.degraded
    summary = (await compactor.context(THREAD))[0]
    assert summary.is_summary and "src/f0.py" in summary.text
    skipping = Compactor(
        store,
        options=options(on_summarizer_error="skip"),
        summarizer=FunctionSummarizer(blank),
        counter=ApproximateCounter(),
    )
    await grow(skipping, range(10, 16), compact=False)
    stalled = await skipping.maybe_compact(THREAD)
    assert stalled is not None and stalled.stalled


@pytest.mark.parametrize("fails", ["blank", "raises"])
async def test_a_fallback_that_fails_too_leaves_the_context_unfolded(store: Any, fails: str) -> None:
    """The summarizer fails, then a fallback returns whitespace (or raises): the fold stalls, losing nothing.

    Only the primary summarizer's summary was checked: a blank one from the
    fallback was written as the summary of the 12 folded messages, which
    kept nothing of them; a fallback's ``SummarizerError`` escaped the policy.
    """

    async def down(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise SummarizerError("provider down", status=503)

    async def fallback(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        if fails == "raises":
            raise SummarizerError("the fallback is down too")
        return "  \n "

    compactor = Compactor(
        store,
        options=options(),
        summarizer=FunctionSummarizer(down),
        fallback=FunctionSummarizer(fallback),
        counter=ApproximateCounter(),
    )
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled and not result.compacted
    assert "provider down" in result.detail and "the fallback failed too" in result.detail
    assert await store.load(THREAD) == before
    assert await store.latest_checkpoint(THREAD) is None


async def test_two_compactors_on_one_thread_apply_one_compaction(store: Any) -> None:
    """Two workers checking the same thread at once apply exactly one compaction."""

    async def slow(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        await anyio.sleep(0.05)
        return "folded"

    first = Compactor(
        store, options=options(budget=300), summarizer=FunctionSummarizer(slow), counter=ApproximateCounter()
    )
    second = Compactor(
        store, options=options(budget=300), summarizer=FunctionSummarizer(slow), counter=ApproximateCounter()
    )
    await grow(first, range(8), compact=False)
    results: list[Any] = []

    async def check(compactor: Compactor) -> None:
        results.append(await compactor.maybe_compact(THREAD))

    async with anyio.create_task_group() as tg:
        tg.start_soon(check, first)
        tg.start_soon(check, second)
    assert sum(1 for r in results if r is not None) == 1
    log = [r async for r in store.replay(THREAD)]
    assert sum(1 for r in log if isinstance(r.episode, SummaryCheckpoint)) == 1


async def test_manual_recovery_writes_a_clean_slate_boundary(store: Any) -> None:
    """compact_now(reason='manual_recovery') folds every turn and records a ManualRecoveryBoundary."""
    compactor = Compactor(
        store, options=options(budget=100_000, max_summary_tokens=60), counter=ApproximateCounter()
    )
    await compactor.append(THREAD, [Message.system("prompt")])
    await grow(compactor, range(5), compact=False)
    assert (await store.pressure(THREAD)).user_messages_since_boundary == 5
    result = await compactor.manual_recovery(THREAD)
    assert result is not None and result.reason == "manual_recovery"
    context = await compactor.context(THREAD)
    assert [m.text for m in context[:1]] == ["prompt"]
    assert len(context) == 2 and context[1].is_summary
    log = [r async for r in store.replay(THREAD)]
    checkpoint, last = log[-2], log[-1]
    assert isinstance(last.episode, ManualRecoveryBoundary)
    assert isinstance(checkpoint.episode, SummaryCheckpoint)
    assert last.episode.through_seq == checkpoint.episode.through_seq == result.through_seq
    pressure = await store.pressure(THREAD)
    assert pressure.user_messages_since_boundary == 0
    assert pressure.user_messages_after_latest_run_completed == 0


async def test_episodic_policy_triggers_on_unfinished_turns(store: Any) -> None:
    """With an episodic policy, 8 user messages without a clean completion fire 'unfinished_turns'."""
    compactor = Compactor(
        store,
        options=options(budget=100_000, episodic=EpisodicCompactionConfig()),
        summarizer=recorder(),
        counter=ApproximateCounter(),
    )
    for n in range(7):
        await compactor.append(THREAD, turn(n, size=2))
        assert await compactor.maybe_compact(THREAD) is None
    await compactor.complete_run(THREAD)
    for n in range(7, 15):
        await compactor.append(THREAD, turn(n, size=2))
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.reason == "unfinished_turns"


async def test_episodic_age_trigger_uses_the_given_clock(store: Any) -> None:
    """The age-and-turns rule fires for an old, busy thread when asked with a later 'now'."""
    compactor = Compactor(
        store,
        options=options(budget=100_000, episodic=EpisodicCompactionConfig(trigger_unfinished_turns=1000)),
        summarizer=recorder(),
        counter=ApproximateCounter(),
    )
    for n in range(50):
        await compactor.append(THREAD, turn(n, size=1))
    assert await compactor.maybe_compact(THREAD) is None
    later = datetime.now(UTC) + timedelta(days=31)
    result = await compactor.maybe_compact(THREAD, now=later)
    assert result is not None and result.reason == "age_and_turns"


async def test_mask_mode_replaces_old_tool_outputs_only(store: Any) -> None:
    """Mask mode keeps every message but replaces older tool outputs with a placeholder."""
    summarizer = recorder()
    compactor = Compactor(
        store, options=options(budget=300, mode="mask"), summarizer=summarizer, counter=ApproximateCounter()
    )
    await grow(compactor, range(6), compact=False)
    before = await compactor.context(THREAD)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.masked_messages > 0 and result.dropped_messages == 0
    after = await compactor.context(THREAD)
    assert len(after) == len(before)
    assert [m.role for m in after] == [m.role for m in before]
    assert "tool output elided" in after[2].text
    assert after[-1] == before[-1]
    assert summarizer.calls == []


async def test_drop_mode_folds_without_a_summary(store: Any) -> None:
    """Drop mode removes the old turns without calling the summarizer."""
    summarizer = recorder()
    compactor = Compactor(
        store, options=options(mode="drop"), summarizer=summarizer, counter=ApproximateCounter()
    )
    await grow(compactor, range(6), compact=False)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.dropped_messages > 0
    assert not any(m.is_summary for m in await compactor.context(THREAD))
    assert summarizer.calls == []


async def test_bare_maybe_compact_validates_options_like_the_seed() -> None:
    """A zero budget, or a window below max_history_tokens, is rejected with ConfigError at construction."""
    with pytest.raises(ConfigError) as zero:
        RunOptions(compaction=SummarizeOptions(trigger_token_budget=0))
    assert zero.value.key == "compaction.trigger_token_budget"
    with pytest.raises(ConfigError, match="at least 2500"):
        RunOptions(max_history_tokens=10_000, compaction=SummarizeOptions(trigger_token_budget=2000))
    async with MemoryStore() as store:
        assert await Compactor(store, options=RunOptions.without_compaction()).maybe_compact(THREAD) is None


async def test_wrong_store_is_a_config_error() -> None:
    """Passing something that is not a store names the argument and the fix."""
    with pytest.raises(ConfigError, match="store"):
        Compactor(object(), options=options())


async def test_a_store_failure_while_rewriting_leaves_the_context_as_it_was(store: Any) -> None:
    """If the fold's write fails, maybe_compact raises, nothing is written, not even a checkpoint."""
    compactor = Compactor(store, options=options(), summarizer=recorder(), counter=ApproximateCounter())
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    log = [r async for r in store.replay(THREAD)]
    real = store.fold

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("disk full")

    store.fold = failing
    with pytest.raises(StoreError, match="disk full"):
        await compactor.maybe_compact(THREAD)
    store.fold = real
    assert await store.load(THREAD) == before
    assert [r async for r in store.replay(THREAD)] == log
    assert await store.latest_checkpoint(THREAD) is None
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    replayed = conversation([r async for r in store.replay(THREAD)])
    assert len(replayed) == len(before.messages)


async def test_a_cancelled_compaction_writes_nothing_and_releases_the_thread(store: Any) -> None:
    """A step cancelled mid-summary leaves the context as it was and frees the thread for the next one."""

    async def slow(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        await anyio.sleep(30)
        return "never"

    stuck = Compactor(
        store, options=options(), summarizer=FunctionSummarizer(slow), counter=ApproximateCounter()
    )
    await grow(stuck, range(6), compact=False)
    before = await store.load(THREAD)
    with anyio.move_on_after(0.05) as scope:
        await stuck.maybe_compact(THREAD)
    assert scope.cancelled_caught
    assert await store.load(THREAD) == before
    assert await store.latest_checkpoint(THREAD) is None
    healthy = Compactor(store, options=options(), summarizer=recorder(), counter=ApproximateCounter())
    result = await healthy.maybe_compact(THREAD)
    assert result is not None and result.compacted


async def test_the_summary_role_is_configurable_and_never_pinned(store: Any) -> None:
    """With summary_role=system the summary is a system message, yet the next fold still replaces it."""
    summarizer = recorder()
    compactor = Compactor(
        store, options=options(summary_role=Role.SYSTEM), summarizer=summarizer, counter=ApproximateCounter()
    )
    await compactor.append(THREAD, [Message.system("prompt")])
    results = await grow(compactor, range(12))
    assert sum(1 for r in results if r is not None and r.compacted) >= 2
    context = await compactor.context(THREAD)
    assert [m.role for m in context[:2]] == [Role.SYSTEM, Role.SYSTEM]
    assert context[0].text == "prompt" and context[1].is_summary
    assert sum(m.is_summary for m in context) == 1
    assert summarizer.calls[-1][1] is not None


async def test_a_message_edited_after_append_leaves_the_context_as_stored(store: Any) -> None:
    """The context a step sends is what the store holds, even if the caller edits a message it appended.

    On SQLite the cached context held the caller's own message object, so
    metadata edited after ``append`` reached the next request (and a fold's
    replacement rows) while the stored row kept the old value.
    """
    compactor = Compactor(store)
    await compactor.append(THREAD, [Message.system("You are terse.")])
    await compactor.maybe_compact(THREAD)
    await compactor.context(THREAD)  # the context is cached from here on
    message = Message.user("hi", metadata={"trace": "a"})
    await compactor.append(THREAD, [message])
    message.metadata["trace"] = "b"
    await compactor.maybe_compact(THREAD)
    context = await compactor.context(THREAD)
    assert context[-1].metadata == {"trace": "a"}
    assert [row.message for row in (await store.load(THREAD)).messages] == context


async def test_each_appended_message_is_stored_with_its_own_count(store: Any) -> None:
    """A part given as an object, then as a list of pairs, is stored at 31 and 32 tokens, not 31 twice."""
    as_object = Message.user([{"type": "custom", "data": {"k": 1, "j": 2, "l": 3}}])
    as_pairs = Message.user([{"type": "custom", "data": [["k", 1], ["j", 2], ["l", 3]]}])
    compactor = Compactor(store, counter=TiktokenCounter())
    await compactor.append(THREAD, [as_object])
    await compactor.append(THREAD, [as_pairs])
    stored = [row.tokens for row in (await store.load(THREAD)).messages]
    assert stored == [31, 32]
    assert stored == [TiktokenCounter(cache_size=0).count(m) for m in (as_object, as_pairs)]


@pytest.mark.parametrize("masking", [False, True], ids=["summarized", "masked"])
async def test_parts_holding_a_datetime_a_uuid_or_a_set_are_counted_as_the_json_the_store_keeps(
    store: Any, masking: bool
) -> None:
    """``Message`` takes them in a content part and the store keeps their JSON; counting raised ``TypeError``.

    Every append of such a message failed on both counters, before anything
    was stored, and so did masking's size check; now each is counted as the
    JSON the store writes (the count of the message read back), and folds.
    """
    from contextfold import ObservationMasking, TokenBudget, TokenCount

    def step(n: int) -> list[Message]:
        when = {"type": "custom", "at": datetime(2026, 1, n + 1, tzinfo=UTC), "tags": {n}}
        call = ToolCall(id=f"c{n}", name="lookup", arguments="{}")
        return [
            Message.user([{"type": "text", "text": f"question {n}"}, when]),
            Message.assistant(None, tool_calls=[call]),
            Message.tool(f"c{n}", [{"type": "custom", "id": uuid.UUID(int=n), "rows": "r" * 400}]),
            Message.assistant(f"answer {n} " + "word " * 40),
        ]

    counter = TiktokenCounter()
    if masking:
        compactor = Compactor(
            store,
            trigger=TokenCount(600),
            strategy=[ObservationMasking(1), TokenBudget(400)],
            counter=counter,
        )
    else:
        settings = SummarizeOptions(trigger_token_budget=600, min_recent_messages=2)
        compactor = Compactor(
            store, options=RunOptions(max_history_tokens=2_400, compaction=settings), counter=counter
        )
    folds = 0
    for n in range(8):
        stored = await compactor.append(THREAD, step(n))
        read_back = (await store.tail(THREAD, after_seq=stored[0].seq - 1)).messages
        assert [row.tokens for row in stored] == [counter.count(row.message) for row in read_back]
        result = await compactor.maybe_compact(THREAD)
        folds += result is not None and result.compacted
    assert folds >= 2
    log = [m for m in conversation([r async for r in store.replay(THREAD)]) if m.role is Role.USER]
    assert log[0].content[1]["at"] == "2026-01-01T00:00:00Z"


async def test_a_cached_context_is_few_objects_for_the_garbage_collector(store: Any) -> None:
    """Each message the compactor caches adds two objects a full collection walks (four on MemoryStore).

    The cache kept a ``StoredMessage`` per row beside its message, and every
    row built without validation had a fields-set of its own: six objects per
    message, so a full collection over 1,024 cached threads of a long context
    walked about a million of them (200 threads of 100 messages: 106-125 ms
    here, now 61-67 ms).
    """
    compactor = Compactor(store, options=options(budget=10**9), counter=ApproximateCounter())
    await compactor.append(THREAD, [Message.system("You are terse.")])
    await compactor.maybe_compact(THREAD)
    await compactor.context(THREAD)
    gc.collect()
    before = len(gc.get_objects())
    for n in range(400):
        await compactor.append(THREAD, [Message.user(f"message {n}", metadata={"n": n})])
    await compactor.maybe_compact(THREAD)
    assert len(await compactor.context(THREAD)) == 401
    gc.collect()
    per_message = (len(gc.get_objects()) - before) / 400
    # SQLite: the message and its __dict__; MemoryStore also keeps its own row and that row's __dict__.
    assert per_message <= (5.0 if isinstance(store, MemoryStore) else 2.5), per_message


async def test_append_refuses_an_unchecked_message_and_writes_nothing(store: Any) -> None:
    """Episodes are built around a Message without validating it again: the store still checks it."""
    compactor = Compactor(store, options=options(), counter=ApproximateCounter())
    await compactor.append(THREAD, [Message.user("first")])
    before = [record.episode async for record in store.replay(THREAD)]
    # model_construct skips the message's own checks: a user message answering a tool call.
    unchecked = Message.model_construct(
        role=Role.USER, content="x", tool_calls=(), tool_call_id="c1", name=None, metadata={}
    )
    with pytest.raises(InvalidMessageError, match="tool_call_id"):
        await compactor.append(THREAD, [Message.user("second"), unchecked])
    assert [record.episode async for record in store.replay(THREAD)] == before
    assert [m.text for m in await compactor.context(THREAD)] == ["first"]
    assert (await store.stats(THREAD)).message_count == 1


LONE = "\udc80"


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(Message.user(f"a{LONE}b"), id="content"),
        pytest.param(Message.user("ok", metadata={"trace": f"t{LONE}"}), id="metadata-value"),
        pytest.param(Message.user("ok", metadata={f"k{LONE}": 1}), id="metadata-key"),
        pytest.param(Message(role=Role.USER, content="ok", name=f"n{LONE}"), id="name"),
        pytest.param(
            Message.assistant(None, tool_calls=[ToolCall(id="c1", name="f", arguments=f'"{LONE}"')]),
            id="tool-call-arguments",
        ),
        pytest.param(Message.tool(f"c{LONE}", "result"), id="tool-call-id"),
    ],
)
async def test_a_step_with_a_lone_surrogate_is_refused_whole_on_every_store(store: Any, bad: Message) -> None:
    """Text no JSON can hold is refused by every store, the same way, with nothing of the step written.

    A ``MemoryStore`` step is checked without being encoded (its log keeps the
    store's copies): the check must still refuse what SQLite's encode does.
    """
    compactor = Compactor(store, options=options(), counter=ApproximateCounter())
    await compactor.append(THREAD, [Message.user("first")])
    with pytest.raises(InvalidMessageError, match=r"messages\[1\].*surrogates not allowed"):
        await compactor.append(THREAD, [Message.user("second"), bad])
    assert [record.episode.message.text async for record in store.replay(THREAD)] == ["first"]
    assert [m.text for m in await compactor.context(THREAD)] == ["first"]
    assert (await store.stats(THREAD)).message_count == 1


async def test_a_steps_episodes_replay_as_recorded_and_apart_from_the_callers_objects(store: Any) -> None:
    """Replay returns each step's episodes as they were recorded, equal on every read and on every store.

    A ``MemoryStore`` logs a step unencoded and encodes an episode on its first
    read: what the caller edits afterwards, and what a reader edits in what it
    was given, must not reach the log.
    """
    from contextfold.episodes import LlmCallEpisode, Usage

    compactor = Compactor(store, options=options(), counter=ApproximateCounter())
    call = ToolCall(id="c1", name="read_file", arguments='{"path": "a.py"}')
    reply = Message.assistant("reading", tool_calls=[call], metadata={"trace": "a"})
    result = Message.tool("c1", "naïve café ✓ 🤖", metadata={"n": 1})
    await compactor.append(THREAD, [Message.user("hi")])
    await compactor.append(THREAD, [reply], model="m1", usage=Usage(input_tokens=5, output_tokens=2))
    await compactor.append(THREAD, [result])
    reply.metadata["trace"] = "edited by the caller"
    first = [record async for record in store.replay(THREAD)]
    first[1].episode.reply.metadata["trace"] = "edited by a reader"
    second = [record async for record in store.replay(THREAD)]
    assert [r.seq for r in second] == [1, 2, 3]
    llm = second[1].episode
    assert isinstance(llm, LlmCallEpisode)
    assert (llm.model, llm.usage) == ("m1", Usage(input_tokens=5, output_tokens=2))
    assert llm.reply.metadata == {"trace": "a"} and llm.reply.tool_calls == (call,)
    assert second[2].episode.message.text == "naïve café ✓ 🤖"
    assert second[2].episode.message.metadata == {"n": 1}
    third = [record.episode async for record in store.replay(THREAD)]
    assert [r.episode for r in second] == third


async def test_threads_report_the_time_of_a_steps_newest_episode_before_and_after_it_is_read(
    store: Any,
) -> None:
    """``threads()`` gives the newest episode's time, whether or not that episode was read yet.

    A ``MemoryStore`` keeps a step's time apart from its messages until an
    episode is first read (then the two go together): both must give the same time.
    """
    compactor = Compactor(store, options=options(), counter=ApproximateCounter())
    await compactor.append(THREAD, [Message.user("first")])
    await compactor.append(THREAD, [Message.user("second"), Message.assistant("done")])
    before_read = {info.thread: info for info in await store.threads()}[THREAD]
    records = [record async for record in store.replay(THREAD)]
    after_read = {info.thread: info for info in await store.threads()}[THREAD]
    assert [record.seq for record in records] == [1, 2, 3]
    assert records[1].at == records[2].at >= records[0].at
    assert before_read.last_activity == after_read.last_activity == records[2].at
    assert before_read.episodes == after_read.episodes == 3


def test_episode_for_a_message_equals_the_validated_episode() -> None:
    """The unvalidated episode of a Message is the episode validation builds, field for field."""
    from contextfold._episodes import _validated_episode_for
    from contextfold.episodes import Usage, episode_for

    call = ToolCall(id="c1", name="read_file", arguments='{"path": "a.py"}')
    messages = [
        Message.user("u", metadata={"k": 1}),
        Message.system("s"),
        Message.tool("c1", "result"),
        Message.assistant("a", tool_calls=[call]),
        Message.assistant(None, tool_calls=[call]),
    ]
    for message in messages:
        fast = episode_for(message)
        slow = _validated_episode_for(message, None, None, 0, 0)
        assert type(fast) is type(slow)
        assert fast == slow
        assert fast.model_dump_json() == slow.model_dump_json()
        assert fast.model_dump() == slow.model_dump()
    # An LLM call's own fields are still validated.
    with pytest.raises(ValueError, match="request_tokens"):
        episode_for(messages[3], request_tokens=-1)
    usage = Usage(input_tokens=5, output_tokens=2)
    assert episode_for(messages[3], model="m", usage=usage).usage == usage  # type: ignore[union-attr]


class _SpiedStore(MemoryStore):
    """A store whose record_and_append a user wrapped, as a subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[str]] = []

    async def record_and_append(
        self, thread: str, episodes: Any, messages: Any, tokens: Any, **kw: Any
    ) -> list[StoredMessage]:
        self.seen.append([m.text for m in messages])
        return await super().record_and_append(thread, episodes, messages, tokens, **kw)


async def test_a_store_whose_record_and_append_is_replaced_gets_every_step_through_it() -> None:
    """A subclass or an instance that replaces record_and_append sees every append, in order."""
    async with _SpiedStore() as store:
        compactor = Compactor(store, options=options(), counter=ApproximateCounter())
        await compactor.append(THREAD, [Message.user("a")])
        await compactor.append(THREAD, [Message.user("b"), Message.assistant("c")])
        assert store.seen == [["a"], ["b", "c"]]
        assert [m.text for m in await compactor.context(THREAD)] == ["a", "b", "c"]
    calls: list[int] = []
    async with MemoryStore() as plain:
        original = plain.record_and_append

        async def spy(*args: Any, **kw: Any) -> list[StoredMessage]:
            calls.append(1)
            return await original(*args, **kw)

        plain.record_and_append = spy  # type: ignore[method-assign]
        await Compactor(plain, options=options(), counter=ApproximateCounter()).append(
            THREAD, [Message.user("d")]
        )
    assert calls == [1]


async def test_a_memory_step_is_stored_as_the_store_records_it_itself() -> None:
    """``Compactor.append`` hands a ``MemoryStore`` its steps unencoded (the log keeps each message's
    copy until first read): the rows, stats, log and episodic counters are what ``record_and_append``,
    which encodes, leaves."""
    call = ToolCall(id="c1", name="read_file", arguments='{"path": "a.py"}')
    steps = [
        Message.system("You are terse."),
        Message.user("read a.py", metadata={"turn": 1, "ok": True}),
        Message.assistant(None, tool_calls=[call]),
        Message.tool("c1", "print('a')"),
        Message.tool("c9", "a result whose call was never made"),
        Message.assistant("done"),
        Message.user("thanks"),
    ]
    async with MemoryStore() as fast, _SpiedStore() as generic:
        stores = [fast, generic]
        compactors = [Compactor(store, options=options(), counter=ApproximateCounter()) for store in stores]
        for message in steps:
            for compactor in compactors:
                await compactor.append(THREAD, [message])
        assert len(generic.seen) == len(steps)  # every step took the store's own path there
        tails = [await store.tail(THREAD, after_seq=0) for store in stores]
        assert [row.model_dump() for row in tails[0].messages] == [
            row.model_dump() for row in tails[1].messages
        ]
        assert [row.episode_seq for row in tails[0].messages] == [1, 2, 3, 4, 5, 6, 7]
        assert await fast.stats(THREAD) == await generic.stats(THREAD)
        logs = [
            [(r.seq, r.episode.model_dump_json()) async for r in store.replay(THREAD)] for store in stores
        ]
        assert logs[0] == logs[1] and len(logs[0]) == len(steps)
        pressures = [await store.pressure(THREAD) for store in stores]
        assert pressures[0] == pressures[1] and pressures[0].total_user_messages == 2
        steps[1].metadata["turn"] = 2  # the caller's message, edited afterwards, is not the stored one
        assert (await fast.tail(THREAD, after_seq=1)).messages[0].message.metadata == {"turn": 1, "ok": True}


class ThreadNoting(TiktokenCounter):
    """Counts as tiktoken does, noting the thread each message was measured in."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def _measure(self, message: Message) -> int:
        self.threads.append(threading.get_ident())
        return super()._measure(message)


@pytest.mark.parametrize("path", ["one store", "one store, started calls", "two stores"])
async def test_a_large_tool_result_is_counted_in_a_worker_thread_not_on_the_loop(
    store: Any, path: str
) -> None:
    """Tokenizing two megabytes took 120 ms on the event loop, and every other task waited for it."""
    counter = ThreadNoting()
    await counter.aload()
    if path == "two stores":
        compactor = Compactor(short_term=store, episodic=MemoryStore(), options=options(), counter=counter)
    else:
        compactor = Compactor(store, options=options(), counter=counter)
    loop = threading.get_ident()
    call = ToolCall(id="c1", name="read_file", arguments='{"path": "big.py"}')
    reply = Message.assistant(None, tool_calls=[call])
    await compactor.append(THREAD, [Message.user("read big.py"), reply])
    assert counter.threads == [loop, loop]

    big = Message.tool("c1", "x = 1  # a long file\n" * 5_000)
    started = [call] if path == "one store, started calls" else ()
    stored = await compactor.append(THREAD, [big], started=started)
    assert len(counter.threads) == 3 and counter.threads[2] != loop
    assert stored[0].message == big and stored[0].tokens == TiktokenCounter().count(big)
    context = await compactor.context(THREAD)
    assert context[-1] == big


@pytest.mark.parametrize(("kept_words", "level"), [(260, "INFO"), (600, "WARNING")])
async def test_a_fold_left_over_its_target_warns_only_when_over_the_budget(
    caplog: pytest.LogCaptureFixture, kept_words: int, level: str
) -> None:
    """Kept turns over the target are routine (INFO); over the trigger budget no fold can help (WARNING)."""
    options = RunOptions(
        max_history_tokens=4_000,
        compaction=SummarizeOptions(trigger_token_budget=1_000, min_recent_messages=2, max_summary_tokens=50),
    )
    async with MemoryStore() as store:
        compactor = Compactor(store, options=options, counter=ApproximateCounter())
        for n in range(16):
            await compactor.append(
                "t", [Message.user(f"q{n} " + "word " * 30), Message.assistant("ok " * 30)]
            )
        await compactor.append(
            "t", [Message.user("big " * kept_words), Message.assistant("big " * kept_words)]
        )
        caplog.set_level("INFO", logger="contextfold")
        result = await compactor.maybe_compact("t")
        _, tokens = await compactor.context_tokens("t")
    assert result is not None and result.compacted and tokens > 500  # over the 500-token target
    assert (tokens > 1_000) is (level == "WARNING")
    records = [r for r in caplog.records if "over the 500-token target" in r.getMessage()]
    assert [r.levelname for r in records] == [level]


async def test_a_thread_over_the_compaction_window_is_folded_whole_with_the_documented_warning(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread grown while compaction was off: the README's warning names it, and the fold covers it all.

    With a bundled store the fold plans over the cached context, and the
    warning never fired before.
    """
    off = Compactor(store, counter=ApproximateCounter())
    for n in range(60):
        await off.append(THREAD, [Message.user(f"m{n} " + "word " * 40)])
    options = RunOptions(max_history_tokens=1_000, compaction=SummarizeOptions(trigger_token_budget=500))
    on = Compactor(store, options=options, counter=ApproximateCounter())
    total = (await store.stats(THREAD)).total_tokens
    assert total > 500 * 4
    with caplog.at_level(logging.WARNING, logger="contextfold"):
        result = await on.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.tokens_before == total
    assert (
        f"thread {THREAD!r} holds {total} tokens, more than the 2000-token compaction window; "
        "loading it whole" in caplog.messages
    )
    assert result.tokens_after <= 1_000


async def test_provider_overhead_from_usage_holds_steady_through_step_loop_steps(store: Any) -> None:
    """Each step's usage teaches the same 500-token overhead; the trigger fires once messages + 500 pass it.

    ``Step.request_tokens`` is what the messages count; had it held the
    overhead learnt at the step before, the next reply's usage would teach an
    overhead of 0, and every other check would miss the tool schemas.
    """
    from contextfold import StepLoop, Usage

    schemas = 500
    counter = ApproximateCounter()
    compactor = Compactor(store, options=options(budget=2_000), counter=counter, summarizer=recorder())
    loop = StepLoop(compactor)
    await loop.append(THREAD, Message.user("hello"))
    overheads: list[int] = []
    before: list[int] = []  # the messages' tokens each step's check saw
    for n in range(40):
        before.append(sum(counter.count(m) for m in await compactor.context(THREAD)))
        async with loop.step(THREAD) as step:
            if step.compaction is not None and step.compaction.compacted:
                break
            sent = sum(counter.count(m) for m in step.messages)
            assert step.request_tokens == sent
            _, seen = await compactor.context_tokens(THREAD)
            overheads.append(seen - sent)
            usage = Usage(input_tokens=sent + schemas, output_tokens=5)
            await step.record(Message.assistant(f"reply {n} " + "word " * 60), usage=usage)
        await loop.append(THREAD, Message.user(f"and now task {n}"))
    else:
        raise AssertionError(f"no fold in 40 steps: the check saw {before} tokens of messages")
    assert overheads[1:] == [schemas] * (len(overheads) - 1)
    # The fold came at the first check whose messages and schemas passed the 2,000-token budget.
    assert before[-1] + schemas > 2_000 >= before[-2] + schemas


async def test_messages_counted_beside_the_context_stand_as_its_overhead_until_usage_says_otherwise(
    store: Any,
) -> None:
    """``count_beside`` counts an adapter's instructions as overhead; its or usage's last word stands."""
    from contextfold import Usage

    counter = ApproximateCounter()
    compactor = Compactor(store, options=options(budget=2_000), counter=counter)
    await compactor.append(THREAD, [Message.user("hello")])
    own = sum(counter.count(m) for m in await compactor.context(THREAD))
    prompt = Message.system("Answer from the files. " * 40)
    await compactor.count_beside(THREAD, [prompt])
    assert (await compactor.context_tokens(THREAD))[1] == own + counter.count(prompt)
    await compactor.append(
        THREAD, [Message.assistant("hi")], usage=Usage(input_tokens=own + 300), request_tokens=own
    )
    assert (await compactor.context_tokens(THREAD))[1] - (await compactor._counted_context(THREAD))[1] == 300
    await compactor.count_beside(THREAD, [])
    assert (await compactor.context_tokens(THREAD))[1] == (await compactor._counted_context(THREAD))[1]
    with pytest.raises(ConfigError, match="messages"):
        await compactor.count_beside(THREAD, "Answer from the files.")  # type: ignore[arg-type]


def _words(n: int, word: str = "word") -> str:
    return " ".join([word] * n)


async def test_a_large_pinned_head_squeezes_the_summary_so_the_fold_ends_at_the_target(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Head 462 tokens, target 500, a summarizer that ignores its limit: the summary is cut to the 38 left.

    The fold used to keep a 64-token floor for the summary and let it run 8
    tokens past its room, so the context ended at 537 tokens; the log blamed
    "the protected recent turns", of which there were none.
    """

    async def verbose(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "fact " * 400

    counter = ApproximateCounter()
    run = RunOptions(
        max_history_tokens=1_000,
        compaction=SummarizeOptions(
            trigger_token_budget=1_000, target_tokens=500, min_recent_turns=0, min_recent_messages=0
        ),
    )
    compactor = Compactor(store, options=run, summarizer=FunctionSummarizer(verbose), counter=counter)
    head = Message.system(_words(370, "rule"))
    await compactor.append(THREAD, [head])
    n = 0
    while (await store.stats(THREAD)).total_tokens <= 1_000:
        await compactor.append(THREAD, [Message.user(f"{_words(20)} {n}")])
        n += 1
    with caplog.at_level(logging.INFO, logger="contextfold"):
        result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    context, tokens = await compactor.context_tokens(THREAD)
    assert context[0].text == head.text and context[1].is_summary
    assert 0 < context[1].text.count("fact") < 400  # cut to fit, not dropped
    assert tokens == result.tokens_after <= 500
    assert counter.count(context[0]) + counter.count(context[1]) <= 500
    assert "the pinned head holds 462 tokens" in caplog.text
    assert "protected recent turns" not in caplog.text


@pytest.mark.parametrize(("head_words", "summarizer"), [(765, "extractive"), (795, "function")])
async def test_a_head_that_leaves_no_room_for_a_summary_stalls_saying_so(
    store: Any, head_words: int, summarizer: str
) -> None:
    """A pinned head just under the target: no summary the summarizer can write fits beside it.

    With the default (extractive) summarizer the fold asked it for 31 tokens
    and stalled on its error ("max_summary_tokens=31 cannot hold even the
    section headings"), naming a size the user never set; another summarizer
    was asked for a 1-token summary, and the fold ended over the target.
    """
    asked: list[int] = []

    async def terse(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        asked.append(limit)
        return "fact " * limit

    counter = ApproximateCounter()
    options = SummarizeOptions(trigger_token_budget=2_000, min_recent_messages=0, min_recent_turns=1)
    chosen = {"summarizer": FunctionSummarizer(terse)} if summarizer == "function" else {}
    compactor = Compactor(store, options=options, counter=counter, log_events=False, **chosen)
    head = Message.system(_words(head_words, "rule"))
    await compactor.append(THREAD, [head])
    pinned = counter.count(head)
    while (await store.stats(THREAD)).total_tokens <= 2_000:
        await compactor.append(THREAD, [Message.user(_words(25))])
    before = await compactor.context(THREAD)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and not result.compacted
    framing = counter.count(Message.user(SUMMARY_PREFIX))
    least = framing + (1 if summarizer == "function" else compactor._least_summary(compactor.settings))
    left = 1_000 - pinned
    assert result.detail == (
        f"the pinned head alone holds {pinned} tokens, leaving {left} token{'' if left == 1 else 's'} "
        f"under the 1000-token target for a summary that needs at least {least} (its {framing}-token "
        "framing included), so no fold can get under it; shorten the system prompt, lower keep_first, "
        "or raise the target"
    )
    assert asked == []
    assert await compactor.context(THREAD) == before == (await store.load(THREAD)).plain


async def test_a_large_pinned_head_squeezes_the_summary_beside_the_protected_turn(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Head 1,200 tokens, one protected turn of ~150, target 2,000: the summary takes the ~640 left.

    The head left less than max_summary_tokens (1,000) beside the kept turn,
    which was taken for protected turns too big to fit: the summary got the
    head's whole room (~790), the fold ended at 2,150 tokens against 2,000,
    and the log blamed "the protected recent turns".
    """

    async def full(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "fact " * (limit * 4 // 5)  # fills the room it is given

    counter = ApproximateCounter()
    settings = SummarizeOptions(trigger_token_budget=4_000, min_recent_turns=1, min_recent_messages=0)
    compactor = Compactor(store, options=settings, summarizer=FunctionSummarizer(full), counter=counter)
    head = Message.system("s " * 2_400)
    await compactor.append(THREAD, [head])
    for n in range(20):
        await compactor.append(THREAD, [Message.user(f"q{n} " + "x " * 300)])
    with caplog.at_level(logging.INFO, logger="contextfold"):
        result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    context, tokens = await compactor.context_tokens(THREAD)
    assert [m.text[:3] for m in context[::2]] == ["s s", "q19"] and context[1].is_summary
    assert tokens == result.tokens_after <= 2_000
    assert 500 < counter.count(context[1]) <= 2_000 - counter.count(head) - counter.count(context[2])
    assert "the summary is cut to" in caplog.text
    assert "protected recent turns" not in caplog.text


@pytest.mark.parametrize("seed", range(24))
async def test_with_nothing_protected_every_fold_ends_at_or_under_the_target(seed: int) -> None:
    """Random budgets, targets and heads, a summarizer writing up to 3x its limit: no fold ends over target.

    The summary message's prefix and role were not counted in its room, and
    a summary up to 8 tokens over it was kept: 8 of 60 such sessions ended a
    fold 1-7 tokens over the target.
    """
    import random

    rnd = random.Random(seed)
    budget = rnd.choice([400, 800, 1_500, 3_000])
    target = rnd.randint(budget // 4, budget - 1)
    overshoot = rnd.choice([1.0, 1.02, 1.05, 1.5, 3.0])

    async def fill(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "fact " * max(1, int(limit * overshoot * 4 / 5) - 6)

    counter = ApproximateCounter()
    settings = SummarizeOptions(
        trigger_token_budget=budget, target_tokens=target, min_recent_turns=0, min_recent_messages=0
    )
    async with MemoryStore() as store:
        compactor = Compactor(store, options=settings, summarizer=FunctionSummarizer(fill), counter=counter)
        await compactor.append(THREAD, [Message.system("system " * rnd.randint(1, max(2, target // 10)))])
        folds = 0
        for _ in range(60):
            await compactor.append(THREAD, [Message.user("w " * rnd.randint(5, budget // 6))])
            result = await compactor.maybe_compact(THREAD)
            if result is not None and result.compacted:
                folds += 1
                _, tokens = await compactor.context_tokens(THREAD)
                assert tokens == result.tokens_after <= target
    assert folds


async def test_a_forgotten_thread_starts_over_without_the_erased_conversations_fold_hold_back(
    store: Any,
) -> None:
    """After ``forget``, a new conversation under the same id folds once it passes the budget.

    The hold-back a fold over the target set ("the next fold waits for N
    tokens") belonged to the erased conversation, but outlived it: the new one
    reached 1,225 tokens against a 1,000-token budget unfolded.
    """
    settings = SummarizeOptions(trigger_token_budget=1_000, min_recent_messages=0, min_recent_turns=8)
    compactor = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    for n in range(14):  # eight protected turns of ~95 tokens: every fold ends over the 500 target
        await compactor.append(THREAD, [Message.user(f"{_words(75)} {n}")])
        await compactor.maybe_compact(THREAD)
    await store.forget(THREAD)
    for n in range(13):
        await compactor.append(THREAD, [Message.user(f"{_words(75)} new {n}")])
    before = [m.text for m in await compactor.context(THREAD)]
    _, tokens = await compactor.context_tokens(THREAD)
    assert tokens > 1_000
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    context = await compactor.context(THREAD)
    assert context[0].is_summary and [m.text for m in context[1:]] == before[-len(context) + 1 :]
    assert result.tokens_after < tokens


async def test_a_context_after_another_workers_append_and_fold_is_what_the_store_holds(
    store: Any, tmp_path: Path, another_handle: Any
) -> None:
    """A check, then another worker appends and folds, then this worker's ``context()``: the current context.

    The check's read stood for the thread until the next ``context()``, however
    long after and whatever was written meanwhile: the context returned was
    the one before the other worker's fold, without its four new messages. The
    other worker shares the ``MemoryStore``, or opens the SQLite file again.
    """
    settings = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_000))
    worker = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    another = Compactor(another_handle, options=settings, counter=ApproximateCounter(), log_events=False)
    await worker.append(THREAD, [Message.user(f"message {n}") for n in range(5)])
    await worker.context(THREAD)
    assert await worker.maybe_compact(THREAD) is None
    await another.append(THREAD, [Message.user(f"from B {n} " + "x " * 400) for n in range(4)])
    folded = await another.compact_now(THREAD)
    assert folded is not None and folded.compacted
    context = await worker.context(THREAD)
    assert context == (await store.load(THREAD)).plain
    assert context[0].is_summary
    assert [m.text[:8] for m in context[-4:]] == [f"from B {n}" for n in range(4)]


async def test_a_context_read_while_the_step_drops_the_cached_context_returns_the_current_one(
    store: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, another_handle: Any
) -> None:
    """A read of the rows after the cache is out; meanwhile the step's append drops that cache.

    Another worker appended, so this worker's own append no longer follows
    its cache and drops it, while a ``context()`` (a background fold's read,
    say) was out reading the rows after the cache. That read then raised
    ``KeyError`` on the dropped cache, into the background fold and so into
    the user's next step (two SQLite workers on one thread, 3 runs in 4).
    """
    worker = Compactor(store, counter=ApproximateCounter(), log_events=False)
    another = Compactor(another_handle, counter=ApproximateCounter(), log_events=False)
    await worker.append(THREAD, [Message.user("first")])
    await worker.context(THREAD)  # cached
    await another.append(THREAD, [Message.user("from the other worker")])
    tail, reading, may_read = store.tail, anyio.Event(), anyio.Event()

    async def held_tail(thread: str, *, after_seq: int) -> Any:
        reading.set()
        await may_read.wait()
        return await tail(thread, after_seq=after_seq)

    monkeypatch.setattr(store, "tail", held_tail)
    read: list[list[Message]] = []

    async def read_context() -> None:
        read.append(await worker.context(THREAD))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(read_context)
            await reading.wait()
            monkeypatch.setattr(store, "tail", tail)
            await worker.append(THREAD, [Message.user("the step's reply")])  # drops the cache
            may_read.set()
    texts = ["first", "from the other worker", "the step's reply"]
    assert [m.text for m in read[0]] == texts
    assert [m.text for m in await worker.context(THREAD)] == texts


async def test_a_context_right_after_a_fold_holds_what_another_worker_appended_while_it_summarized(
    store: Any,
    another_handle: Any,
) -> None:
    """Another worker appends while the summary is written: the step's context() after the fold has it.

    The fold took the process's write count after the summarizer ran, so that
    write was counted as seen and the folded cache sent without it.
    """
    settings = SummarizeOptions(trigger_token_budget=1_000, min_recent_turns=1, min_recent_messages=0)
    other = Compactor(another_handle, options=settings, counter=ApproximateCounter(), log_events=False)

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        await other.append(THREAD, [Message.user("from the other worker")])
        return "a summary"

    worker = Compactor(
        store,
        options=settings,
        summarizer=FunctionSummarizer(summarize),
        counter=ApproximateCounter(),
        log_events=False,
    )
    for n in range(8):
        await worker.append(THREAD, [Message.user(f"q{n} " + "x " * 600), Message.assistant(f"a{n}")])
    await worker.context(THREAD)
    result = await worker.maybe_compact(THREAD)
    assert result is not None and result.compacted
    context = await worker.context(THREAD)
    assert context == (await store.load(THREAD)).plain
    assert context[-1].text == "from the other worker"


async def test_a_context_long_after_the_check_sees_another_processs_append(tmp_path: Path) -> None:
    """Another process's write reaches no in-process count: a check's read stands for 10 ms at most."""
    path = tmp_path / "cf.db"
    script = (
        "import anyio\n"
        "from contextfold import Message\n"
        "from contextfold.stores import SQLiteStore\n"
        "async def main():\n"
        f"    async with SQLiteStore({str(path)!r}) as store:\n"
        f"        await store.append({THREAD!r}, [Message.user('from another process')], [5])\n"
        "anyio.run(main)\n"
    )
    async with SQLiteStore(path) as store:
        worker = Compactor(store, options=options(), counter=ApproximateCounter(), log_events=False)
        await worker.append(THREAD, [Message.user("first")])
        await worker.context(THREAD)
        assert await worker.maybe_compact(THREAD) is None
        await anyio.run_process([sys.executable, "-c", script])
        assert [m.text for m in await worker.context(THREAD)] == ["first", "from another process"]


async def test_another_workers_fold_voids_this_workers_hold_back(store: Any) -> None:
    """An operator's manual recovery folds the thread small: this worker folds again once past the budget.

    Its hold-back was set by its own fold over the target, for a context the
    operator's fold replaced; it let the context grow to 1,381 tokens against
    a 1,000-token budget unfolded.
    """
    settings = SummarizeOptions(trigger_token_budget=1_000, min_recent_messages=0, min_recent_turns=8)
    worker = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    operator = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    for n in range(14):
        await worker.append(THREAD, [Message.user(f"{_words(75)} {n}")])
        await worker.maybe_compact(THREAD)
    recovered = await operator.manual_recovery(THREAD)
    assert recovered is not None and recovered.compacted
    for n in range(12):  # more turns than are protected, past the budget
        await worker.append(THREAD, [Message.user(f"{_words(75)} new {n}")])
    _, tokens = await worker.context_tokens(THREAD)
    assert tokens > 1_000
    result = await worker.maybe_compact(THREAD)
    assert result is not None and result.compacted, f"{tokens} tokens, over the 1,000-token budget"
    assert result.tokens_before == tokens > result.tokens_after


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
async def test_a_turn_trigger_counts_the_turns_the_plan_counts_not_the_system_prompt(
    backend: str, cold: bool, tmp_path: Path
) -> None:
    """``TurnCount(4)`` with a system prompt and 4 user turns: no check fires; a fifth turn folds.

    The check counted the system prompt as a turn (every message, before the
    context was cached), the plan did not: every check fired, took the lease
    and planned, and the plan declined, with no back-off.
    """
    from contextlib import asynccontextmanager

    from contextfold import TokenBudget, TurnCount

    leases: list[str] = []
    base = MemoryStore if backend == "memory" else SQLiteStore

    class Leases(base):  # type: ignore[valid-type,misc]
        @asynccontextmanager
        async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
            leases.append(thread)
            async with super().compaction_lock(thread) as held:
                yield held

    store = Leases() if backend == "memory" else Leases(tmp_path / "cf.db")
    async with store:
        policy: dict[str, Any] = {"trigger": TurnCount(4), "strategy": TokenBudget(10_000)}
        writer = Compactor(store, **policy, counter=ApproximateCounter())
        await writer.append(THREAD, [Message.system("be terse")])
        for n in range(4):
            await writer.append(THREAD, [Message.user(f"q{n}")])
        # A cold compactor (a restarted process) has no cached context to count turns in.
        checker = Compactor(store, **policy, counter=ApproximateCounter())
        compactor = checker if cold else writer
        assert [await compactor.maybe_compact(THREAD) for _ in range(5)] == [None] * 5
        assert leases == []
        await compactor.append(THREAD, [Message.user("q4")])
        result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.reason == "turn_count"
    assert leases == [THREAD]


@pytest.mark.parametrize("restarted", [False, True], ids=["same", "restarted"])
async def test_abandon_after_seconds_counts_from_when_the_call_was_made(store: Any, restarted: bool) -> None:
    """A call unanswered past ``abandon_after_seconds`` is closed by the next fold, the first one included.

    The clock started at the first fold that noticed the call, in process
    memory: a call 0.4 s old under ``abandon_after_seconds=0.25`` stayed open
    through that fold, and a restarted process started counting again.
    """
    from contextfold._compactor import ABANDONED_METADATA_KEY

    settings = SummarizeOptions(
        trigger_token_budget=1_000,
        min_recent_messages=0,
        min_recent_turns=1,
        abandon_after_turns=None,
        abandon_after_seconds=0.25,
    )
    maker = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    call = ToolCall(id="c1", name="slow", arguments="{}")
    await maker.append(THREAD, [Message.user("do it"), Message.assistant(None, tool_calls=[call])])
    await anyio.sleep(0.4)
    restart = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    compactor = restart if restarted else maker
    for n in range(12):
        await compactor.append(THREAD, [Message.user(f"{_words(80)} {n}")])
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    closed = [m for m in conversation([r async for r in store.replay(THREAD)]) if m.tool_call_id == "c1"]
    assert len(closed) == 1 and closed[0].metadata[ABANDONED_METADATA_KEY] is True
    assert "within 0.25 s" in closed[0].text


def _calls_answered_in_place(context: Sequence[Message]) -> bool:
    """Whether every call's result follows its message at once, as provider APIs require."""
    for index, message in enumerate(context):
        if message.tool_calls:
            ids = {call.id for call in message.tool_calls}
            after = context[index + 1 : index + 1 + len(ids)]
            if {m.tool_call_id for m in after if m.role is Role.TOOL} != ids:
                return False
    return True


async def test_an_abandoned_calls_error_result_goes_right_after_the_call(store: Any) -> None:
    """The closing result sits after its call, not after the eight turns that came since.

    Appended at the end, it left the call's message followed by user turns (a
    request OpenAI's and Anthropic's APIs refuse) and made one unit of
    everything between them. The log records it, and the other rows keep
    their links.
    """
    from contextfold._compactor import ABANDONED_METADATA_KEY

    settings = SummarizeOptions(
        trigger_token_budget=1_000, target_tokens=500, min_recent_messages=0, min_recent_turns=1
    )
    compactor = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    for n in range(10):
        await compactor.append(THREAD, [Message.user(f"{_words(80)} {n}")])
    lost = ToolCall(id="lost", name="flaky", arguments="{}")
    await compactor.append(THREAD, [Message.assistant(None, tool_calls=[lost])])
    for n in range(8):  # abandon_after_turns defaults to 8
        await compactor.append(THREAD, [Message.user(f"still here {n}")])
    before = {row.seq: row.episode_seq for row in (await store.load(THREAD)).messages}
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    context = await compactor.context(THREAD)
    call_at = next(i for i, m in enumerate(context) if m.tool_calls)
    assert context[call_at + 1].tool_call_id == "lost"
    assert context[call_at + 1].metadata[ABANDONED_METADATA_KEY] is True
    assert [m.text for m in context[call_at + 2 :]] == [f"still here {n}" for n in range(8)]
    assert _calls_answered_in_place(context)
    log = [record async for record in store.replay(THREAD)]
    closing = [r for r in log if getattr(r.episode, "message", None) == context[call_at + 1]]
    assert len(closing) == 1
    rows = (await store.load(THREAD)).messages
    assert rows[call_at + 1].episode_seq == closing[0].seq
    kept = [row for row in rows[call_at + 2 :]]
    assert all(row.episode_seq is not None for row in kept)
    assert {row.episode_seq for row in kept} <= set(before.values())


def pending_call() -> tuple[ToolCall, Message, Message, Message]:
    """A slow call ``A``, and the user's question, the reply making the call, the user's next message."""
    call = ToolCall(id="A", name="slow", arguments="{}")
    return call, Message.user("go"), Message.assistant(None, tool_calls=[call]), Message.user("any news?")


def compactor_on(short_term: Any, episodic: Any = None, **options: Any) -> Compactor:
    """A compactor on one store, or on two when ``episodic`` is another: an 8,000-token budget by default."""
    settings = SummarizeOptions(**{"trigger_token_budget": 8_000, **options})
    return Compactor(
        short_term=short_term,
        episodic=short_term if episodic is None else episodic,
        options=settings,
        counter=ApproximateCounter(),
        log_events=False,
    )


async def test_a_result_that_arrives_after_other_messages_goes_right_after_its_call(store: Any) -> None:
    """A pending call, the user's next message, then the result: the context puts it after the call.

    It was appended at the end, so every later request held
    ``assistant[A], user, tool A``, which OpenAI's and Anthropic's APIs refuse.
    The log keeps the order things happened in.
    """
    compactor = compactor_on(store)
    calls = [ToolCall(id=i, name="slow", arguments="{}") for i in ("A", "B")]
    await compactor.append(THREAD, [Message.user("run both"), Message.assistant(None, tool_calls=calls)])
    await compactor.append(THREAD, [Message.tool("B", "B done")])
    await compactor.append(THREAD, [Message.user("any news?")])
    stored = await compactor.append(THREAD, [Message.tool("A", "A done")])
    context = await compactor.context(THREAD)
    assert [(m.role.value, m.tool_call_id or m.text) for m in context] == [
        ("user", "run both"),
        ("assistant", ""),
        ("tool", "B"),
        ("tool", "A"),
        ("user", "any news?"),
    ]
    assert _calls_answered_in_place(context)
    window = await store.load(THREAD)
    assert window.plain == context
    assert [(row.seq, row.message) for row in stored] == [
        (window.messages[3].seq, Message.tool("A", "A done"))
    ]
    log = conversation([record async for record in store.replay(THREAD)])
    assert [m.tool_call_id or m.text for m in log] == ["run both", "", "B", "any news?", "A"]
    # The next turn's result for the newest reply is appended as usual.
    await compactor.append(
        THREAD, [Message.assistant(None, tool_calls=[ToolCall(id="C", name="f", arguments="{}")])]
    )
    await compactor.append(THREAD, [Message.tool("C", "C done")])
    assert [m.tool_call_id or m.text for m in await compactor.context(THREAD)][-3:] == ["any news?", "", "C"]


@pytest.mark.parametrize("how", ["started", "with the next message", "sync"])
async def test_a_late_result_recorded_with_more_goes_right_after_its_call(store: Any, how: str) -> None:
    """A late result recorded with ``started=``, batched with the user's next message, or through ``sync``.

    Only a batch of bare results was placed: these went at the end, after the
    user's message, and every later request was refused.
    """
    compactor = compactor_on(store)
    call, go, asked, news = pending_call()
    done, more = Message.tool("A", "A done"), Message.user("and now?")
    if how == "sync":
        await compactor.sync(THREAD, [go, asked, news], compact=False)
        await compactor.sync(THREAD, [go, asked, news, done, more], compact=False)
        expected_log = ["go", "", "any news?", "A done", "and now?"]
    else:
        await compactor.append(THREAD, [go, asked])
        await compactor.append(THREAD, [news])
        if how == "started":
            stored = await compactor.append(THREAD, [done], started=[call])
            expected_log = ["go", "", "any news?", "A done"]
        else:
            stored = await compactor.append(THREAD, [done, more])
            expected_log = ["go", "", "any news?", "A done", "and now?"]
        rows = (await store.load(THREAD)).messages
        assert [(row.seq, row.message) for row in stored] == [
            (row.seq, row.message) for row in rows if row.message in (done, more)
        ]
    context = await compactor.context(THREAD)
    assert [m.tool_call_id or m.text for m in context] == ["go", "", "A", "any news?", *expected_log[4:]]
    assert context == (await store.load(THREAD)).plain
    log = [record async for record in store.replay(THREAD)]
    assert [m.text for m in conversation(log)] == expected_log
    if how == "started":
        assert [r.episode.kind for r in log][-2:] == ["tool_call", "tool_result"]


async def test_a_result_that_another_workers_message_overtook_is_moved_right_after_its_call(
    store: Any,
) -> None:
    """Another worker's user message commits between this worker's read of the context and its result's write.

    The result, for the newest reply's call, was appended after that message:
    ``assistant[A], user, tool A`` in every later request of both workers.
    """
    settings = SummarizeOptions(trigger_token_budget=8_000)
    chat = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    write_recording = store._write_recording
    armed: list[int] = []

    async def overtaken(thread: str, recording: Any) -> Any:
        if armed:
            armed.clear()
            await chat.append(THREAD, [Message.user("any news?")])
        return await write_recording(thread, recording)

    store._write_recording = overtaken  # the compactor built next writes through it
    try:
        tools = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
        call = ToolCall(id="A", name="slow", arguments="{}")
        await tools.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[call])])
        await tools.context(THREAD)
        armed.append(1)
        stored = await tools.append(THREAD, [Message.tool("A", "A done")])
    finally:
        del store._write_recording
    context = (await store.load(THREAD)).plain
    assert [m.tool_call_id or m.text for m in context] == ["go", "", "A", "any news?"]
    assert await tools.context(THREAD) == context == await chat.context(THREAD)
    assert [row.message.text for row in stored] == ["A done"]
    assert stored[0].seq == (await store.load(THREAD)).messages[2].seq
    log = conversation([record async for record in store.replay(THREAD)])
    assert [m.text for m in log] == ["go", "", "any news?", "A done"]


@pytest.mark.parametrize("stores", ["one", "two"])
async def test_late_results_for_an_id_a_later_reply_reused_while_open_each_follow_their_call(
    store: Any, stores: str
) -> None:
    """Some models number calls per reply ("call_0"): two open calls share an id, their results come late.

    With an id open twice the results were appended at the end: two calls
    without results, two orphaned tool messages. Each result answers the
    newest open call with its id, as ``unanswered_calls`` pairs them.
    """
    log = store if stores == "one" else MemoryStore()
    compactor = compactor_on(store, log)
    call = ToolCall(id="call_0", name="slow", arguments="{}")
    await compactor.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[call])])
    await compactor.append(THREAD, [Message.user("any news?")])
    await compactor.append(THREAD, [Message.assistant("again", tool_calls=[call])])
    await compactor.append(THREAD, [Message.user("still waiting")])
    await compactor.append(THREAD, [Message.tool("call_0", "second done")])
    await compactor.append(THREAD, [Message.tool("call_0", "first done")])
    context = await compactor.context(THREAD)
    assert [m.text for m in context] == [
        "go",
        "",
        "first done",
        "any news?",
        "again",
        "second done",
        "still waiting",
    ]
    assert _calls_answered_in_place(context)
    assert context == (await store.load(THREAD)).plain


@pytest.mark.parametrize("stores", ["one", "two"])
@pytest.mark.parametrize(
    "shape", ["user then result", "sync", "with started", "with the next message", "with an unknown result"]
)
async def test_a_late_result_goes_after_its_call_in_every_batch_shape(
    store: Any, stores: str, shape: str
) -> None:
    """The user wrote while a tool ran; the result comes in whatever batch a loop or framework makes.

    A user message ahead of the result in its own batch (what a framework's
    list holds), or, with two stores, any batch but results alone, appended
    the result at the end: ``assistant[A], user, tool A`` in every request.
    """
    log = store if stores == "one" else MemoryStore()
    compactor = compactor_on(store, log)
    call, go, asked, news = pending_call()
    done = Message.tool("A", "A done")
    await compactor.append(THREAD, [go, asked])
    if shape == "user then result":
        await compactor.append(THREAD, [news, done])
    elif shape == "sync":
        await compactor.sync(THREAD, [go, asked, news, done], compact=False)
    else:
        await compactor.append(THREAD, [news])
        if shape == "with started":
            await compactor.append(THREAD, [done], started=[call])
        elif shape == "with the next message":
            await compactor.append(THREAD, [done, Message.user("and now?")])
        else:
            await compactor.append(THREAD, [done, Message.tool("Z", "from nowhere")])
    context = [m.tool_call_id or m.text[:12] for m in await compactor.context(THREAD)]
    tail = {"with the next message": ["and now?"], "with an unknown result": ["[a result ar"]}.get(shape, [])
    assert context == ["go", "", "A", "any news?", *tail]
    assert [m.tool_call_id or m.text[:12] for m in (await store.load(THREAD)).plain] == context
    logged = [m.text for m in conversation([record async for record in log.replay(THREAD)])]
    assert logged[:4] == ["go", "", "any news?", "A done"]


async def test_a_result_for_an_older_call_whose_id_a_newer_reply_reused_goes_after_the_older_call(
    store: Any,
) -> None:
    """The newer reply's call with the id is answered already: the next result is the older call's."""
    compactor = compactor_on(store)
    call = ToolCall(id="A", name="slow", arguments="{}")
    await compactor.append(THREAD, [Message.user("go"), Message.assistant("first", tool_calls=[call])])
    await compactor.append(THREAD, [Message.user("any news?")])
    await compactor.append(THREAD, [Message.assistant("second", tool_calls=[call])])
    await compactor.append(THREAD, [Message.tool("A", "newer A done")])
    await compactor.append(THREAD, [Message.tool("A", "older A done")])
    context = await compactor.context(THREAD)
    assert [m.text for m in context] == ["go", "first", "older A done", "any news?", "second", "newer A done"]
    assert _calls_answered_in_place(context)


async def test_two_stores_a_cancellation_once_the_log_is_written_still_writes_the_context() -> None:
    """Cancelled at the context write's first await, the log written: the context takes the batch too.

    The log held the result, the context did not, and ``append`` raised
    ``Cancelled``: a retry would record it twice.
    """
    call = ToolCall(id="A", name="slow", arguments="{}")
    for late in (False, True):
        async with MemoryStore() as short_term, MemoryStore() as episodic:
            compactor = compactor_on(short_term, episodic)
            await compactor.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[call])])
            if late:
                await compactor.append(THREAD, [Message.user("any news?")])
            scopes: list[anyio.CancelScope] = []
            for name in ("append", "replace_prefix"):
                write = getattr(short_term, name)

                async def cancelling(
                    *args: Any, _write: Any = write, _scopes: list[anyio.CancelScope] = scopes, **kwargs: Any
                ) -> Any:
                    if _scopes:
                        _scopes.pop().cancel()
                        await anyio.lowlevel.checkpoint()
                    return await _write(*args, **kwargs)

                setattr(short_term, name, cancelling)
            returned = []
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                returned.append(await compactor.append(THREAD, [Message.tool("A", "A done")]))
            logged = conversation([record async for record in episodic.replay(THREAD)])[-1].text == "A done"
            held = any(m.role is Role.TOOL for m in (await short_term.load(THREAD)).plain)
            assert (bool(returned), logged, held) == (True, True, True), late


async def test_two_stores_a_restarted_compactor_places_a_late_result_and_closes_an_abandoned_call() -> None:
    """With two stores a compactor reads a thread's open calls once: those made before it count too.

    It knew only the calls it had appended itself, so after a restart a late
    result went at the end and an abandoned call was never closed by a check.
    """
    calls = [ToolCall(id=i, name="slow", arguments="{}") for i in ("A", "B", "C")]
    async with MemoryStore() as short_term, MemoryStore() as episodic:
        before = compactor_on(short_term, episodic, abandon_after_turns=2)
        await before.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=calls[:2])])
        await before.append(THREAD, [Message.tool("B", "B done")])
        await before.append(THREAD, [Message.user("any news?")])
        await before.append(THREAD, [Message.assistant(None, tool_calls=calls[2:])])
        restarted = compactor_on(short_term, episodic, abandon_after_turns=2)
        await restarted.append(THREAD, [Message.tool("A", "A done")])
        context = [m.tool_call_id or m.text for m in (await short_term.load(THREAD)).plain]
        assert context == ["go", "", "B", "A", "any news?", ""]
        again = compactor_on(short_term, episodic, abandon_after_turns=2)
        for n in range(2):
            await again.append(THREAD, [Message.user(f"u{n}")])
            assert await again.maybe_compact(THREAD) is None
        context = [m.tool_call_id or m.text for m in await again.context(THREAD)]
        assert context == ["go", "", "B", "A", "any news?", "", "C", "u0", "u1"]
        log = conversation([record async for record in episodic.replay(THREAD)])
        assert [m.tool_call_id for m in log if m.role is Role.TOOL] == ["B", "A", "C"]


async def test_two_stores_a_late_result_is_placed_after_another_workers_fold_meanwhile() -> None:
    """A fold lands between the read and the replacement: the context is read again, the log written once."""
    options = {"trigger_token_budget": 1_000, "min_recent_messages": 0, "min_recent_turns": 1}
    async with MemoryStore() as short_term, MemoryStore() as episodic:
        worker, other = (
            compactor_on(short_term, episodic, **options),
            compactor_on(short_term, episodic, **options),
        )
        for n in range(6):
            await worker.append(THREAD, [Message.user(f"{_words(60)} {n}"), Message.assistant(f"ok {n}")])
        call = ToolCall(id="A", name="slow", arguments="{}")
        await worker.append(THREAD, [Message.assistant(None, tool_calls=[call])])
        await worker.append(THREAD, [Message.user("any news?")])
        replace_prefix = short_term.replace_prefix
        folds: list[Any] = []

        async def fold_first(*args: Any, **kwargs: Any) -> Any:
            if not folds:  # (the other worker's own fold comes through here too)
                folds.append(None)
                folds[0] = await other.compact_now(THREAD)
            return await replace_prefix(*args, **kwargs)

        short_term.replace_prefix = fold_first  # type: ignore[method-assign]
        try:
            await worker.append(THREAD, [Message.tool("A", "A done")])
        finally:
            del short_term.replace_prefix
        assert folds[0] is not None and folds[0].compacted
        context = (await short_term.load(THREAD)).plain
        assert context[0].is_summary
        assert [m.tool_call_id or m.text for m in context[-3:]] == ["", "A", "any news?"]
        log = conversation([record async for record in episodic.replay(THREAD)])
        assert [m.text for m in log if m.role is Role.TOOL] == ["A done"]


async def test_a_result_placed_after_its_call_starts_over_when_another_worker_folded_meanwhile(
    store: Any,
) -> None:
    """Another worker's fold lands between the result's read of the context and its write: placed anew."""
    settings = SummarizeOptions(trigger_token_budget=1_000, min_recent_messages=0, min_recent_turns=1)
    compactor = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    other = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    for n in range(6):
        await compactor.append(THREAD, [Message.user(f"{_words(60)} {n}"), Message.assistant(f"ok {n}")])
    call = ToolCall(id="A", name="slow", arguments="{}")
    await compactor.append(THREAD, [Message.assistant(None, tool_calls=[call])])
    await compactor.append(THREAD, [Message.user("any news?")])
    record_and_replace = store.record_and_replace
    folds = []

    async def fold_first(*args: Any, **kwargs: Any) -> Any:
        if not folds:
            folds.append(await other.compact_now(THREAD))
        return await record_and_replace(*args, **kwargs)

    store.record_and_replace = fold_first
    try:
        stored = await compactor.append(THREAD, [Message.tool("A", "A done")])
    finally:
        del store.record_and_replace
    assert folds[0] is not None and folds[0].compacted
    context = await compactor.context(THREAD)
    assert context[0].is_summary
    assert [m.tool_call_id or m.text for m in context[-3:]] == ["", "A", "any news?"]
    assert context == (await store.load(THREAD)).plain
    assert [row.message.text for row in stored] == ["A done"]
    log = conversation([record async for record in store.replay(THREAD)])
    assert [m.text for m in log if m.role is Role.TOOL] == ["A done"]


@pytest.mark.parametrize("stores", ["one", "two"])
async def test_an_abandoned_call_is_closed_by_a_check_with_no_fold_to_make(store: Any, stores: str) -> None:
    """Far under the budget, a call unanswered for ``abandon_after_turns`` turns gets its error result.

    Abandoned calls were closed only inside a fold: under the trigger every
    request went on carrying a call with no result (which providers refuse),
    however many turns passed. With two stores (the log in its own) too.
    """
    from contextfold._compactor import ABANDONED_METADATA_KEY

    log = store if stores == "one" else MemoryStore()
    compactor = compactor_on(store, log, trigger_token_budget=60_000, abandon_after_turns=2)
    lost = ToolCall(id="A", name="slow", arguments="{}")
    await compactor.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[lost])])
    texts = []
    for n in range(3):
        await compactor.append(THREAD, [Message.user(f"u{n}")])
        assert await compactor.maybe_compact(THREAD) is None
        context = await compactor.context(THREAD)
        texts.append([m.tool_call_id or m.text for m in context])
    assert texts[0] == ["go", "", "u0"]  # one turn after the call: it may still come
    assert texts[1] == texts[2][:-1] == ["go", "", "A", "u0", "u1"]
    assert context[2].metadata[ABANDONED_METADATA_KEY] is True
    assert context == (await store.load(THREAD)).plain
    assert await log.latest_checkpoint(THREAD) is None  # no fold was made
    logged = conversation([record async for record in log.replay(THREAD)])
    assert [m.tool_call_id for m in logged if m.role is Role.TOOL] == ["A"]


@pytest.mark.parametrize("stores", ["one", "two"])
@pytest.mark.parametrize("restarted", [False, True])
async def test_an_abandoned_call_is_closed_by_checks_of_a_loop_that_never_reads_the_context(
    store: Any, stores: str, restarted: bool
) -> None:
    """A loop that builds its requests itself (``append`` and ``maybe_compact``, never ``context()``).

    The check looked for abandoned calls only in a context ``context()`` had
    cached, so on one store such a loop carried the unanswered call (and
    nothing after it was ever answered) however many turns passed. Also when
    the call was made by an earlier compactor, before a restart.
    """
    from contextfold._compactor import ABANDONED_METADATA_KEY

    log = store if stores == "one" else MemoryStore()
    compactor = compactor_on(store, log, trigger_token_budget=60_000, abandon_after_turns=2)
    lost = ToolCall(id="A", name="slow", arguments="{}")
    await compactor.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[lost])])
    if restarted:
        compactor = compactor_on(store, log, trigger_token_budget=60_000, abandon_after_turns=2)
    for n in range(3):
        await compactor.append(THREAD, [Message.user(f"u{n}")])
        assert await compactor.maybe_compact(THREAD) is None
    context = (await store.load(THREAD)).plain
    assert [m.tool_call_id or m.text for m in context] == ["go", "", "A", "u0", "u1", "u2"]
    assert context[2].metadata[ABANDONED_METADATA_KEY] is True
    logged = conversation([record async for record in log.replay(THREAD)])
    assert [m.tool_call_id or m.text for m in logged] == ["go", "", "u0", "u1", "A", "u2"]


async def test_workers_taking_turns_on_a_thread_read_its_context_once_each_for_their_checks(
    store: Any,
) -> None:
    """Two compactors on one store, each a loop that appends then checks (never ``context()``).

    The other worker's write drops a compactor's cached context, and the
    check that reads it to close abandoned calls read the whole thread again
    at every step (20 whole reads in 20 no-op checks). It reads it once per
    process, as a restart's first check must.
    """
    options = SummarizeOptions(trigger_token_budget=500_000)
    workers = [Compactor(store, options=options, counter=ApproximateCounter()) for _ in range(2)]
    await workers[0].append(THREAD, [Message.user(f"m{n}") for n in range(200)])
    reads = counted_reads(store)
    for n in range(20):
        worker = workers[n % 2]
        await worker.append(THREAD, [Message.user(f"q{n}"), Message.assistant(f"a{n}")])
        assert await worker.maybe_compact(THREAD) is None
    assert reads.count("tail") + reads.count("load") <= 2


async def test_a_second_abandoned_call_is_closed_after_the_first_numbered_a_row_0(store: Any) -> None:
    """Two calls abandoned one after the other on a never-folded thread: both get their result in place.

    Closing the first lengthened the context, so its rows were numbered from
    0; closing the second named that row, and the store refused ``stands_for``
    of 0. From then on every check of the thread raised ``ConfigError``.
    """
    settings = SummarizeOptions(trigger_token_budget=400, abandon_after_turns=2)
    compactor = Compactor(store, options=settings, counter=ApproximateCounter(), log_events=False)
    first = ToolCall(id="A", name="slow", arguments="{}")
    second = ToolCall(id="B", name="slow", arguments="{}")
    await compactor.append(THREAD, [Message.system("You are terse."), Message.user("go")])
    await compactor.append(THREAD, [Message.assistant(None, tool_calls=[first])])
    await compactor.append(THREAD, [Message.user("u1")])
    await compactor.append(THREAD, [Message.assistant(None, tool_calls=[second])])
    await compactor.append(THREAD, [Message.user("u2 " + "x " * 1000)])
    await compactor.maybe_compact(THREAD)  # A is closed in place; B, one turn old, still waits
    assert (await store.load(THREAD)).messages[0].seq == 0
    await compactor.append(THREAD, [Message.user("u3")])
    await compactor.maybe_compact(THREAD)  # B's turn: two turns after it now
    await compactor.maybe_compact(THREAD)
    context = await compactor.context(THREAD)
    assert [(m.role.value, m.tool_call_id or m.text[:2]) for m in context] == [
        ("system", "Yo"),
        ("user", "go"),
        ("assistant", ""),
        ("tool", "A"),
        ("user", "u1"),
        ("assistant", ""),
        ("tool", "B"),
        ("user", "u2"),
        ("user", "u3"),
    ]
    assert _calls_answered_in_place(context)
    assert context == (await store.load(THREAD)).plain
    log = conversation([record async for record in store.replay(THREAD)])
    assert sorted(m.tool_call_id for m in log if m.role is Role.TOOL) == ["A", "B"]


async def test_the_context_keeps_rows_an_edit_numbered_below_1(store: Any) -> None:
    """An edit that lengthens a never-folded context numbers down past seq 1; ``context()`` keeps those rows.

    The cached context was rebuilt from ``tail(after_seq=0)``, which read
    only seqs above 0, and its first build skipped rows at or below its
    starting ``last_seq`` of 0: the edit's first message vanished from what
    the model is sent, while the store held it.
    """
    compactor = Compactor(store, options=options(), counter=ApproximateCounter())
    await compactor.append(THREAD, [Message.user("a"), Message.user("b")])
    assert [m.text for m in await compactor.context(THREAD)] == ["a", "b"]
    window = await store.load(THREAD)
    edited = [Message.system("be brief"), Message.user("a"), Message.user("b")]
    await store.replace_prefix(
        THREAD,
        through_seq=window.messages[-1].seq,
        expected_version=window.version,
        replacement=edited,
        tokens=[3, 1, 1],
    )
    assert await compactor.context(THREAD) == (await store.load(THREAD)).plain == edited
    fresh = Compactor(store, options=options(), counter=ApproximateCounter())
    assert await fresh.context(THREAD) == edited
    await compactor.append(THREAD, [Message.user("c")])
    assert [m.text for m in await compactor.context(THREAD)] == ["be brief", "a", "b", "c"]


async def test_the_raise_policy_raises_a_summarizer_timeout_as_a_summarizer_error(store: Any) -> None:
    """A summarizer timing out under ``on_summarizer_error="raise"``: ``SummarizerError``, nothing written.

    The README promises ``"raise"`` raises ``SummarizerError``; a timeout came out
    as the bare ``TimeoutError``, which a caller catching ``SummarizerError``
    for an outage did not see.
    """

    async def slow(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        with anyio.fail_after(0.01):
            await anyio.sleep(1)
        return "never"

    compactor = Compactor(
        store,
        options=options(on_summarizer_error="raise"),
        summarizer=FunctionSummarizer(slow),
        counter=ApproximateCounter(),
    )
    await grow(compactor, range(6), compact=False)
    before = await store.load(THREAD)
    with pytest.raises(SummarizerError, match="timed out") as caught:
        await compactor.maybe_compact(THREAD)
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert await store.load(THREAD) == before


async def test_a_huge_summary_is_counted_and_cut_off_the_event_loop(store: Any) -> None:
    """A summarizer that writes 1.9 MB where 60 tokens were asked: its summary is counted in a worker thread.

    The count (and the cut to fit) ran on the event loop: 170-280 ms of loop
    stall with tiktoken for this summary.
    """
    loop_thread = threading.get_ident()
    counted_on: list[tuple[int, bool]] = []

    class Watching(ApproximateCounter):
        def count(self, message: Message) -> int:
            if message.is_summary or message.text.startswith(SUMMARY_PREFIX):
                counted_on.append((len(message.text), threading.get_ident() == loop_thread))
            return super().count(message)

    async def verbose(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "fact " * 400_000

    compactor = Compactor(
        store, options=options(), summarizer=FunctionSummarizer(verbose), counter=Watching()
    )
    await grow(compactor, range(6), compact=False)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    summary = (await compactor.context(THREAD))[0]
    assert summary.is_summary and len(summary.text) < 1_000
    big = [on_loop for chars, on_loop in counted_on if chars > 64 * 1024]
    assert big and not any(big)
