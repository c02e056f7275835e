"""Every public trigger and strategy folds through a real Compactor, and the policy's guarantees hold there.

Each test asserts the context after the fold, not only the reason: a stalled
result carries a reason too.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from contextfold import (
    Compactor,
    EpisodicCompactionConfig,
    Message,
    ObservationMasking,
    RunOptions,
    SlidingWindow,
    SummarizeOptions,
    TokenBudget,
    TokenCount,
    ToolCall,
    TurnCount,
    Usage,
    conversation,
)
from contextfold import _tokens as tokens_module
from contextfold._compactor import ABANDONED_METADATA_KEY, LATE_RESULT_METADATA_KEY, CompactionResult
from contextfold._policy import MessageCount, Pressure, Reason, Trigger
from contextfold._strategies import MASKED_METADATA_KEY, group_units
from contextfold.episodes import SummaryCheckpoint, UserMessageEpisode
from contextfold.events import FoldApplied
from contextfold.planning import AllOf, EpisodicPolicy
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import ApproximateCounter

THREAD = "policy"


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    backend = MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "cf.db")
    async with backend:
        yield backend


def counting_summarizer() -> FunctionSummarizer:
    async def fn(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        tags = [str(m.metadata.get("n", "?")) for m in messages]
        return f"{previous or ''} covered {','.join(tags)}"[-(limit * 3) :]

    return FunctionSummarizer(fn)


def tool_turn(n: int, size: int = 40, tool: str = "read_file") -> list[Message]:
    call = ToolCall(id=f"c{n}", name=tool, arguments=json.dumps({"path": f"src/f{n}.py"}))
    return [
        Message.user(f"turn {n} " + "word " * size, metadata={"n": f"u{n}"}),
        Message.assistant(None, tool_calls=[call], metadata={"n": f"a{n}"}),
        Message.tool(call.id, f"contents of src/f{n}.py " + "line " * size, metadata={"n": f"r{n}"}),
    ]


def no_orphans(context: Sequence[Message]) -> None:
    """Every tool result in the context has its call before it."""
    seen: set[str] = set()
    for message in context:
        seen.update(call.id for call in message.tool_calls)
        if message.tool_call_id is not None:
            assert message.tool_call_id in seen, f"orphaned tool result {message.tool_call_id}"


async def test_a_turn_trigger_with_a_sliding_window_folds_to_the_window(store: Any) -> None:
    """TurnCount with SlidingWindow given straight to the Compactor keeps exactly the newest turns."""
    summarizer = counting_summarizer()
    compactor = Compactor(
        store,
        trigger=TurnCount(6),
        strategy=SlidingWindow(2),
        summarizer=summarizer,
        counter=ApproximateCounter(),
    )
    for n in range(4):
        await compactor.append(THREAD, tool_turn(n, size=2))
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.reason == Reason.TURN_COUNT
    context = await compactor.context(THREAD)
    assert context[0].is_summary
    assert [m.metadata.get("n") for m in context[1:]] == ["u3", "a3", "r3"]
    assert "u0" in context[0].text and "r2" in context[0].text


class AfterTwoTurns(Trigger):
    """A trigger of a user's own, naming its reason with a string of its own."""

    def reason(self, pressure: Pressure) -> str | None:
        return "after_two_turns" if pressure.turns > 2 else None


@pytest.mark.parametrize("custom", [False, True], ids=["built-in", "custom"])
async def test_a_folds_reason_is_typed_with_its_stable_name_and_reads_back_as_it(
    store: Any, custom: bool
) -> None:
    """A built-in trigger's reason is a ``Reason`` in the result and in the checkpoint read back from the
    log; a custom trigger's own name is kept as given. The public fields are typed ``Reason | str``.
    """
    trigger = AfterTwoTurns() if custom else TurnCount(2)
    compactor = Compactor(
        store, trigger=trigger, strategy=SlidingWindow(1), summarizer=counting_summarizer(),
        counter=ApproximateCounter(),
    )  # fmt: skip
    for n in range(3):
        await compactor.append(THREAD, tool_turn(n, size=2))
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    expected = "after_two_turns" if custom else Reason.TURN_COUNT
    episodes = [record.episode async for record in store.replay(THREAD)]
    (checkpoint,) = [episode for episode in episodes if isinstance(episode, SummaryCheckpoint)]
    for reason in (result.reason, checkpoint.trigger):
        assert reason == expected
        assert type(reason) is (str if custom else Reason)
    context = await compactor.context(THREAD)
    assert context[0].is_summary and [m.metadata.get("n") for m in context[1:]] == ["u2", "a2", "r2"]
    for hint in (
        get_type_hints(CompactionResult)["reason"],
        get_type_hints(FoldApplied)["reason"],
        SummaryCheckpoint.model_fields["trigger"].annotation,
    ):
        assert set(get_args(hint)) == {Reason, str}


async def test_a_message_count_trigger_folds(store: Any) -> None:
    """MessageCount fires on messages, and a token budget strategy then keeps the protected turns only."""
    compactor = Compactor(
        store,
        trigger=MessageCount(8),
        strategy=TokenBudget(100_000, keep_recent_turns=2),
        summarizer=counting_summarizer(),
        counter=ApproximateCounter(),
    )
    for n in range(3):
        await compactor.append(THREAD, tool_turn(n, size=2))
    assert await compactor.maybe_compact(THREAD) is not None
    context = await compactor.context(THREAD)
    assert context[0].is_summary
    assert [m.metadata.get("n") for m in context[1:]] == ["u2", "a2", "r2"]


async def test_combined_triggers_fold_through_the_compactor(store: Any) -> None:
    """TokenCount.fraction_of | TurnCount and an AllOf fire and fold at run time."""
    either = Compactor(
        store,
        trigger=TokenCount.fraction_of(1_000, 0.5) | TurnCount(1_000),
        strategy=TokenBudget(250),
        summarizer=counting_summarizer(),
        counter=ApproximateCounter(),
    )
    for n in range(8):
        await either.append(THREAD, tool_turn(n))
    result = await either.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.tokens_after <= 250
    both = Compactor(
        store,
        trigger=AllOf(TokenCount(10), TurnCount(3)),
        strategy=SlidingWindow(1),
        summarizer=counting_summarizer(),
        counter=ApproximateCounter(),
    )
    for n in range(8, 12):
        await both.append("other", tool_turn(n, size=2))
    assert (await both.maybe_compact("other")) is not None
    assert [m.metadata.get("n") for m in (await both.context("other"))[1:]] == ["u11", "a11", "r11"]


async def test_unfinished_turns_fold_instead_of_stalling(store: Any) -> None:
    """The episodic unfinished-turns trigger on a small context folds all but the protected turns."""
    options = RunOptions(
        max_history_tokens=60_000,
        compaction=SummarizeOptions(
            trigger_token_budget=60_000,
            episodic=EpisodicCompactionConfig(trigger_unfinished_turns=3),
            min_recent_messages=0,
        ),
    )
    summarizer = counting_summarizer()
    compactor = Compactor(store, options=options, summarizer=summarizer, counter=ApproximateCounter())
    results = []
    for n in range(40):
        await compactor.append(THREAD, [Message.user(f"ping {n}", metadata={"n": n})])
        results.append(await compactor.maybe_compact(THREAD))
    folds = [r for r in results if r is not None]
    assert folds and all(r.compacted and r.reason == "unfinished_turns" for r in folds)
    context = await compactor.context(THREAD)
    assert context[0].is_summary
    assert len(context) <= 1 + 3  # the summary and at most the turns since the last fold
    assert len(summarizer.calls) == len(folds)


async def test_the_age_rule_counts_from_the_last_checkpoint() -> None:
    """Once age_and_turns has folded, it waits for new user messages instead of firing on every check."""
    from datetime import UTC, datetime, timedelta

    policy = EpisodicPolicy(
        EpisodicCompactionConfig(trigger_unfinished_turns=1_000, trigger_age_days=1, trigger_age_turn_count=5)
    )
    async with MemoryStore() as store:
        compactor = Compactor(
            store, trigger=policy, strategy=SlidingWindow(1), summarizer=counting_summarizer()
        )
        old = datetime.now(UTC) - timedelta(days=3)
        for n in range(6):
            await store.record(THREAD, UserMessageEpisode(message=Message.user(f"q{n}")), at=old)
        await store.append(THREAD, [Message.user(f"q{n}") for n in range(6)], [3] * 6)
        first = await compactor.maybe_compact(THREAD)
        assert first is not None and first.compacted and first.reason == "age_and_turns"
        assert await compactor.maybe_compact(THREAD) is None
        assert (await compactor.context(THREAD))[0].is_summary


async def test_a_pinned_head_over_the_target_stalls_naming_it_without_calling_the_summarizer(
    store: Any,
) -> None:
    """A system prompt bigger than the target stalls with its size and the target, and summarizes nothing."""
    summarizer = counting_summarizer()
    compactor = Compactor(
        store,
        options=RunOptions(
            max_history_tokens=32_000, compaction=SummarizeOptions(trigger_token_budget=8_000)
        ),
        summarizer=summarizer,
        counter=ApproximateCounter(),
    )
    await compactor.append(THREAD, [Message.system("rule " * 3_600)])
    for n in range(40):
        await compactor.append(THREAD, tool_turn(n))
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled
    assert "pinned head alone holds" in result.detail and "4000-token target" in result.detail
    assert summarizer.calls == []


async def test_after_every_fold_the_whole_request_is_under_the_target(store: Any) -> None:
    """With a large system prompt and big tool results, each fold leaves the whole request within target."""
    options = RunOptions(max_history_tokens=16_000, compaction=SummarizeOptions(trigger_token_budget=4_000))
    compactor = Compactor(
        store, options=options, summarizer=counting_summarizer(), counter=ApproximateCounter()
    )
    await compactor.append(THREAD, [Message.system("rule " * 800)])
    target = 2_000
    for n in range(30):
        await compactor.append(THREAD, tool_turn(n, size=120))
        result = await compactor.maybe_compact(THREAD)
        if result is not None and result.compacted:
            _, tokens = await compactor.context_tokens(THREAD)
            assert tokens <= target
            assert result.tokens_after <= target


async def test_folds_are_amortized_over_the_budget_minus_the_target(store: Any) -> None:
    """Big tool results under a small budget fold at most once per budget - target tokens of growth."""
    options = RunOptions(max_history_tokens=16_000, compaction=SummarizeOptions(trigger_token_budget=4_000))
    summarizer = counting_summarizer()
    compactor = Compactor(store, options=options, summarizer=summarizer, counter=ApproximateCounter())
    counter = ApproximateCounter()
    grown = 0
    folds = 0
    for n in range(32):
        turn = tool_turn(n, size=700)  # about 970 tokens of tool output per request
        grown += sum(counter.count(m) for m in turn)
        await compactor.append(THREAD, turn)
        result = await compactor.maybe_compact(THREAD)
        folds += result is not None and result.compacted
        context = await compactor.context(THREAD)
        no_orphans(context)
    assert folds <= grown // (4_000 - 2_000) + 1
    assert len(summarizer.calls) == folds


async def test_the_held_back_fold_still_fires_at_max_history_tokens(store: Any) -> None:
    """A fold left over the target waits budget - target tokens, but a request never passes the limit.

    Here the wait would end at 980 + 500 = 1,480 tokens, past the 1,200-token
    limit: before, a 1,431-token request went out with no fold.
    """
    options = RunOptions(
        max_history_tokens=1_200,
        compaction=SummarizeOptions(trigger_token_budget=1_000, min_recent_messages=0),
    )
    compactor = Compactor(
        store, options=options, summarizer=counting_summarizer(), counter=ApproximateCounter()
    )
    for n in range(10):
        await compactor.append(
            THREAD, [Message.user(f"q{n} " + "x " * 20), Message.assistant(f"a{n} " + "y " * 20)]
        )
    # The two newest turns, which the floor protects, are large: the fold ends over the target.
    await compactor.append(
        THREAD, [Message.user("big " + "z " * 800), Message.assistant("big " + "w " * 800)]
    )
    first = await compactor.maybe_compact(THREAD)
    assert first is not None and first.compacted
    assert 500 < first.tokens_after < 1_200
    await compactor.append(THREAD, [Message.user("next " + "v " * 900)])
    assert (await compactor.context_tokens(THREAD))[1] > 1_200
    second = await compactor.maybe_compact(THREAD)
    assert second is not None and second.compacted
    assert (await compactor.context_tokens(THREAD))[1] <= 1_200


async def test_a_pending_call_in_the_middle_is_kept_until_its_result_arrives(store: Any) -> None:
    """A tool call still running while other writers append is never folded away from its later result."""
    compactor = Compactor(
        store,
        trigger=TurnCount(4),
        strategy=SlidingWindow(1),
        summarizer=counting_summarizer(),
        counter=ApproximateCounter(),
    )
    slow = ToolCall(id="slow", name="long_job", arguments="{}")
    await compactor.append(
        THREAD, [Message.user("start the job"), Message.assistant(None, tool_calls=[slow])]
    )
    for n in range(6):  # other writers keep the conversation going while the job runs
        await compactor.append(THREAD, [Message.user(f"meanwhile {n}", metadata={"n": n})])
        await compactor.maybe_compact(THREAD)
        context = await compactor.context(THREAD)
        assert any(slow in m.tool_calls for m in context)
    await compactor.append(THREAD, [Message.tool("slow", "job done")])
    context = await compactor.context(THREAD)
    no_orphans(context)
    # The result goes right after its call, ahead of what came meanwhile, as providers require.
    at = next(index for index, m in enumerate(context) if slow in m.tool_calls)
    assert context[at + 1].tool_call_id == "slow"
    assert context[-1].text == "meanwhile 5"


async def test_an_abandoned_call_gets_an_error_result_in_both_logs_and_a_late_result_becomes_a_note(
    store: Any,
) -> None:
    """A call unanswered for many turns is closed with an error result; a later result is a plain note."""
    options = RunOptions(
        max_history_tokens=8_000,
        compaction=SummarizeOptions(
            trigger_token_budget=2_000, abandon_after_turns=3, min_recent_turns=1, min_recent_messages=0
        ),
    )
    compactor = Compactor(
        store, options=options, summarizer=counting_summarizer(), counter=ApproximateCounter()
    )
    lost = ToolCall(id="lost", name="flaky", arguments="{}")
    await compactor.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[lost])])
    for n in range(30):
        await compactor.append(THREAD, [Message.user(f"still here {n} " + "word " * 60, metadata={"n": n})])
        await compactor.maybe_compact(THREAD)
        no_orphans(await compactor.context(THREAD))
    log = [r async for r in store.replay(THREAD)]
    closed = [m for m in conversation(log) if m.metadata.get(ABANDONED_METADATA_KEY)]
    assert [m.tool_call_id for m in closed] == ["lost"]
    assert (await compactor.context(THREAD))[0].is_summary  # compaction went on past the abandoned call
    await compactor.append(THREAD, [Message.tool("lost", "finally: 42")])
    context = await compactor.context(THREAD)
    no_orphans(context)
    assert context[-1].role.value == "user" and "finally: 42" in context[-1].text
    assert context[-1].metadata[LATE_RESULT_METADATA_KEY] == "lost"
    replayed = conversation([r async for r in store.replay(THREAD)])
    assert replayed[-1] == Message.tool("lost", "finally: 42")


async def test_a_late_result_recorded_by_a_worker_whose_cache_is_behind_is_still_a_note(store: Any) -> None:
    """Another worker's fold closed the call while this one's cached context still held it open.

    The worker that made the call recorded its result as a ``tool`` message,
    trusting its cached context: an orphan every later request carried (the
    call was folded into the summary), which providers refuse.
    """
    options = RunOptions(
        max_history_tokens=8_000,
        compaction=SummarizeOptions(
            trigger_token_budget=2_000, abandon_after_turns=3, min_recent_turns=1, min_recent_messages=0
        ),
    )

    def worker() -> Compactor:
        return Compactor(
            store, options=options, summarizer=counting_summarizer(), counter=ApproximateCounter()
        )

    agent, other = worker(), worker()
    lost = ToolCall(id="lost", name="flaky", arguments="{}")
    await agent.append(THREAD, [Message.user("go")])
    await agent.context(THREAD)  # the agent caches the thread
    await agent.append(THREAD, [Message.assistant(None, tool_calls=[lost])])
    folds = 0
    for n in range(30):  # the other worker goes on, and its folds close the call
        await other.append(THREAD, [Message.user(f"still here {n} " + "word " * 60, metadata={"n": n})])
        result = await other.maybe_compact(THREAD)
        folds += result is not None and result.compacted
    assert folds and not any(lost in m.tool_calls for m in await other.context(THREAD))
    await agent.append(THREAD, [Message.tool("lost", "finally: 42")])
    for compactor in (agent, other):
        context = await compactor.context(THREAD)
        no_orphans(context)
        assert context[-1].role.value == "user" and "finally: 42" in context[-1].text
        assert context[-1].metadata[LATE_RESULT_METADATA_KEY] == "lost"
    assert conversation([r async for r in store.replay(THREAD)])[-1] == Message.tool("lost", "finally: 42")


async def test_keep_first_pins_the_task_across_folds(store: Any) -> None:
    """keep_first=1 keeps the first user message verbatim before the summary through every fold."""
    options = RunOptions(
        max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_000, keep_first=1)
    )
    compactor = Compactor(
        store, options=options, summarizer=counting_summarizer(), counter=ApproximateCounter()
    )
    task = Message.user("the task: port the parser", metadata={"n": "task"})
    await compactor.append(THREAD, [Message.system("rules"), task])
    folds = 0
    for n in range(20):
        await compactor.append(THREAD, tool_turn(n))
        result = await compactor.maybe_compact(THREAD)
        folds += result is not None and result.compacted
    context = await compactor.context(THREAD)
    assert folds >= 2
    assert context[0].text == "rules" and context[1] == task and context[2].is_summary


async def test_masking_limited_to_named_tools_clears_their_arguments(store: Any) -> None:
    """ObservationMasking(tools=...) masks those tools' outputs only, and with clear_arguments their calls."""
    masking = ObservationMasking(
        1, placeholder="[{tool} output elided]", tools=("browser",), clear_arguments=True
    )
    compactor = Compactor(store, trigger=TokenCount(300), strategy=masking, counter=ApproximateCounter())
    for n in range(4):
        await compactor.append(THREAD, tool_turn(n, tool="browser" if n % 2 else "read_file"))
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.masked_messages == 1
    context = await compactor.context(THREAD)
    masked = [m for m in context if m.metadata.get(MASKED_METADATA_KEY)]
    assert [(m.tool_call_id, m.text) for m in masked] == [("c1", "[browser output elided]")]
    call = next(c for m in context for c in m.tool_calls if c.id == "c1")
    assert call.arguments == "{}"
    assert all(c.arguments != "{}" for m in context for c in m.tool_calls if c.id != "c1")
    excluded = ObservationMasking(0, exclude_tools=("read_file",))
    assert not excluded.applies_to("read_file") and excluded.applies_to("browser")


async def test_a_mask_then_summarize_pipeline_summarizes_only_when_masking_is_not_enough(store: Any) -> None:
    """Masking first leaves the summarizer idle while it suffices, and summarizing takes over when not."""
    summarizer = counting_summarizer()
    compactor = Compactor(
        store,
        trigger=TokenCount(1_200),
        strategy=[ObservationMasking(1), TokenBudget(800)],
        summarizer=summarizer,
        counter=ApproximateCounter(),
    )
    for n in range(4):
        _, call, result = tool_turn(n, size=300)
        await compactor.append(THREAD, [Message.user(f"turn {n}", metadata={"n": f"u{n}"}), call, result])
    first = await compactor.maybe_compact(THREAD)
    assert first is not None and first.masked_messages > 0 and first.dropped_messages == 0
    assert summarizer.calls == []
    for n in range(4, 16):
        await compactor.append(THREAD, [Message.user(f"chat {n} " + "word " * 80, metadata={"n": n})])
        await compactor.maybe_compact(THREAD)
    assert summarizer.calls
    _, tokens = await compactor.context_tokens(THREAD)
    assert tokens <= 1_200


async def test_when_masking_is_not_enough_the_summarizer_reads_the_tool_outputs_it_folds(store: Any) -> None:
    """mask_then_summarize sends the folded tool results as they were, and counts only masks that stay."""
    seen: list[Message] = []

    async def fn(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        seen.extend(messages)
        return "what happened"

    options = SummarizeOptions(trigger_token_budget=1_000, mode="mask_then_summarize", min_recent_messages=0)
    compactor = Compactor(
        store, options=options, summarizer=FunctionSummarizer(fn), counter=ApproximateCounter()
    )
    for n in range(8):
        call = ToolCall(id=f"c{n}", name="search", arguments=json.dumps({"q": n}))
        await compactor.append(
            THREAD,
            [
                Message.user(f"question {n} " + "word " * 120),
                Message.assistant(None, tool_calls=[call]),
                Message.tool(call.id, f"FACT-{n} " + "res " * 30),
            ],
        )
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted and result.dropped_messages > 0
    results = [m for m in seen if m.tool_call_id is not None]
    assert [m.text.split()[0] for m in results] == [f"FACT-{n}" for n in range(len(results))]
    assert not any(m.metadata.get(MASKED_METADATA_KEY) for m in seen)
    context = await compactor.context(THREAD)
    masked = [m for m in context if m.metadata.get(MASKED_METADATA_KEY)]
    assert result.masked_messages == len(masked) == 1
    no_orphans(context)


async def test_the_values_a_refused_target_names_fold(store: Any) -> None:
    """The fixes the target-over-trigger errors name fold, and each fold lands under its trigger."""
    compactor = Compactor(
        store, trigger=TokenCount(1_000), strategy=TokenBudget(500), counter=ApproximateCounter()
    )
    folds = []
    for n in range(40):
        await compactor.append(THREAD, [Message.user("word " * 80 + str(n))])
        result = await compactor.maybe_compact(THREAD)
        if result is not None:
            assert result.compacted and result.tokens_after <= 1_000
            folds.append(result)
    assert 1 <= len(folds) <= 8  # ~4,000 tokens of growth, one fold per 500
    options = SummarizeOptions(
        trigger_token_budget=100_000,
        target_tokens=1_000,
        episodic=EpisodicCompactionConfig(trigger_context_tokens=2_000, trigger_unfinished_turns=10_000),
    )
    pressured = Compactor(store, options=options, counter=ApproximateCounter())
    reasons = []
    for n in range(60):
        await pressured.append("pressured", [Message.user("word " * 60 + str(n))])
        result = await pressured.maybe_compact("pressured")
        if result is not None:
            assert result.compacted
            reasons.append(result.reason)
    assert reasons and set(reasons) == {Reason.CONTEXT_PRESSURE}
    _, tokens = await pressured.context_tokens("pressured")
    assert tokens < 2_000


async def test_provider_usage_raises_the_pressure_the_trigger_sees(store: Any) -> None:
    """Input tokens reported with a reply count what the counter cannot see, and can make the trigger fire."""
    compactor = Compactor(
        store, trigger=TokenCount(3_000), strategy=TokenBudget(2_000), counter=ApproximateCounter()
    )
    for n in range(25):
        await compactor.append(THREAD, tool_turn(n, size=20))
    messages, tokens = await compactor.context_tokens(THREAD)
    assert await compactor.maybe_compact(THREAD) is None
    reply = Message.assistant("ok")
    await compactor.append(  # the provider billed 1,600 tokens the counter cannot see (tool schemas)
        THREAD, [reply], usage=Usage(input_tokens=tokens + 1_600, output_tokens=2), request_tokens=tokens
    )
    _, seen = await compactor.context_tokens(THREAD)
    assert seen >= tokens + 1_600
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    assert len(await compactor.context(THREAD)) < len(messages) + 1


def test_units_are_pending_wherever_a_call_waits() -> None:
    """group_units marks a unit pending when any of its calls is unanswered, even with turns after it."""
    call = ToolCall(id="x", name="t", arguments="{}")
    body = [Message.assistant(None, tool_calls=[call]), Message.user("later"), Message.user("later still")]
    units, orphans = group_units(body)
    assert [u.pending for u in units] == [True, False, False]
    assert orphans == []


async def test_a_result_for_a_reused_open_call_id_reaches_the_context_as_a_tool_result_with_one_store_or_two(
    tmp_path: Path,
) -> None:
    """An id reused while its first call is open pairs each result with a call, with or without the cache.

    Some providers number calls per reply ("call_0"): a reply can reuse the id of
    a call still open. A result answers the newest open call with its id, so the
    second result answers the first call. A compactor on one ``Store`` (which
    keeps the thread's context cached) must send it as a tool result, as one on
    two stores does, not turn it into a late-result note.
    """
    first = ToolCall(id="call_0", name="read_file", arguments='{"path": "a.py"}')
    second = ToolCall(id="call_0", name="read_file", arguments='{"path": "b.py"}')
    steps = [
        [Message.user("read a.py")],
        [Message.assistant(None, tool_calls=[first])],
        [Message.user("and b.py too")],
        [Message.assistant(None, tool_calls=[second])],
        [Message.tool("call_0", "contents of b.py")],
        [Message.tool("call_0", "contents of a.py")],
    ]
    contexts = []
    async with MemoryStore() as one, MemoryStore() as short_term, SQLiteStore(tmp_path / "log.db") as log:
        for compactor in (Compactor(one), Compactor(short_term=short_term, episodic=log)):
            for step in steps:
                await compactor.append(THREAD, step)
            contexts.append(await compactor.context(THREAD))
    cached, uncached = contexts
    # Each result right after the call it answers, as providers require.
    assert [m.text for m in uncached] == [
        "read a.py",
        "",
        "contents of a.py",
        "and b.py too",
        "",
        "contents of b.py",
    ]
    assert cached == uncached
    assert not any(LATE_RESULT_METADATA_KEY in m.metadata for m in cached)


@pytest.mark.parametrize(
    "batch_head",
    [["y_result"], []],
    ids=["after-another-result", "alone"],
)
async def test_a_batch_that_reuses_an_open_call_id_sends_both_of_its_results_as_tool_results(
    tmp_path: Path, batch_head: list[str]
) -> None:
    """One append holds a reply reusing an open call's id and two results for that id: neither is late.

    The context holds calls ``x`` and ``y`` open. The batch answers ``y``, then
    a reply calls ``x`` again and two results for ``x`` follow: the first
    answers the batch's own call, the second the context's, which is still
    open. Both reach the context as tool results, with or without another
    result ahead of them in the batch, and with one store or two; the
    context's goes right after its call, as providers require.
    """
    x_first = ToolCall(id="x", name="read_file", arguments='{"path": "a.py"}')
    y = ToolCall(id="y", name="read_file", arguments='{"path": "c.py"}')
    x_again = ToolCall(id="x", name="read_file", arguments='{"path": "b.py"}')
    head = {"y_result": Message.tool("y", "contents of c.py")}
    batch = [
        *(head[name] for name in batch_head),
        Message.assistant(None, tool_calls=[x_again]),
        Message.tool("x", "contents of b.py"),
        Message.tool("x", "contents of a.py"),
    ]
    async with MemoryStore() as one, MemoryStore() as short_term, SQLiteStore(tmp_path / "log.db") as log:
        for compactor in (Compactor(one), Compactor(short_term=short_term, episodic=log)):
            await compactor.append(THREAD, [Message.user("read a.py and c.py")])
            await compactor.append(THREAD, [Message.assistant(None, tool_calls=[x_first, y])])
            await compactor.append(THREAD, batch)
            context = await compactor.context(THREAD)
            assert [m.text for m in context] == [
                "read a.py and c.py",
                "",
                *(m.text for m in batch[: len(batch_head)]),
                "contents of a.py",
                "",
                "contents of b.py",
            ]
            assert not any(LATE_RESULT_METADATA_KEY in m.metadata for m in context)


async def test_a_fold_before_any_append_loads_the_tokenizer_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compactor whose first call is a fold (rows written by another process) counts its summary off-loop.

    The blocking detector fails the test if the encoding's ranks are read on the event loop.
    """
    monkeypatch.setattr(tokens_module, "_LOADED", {})  # as in a new process: no encoding loaded yet
    async with MemoryStore() as store:
        await store.append(THREAD, [Message.user(f"question {n}") for n in range(6)], [3] * 6)
        compactor = Compactor(store, trigger=MessageCount(4), strategy=SlidingWindow(1))
        result = await compactor.maybe_compact(THREAD)
        assert result is not None and result.compacted
        context = await compactor.context(THREAD)
        assert context[0].is_summary and [m.text for m in context[1:]] == ["question 4", "question 5"]
        assert list(tokens_module._LOADED) == [("o200k_base", False)]


async def test_a_result_for_a_call_never_made_is_a_note_and_a_warning(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped call id: the model gets a note that says so, and the log a warning naming thread and id."""
    compactor = Compactor(store, options=RunOptions(max_history_tokens=8_000), counter=ApproximateCounter())
    made = ToolCall(id="call_1", name="lookup", arguments="{}")
    await compactor.append(THREAD, [Message.user("go"), Message.assistant(None, tool_calls=[made])])
    await compactor.append(THREAD, [Message.tool("call_l", "42")])
    note = (await compactor.context(THREAD))[-1]
    assert note.role.value == "user" and note.metadata[LATE_RESULT_METADATA_KEY] == "call_l"
    assert note.text.startswith("[a result arrived for tool call 'call_l', which is not open here")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(repr(THREAD) in w and "'call_l'" in w and "answers no call open" in w for w in warnings)


async def test_a_stall_of_a_trigger_other_than_tokens_names_that_trigger_not_the_budget(store: Any) -> None:
    """Unfinished turns fire where the protected turns are all there is: the stall says so.

    It said the turns were "all that is left over the 60000-token budget",
    of a context of 23 tokens, which sent a user to raise a budget that had
    nothing to do with it.
    """
    options = SummarizeOptions(
        trigger_token_budget=60_000, episodic=EpisodicCompactionConfig(trigger_unfinished_turns=3)
    )
    compactor = Compactor(
        store, options=options, summarizer=counting_summarizer(), counter=ApproximateCounter()
    )
    stalls = []
    for n in range(5):
        message = Message.user(f"question {n}") if n % 2 == 0 else Message.assistant(f"answer {n}")
        await compactor.append("t", [message])
        result = await compactor.maybe_compact("t")
        if result is not None and not result.compacted:
            stalls.append(result)
    stall = stalls[0]
    assert stall.reason == Reason.UNFINISHED_TURNS
    assert stall.detail == (
        "nothing can be folded: the unfinished_turns trigger fired, but the context past its pinned "
        f"head and summary is all protected recent turns (5 turns, about {stall.tokens_before} tokens of "
        f"the {stall.tokens_before}); lower min_recent_turns / min_recent_messages, raise that "
        "trigger's limit, or wait for a tool result"
    )
    assert len((await store.load("t")).plain) == 5  # nothing folded


async def test_a_window_that_keeps_more_than_its_trigger_allows_still_folds_amortized(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``TokenCount(1000)``, ``SlidingWindow(3)``, 400-token turns: the window alone is over the trigger.

    Each fold left 1,200 tokens, so every following check folded again: 26
    summaries in 30 steps, silently, where the preset refuses a target at its
    trigger when built. The next fold now waits for half the budget in new
    tokens, and the warning says why and what to change.
    """
    calls = 0

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        nonlocal calls
        calls += 1
        return "summary"

    compactor = Compactor(
        store,
        trigger=TokenCount(1000),
        strategy=SlidingWindow(3),
        summarizer=FunctionSummarizer(summarize),
        counter=ApproximateCounter(),
    )
    folds: list[CompactionResult] = []
    for n in range(30):
        await compactor.append("t", [Message.user(f"{n} " + "abc " * 399)])
        result = await compactor.maybe_compact("t")
        if result is not None and result.compacted:
            folds.append(result)
    assert len(folds) >= 5
    for before, after in itertools.pairwise(folds):
        assert after.tokens_before - before.tokens_after >= 500  # half the 1000-token budget, new
    assert calls == len(folds)
    warned = [r.getMessage() for r in caplog.records if "over the 1000-token trigger" in r.getMessage()]
    assert warned and "keep fewer turns or give the strategy a token target" in warned[0]
