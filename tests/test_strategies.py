"""Planning: atomic units, strategies, floors and the pinned head, starting from the seed's tests.

The seed's ``AgentStep`` (an action and its observation) is one atomic unit
here: an assistant message with one tool call, followed by its tool result.
"""

from __future__ import annotations

import json

import pytest

from contextfold import (
    ConfigError,
    Message,
    ObservationMasking,
    SlidingWindow,
    TokenBudget,
    TokenCount,
    ToolCall,
    TurnCount,
)
from contextfold.messages import MASKED_METADATA_KEY, SUMMARY_METADATA_KEY
from contextfold.planning import CompactionConfig, CompactionPlan, Orphan, Unit, group_units, split_head
from contextfold.tokens import ApproximateCounter


def step(name: str, observation_len: int) -> list[Message]:
    """The seed's ``step(name, observation_len)``: a tool call with input "input" and its observation."""
    call = ToolCall(id=f"call_{name}", name=name, arguments=json.dumps("input"))
    return [Message.assistant(None, tool_calls=[call]), Message.tool(call.id, "x" * observation_len)]


def steps(count: int, observation_len: int) -> list[Message]:
    return [m for i in range(count) for m in step(f"t{i}", observation_len)]


def kept_tools(plan: CompactionPlan) -> list[str]:
    return [m.tool_calls[0].name for m in plan.kept if m.tool_calls]


def estimate_step_tokens(messages: list[Message]) -> int:
    counter = ApproximateCounter()
    return sum(counter.count(m) for m in messages)


# lc_agents compaction.rs strategies -------------------------------------------------


def test_sliding_window_keeps_recent_suffix() -> None:
    """SlidingWindow(2) over five steps keeps the newest two, in order, and drops three."""
    config = CompactionConfig(TurnCount(2), SlidingWindow(keep_recent_turns=2)).with_min_recent_turns(1)
    plan = config.plan(steps(5, 10), 0)
    assert plan.dropped_turns == 3
    assert plan.kept_turns == 2
    assert kept_tools(plan) == ["t3", "t4"]


def test_no_compaction_below_trigger() -> None:
    """Below the trigger the plan is a no-op: every step kept, none dropped."""
    config = CompactionConfig(TurnCount(10), SlidingWindow(keep_recent_turns=2))
    history = steps(5, 10)
    plan = config.plan(history, 0)
    assert plan.dropped_turns == 0
    assert plan.kept_turns == 5
    assert plan.kept == tuple(history)
    assert plan.dropped == ()
    assert plan.reason is None
    assert not plan.compacts


def test_min_recent_turns_floor() -> None:
    """The floor of two steps wins over a strategy that would keep none."""
    config = CompactionConfig(TurnCount(1), SlidingWindow(keep_recent_turns=0)).with_min_recent_turns(2)
    plan = config.plan(steps(6, 10), 0)
    assert plan.kept_turns == 2
    assert plan.dropped_turns == 4
    assert kept_tools(plan)[1] == "t5"


def test_token_budget_drops_oldest_until_fit() -> None:
    """TokenBudget(150) drops the oldest ~101-token steps until the rest fit or only the floor is left."""
    config = CompactionConfig(TokenCount(150), TokenBudget(max_tokens=150, keep_recent_turns=1))
    config = config.with_min_recent_turns(1)
    history = steps(5, 400)
    total = sum(estimate_step_tokens(history[i : i + 2]) for i in range(0, len(history), 2))
    assert total > 150, "precondition: history over budget"

    plan = config.plan(history, total)
    assert plan.dropped_turns >= 1, "over budget -> drop"
    kept_tokens = estimate_step_tokens(list(plan.kept))
    assert kept_tokens <= 150 or plan.kept_turns <= 1, (plan.kept_turns, plan.dropped_turns, kept_tokens)


def test_token_budget_respects_keep_floor() -> None:
    """TokenBudget keeps keep_recent_turns steps even when each step alone busts the budget."""
    config = CompactionConfig(TokenCount(10), TokenBudget(max_tokens=10, keep_recent_turns=2))
    config = config.with_min_recent_turns(1)
    plan = config.plan(steps(4, 400), 500)
    assert plan.kept_turns == 2, "keep floor wins over the budget"
    assert kept_tools(plan)[0] == "t2"


def test_compaction_never_orphans_tool_results() -> None:
    """A cut keeps every kept action paired with its non-empty observation, and counts add up."""
    config = CompactionConfig(TurnCount(0), SlidingWindow(keep_recent_turns=3))
    history = steps(8, 50)
    plan = config.plan(history, 0)
    assert plan.kept_turns + plan.dropped_turns == 8
    assert len(plan.kept) + len(plan.dropped) == len(history)
    calls = {c.id for m in plan.kept for c in m.tool_calls}
    results = [m for m in plan.kept if m.role == "tool"]
    assert {m.tool_call_id for m in results} == calls
    assert all(m.content for m in results)


def test_estimate_scales_with_content() -> None:
    """The ~4-bytes-per-token estimate of a step grows with its observation."""
    assert estimate_step_tokens(step("tool", 400)) > estimate_step_tokens(step("tool", 40))


# atomic units ---------------------------------------------------------------------


def call(call_id: str, name: str = "f") -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments="{}")


def test_parallel_calls_and_their_results_form_one_unit() -> None:
    """An assistant message with two calls and both results, in any order, is one unit."""
    body = [
        Message.user("go"),
        Message.assistant(None, tool_calls=[call("a"), call("b")]),
        Message.tool("b", "B"),
        Message.tool("a", "A"),
        Message.user("next"),
    ]
    units, orphans = group_units(body)
    assert units == [Unit("user", 0, 1), Unit("assistant", 1, 4), Unit("user", 4, 5)]
    assert orphans == []


def test_a_unit_spans_messages_interleaved_before_a_late_result() -> None:
    """A user message between a call and its late result is absorbed into the call's unit."""
    body = [
        Message.assistant(None, tool_calls=[call("a")]),
        Message.user("meanwhile"),
        Message.assistant(None, tool_calls=[call("b")]),
        Message.tool("a", "A"),
        Message.tool("b", "B"),
    ]
    units, _ = group_units(body)
    assert units == [Unit("assistant", 0, 5)]


def test_a_tail_unit_waiting_for_results_is_pending() -> None:
    """An assistant step at the tail with an unanswered call is pending, not an orphan."""
    body = [
        Message.user("go"),
        Message.assistant(None, tool_calls=[call("a"), call("b")]),
        Message.tool("a", "A"),
    ]
    units, orphans = group_units(body)
    assert units[-1] == Unit("assistant", 1, 3, pending=True)
    assert orphans == []


def test_results_without_calls_are_reported_and_unanswered_calls_are_pending_anywhere() -> None:
    """A result with no call is an orphan; a call not yet answered is pending even with turns after it."""
    body = [
        Message.tool("ghost", "?"),
        Message.assistant(None, tool_calls=[call("a")]),
        Message.user("never mind"),
    ]
    units, orphans = group_units(body)
    assert [u.kind for u in units] == ["tool", "assistant", "user"]
    assert [u.pending for u in units] == [False, True, False]
    assert orphans == [Orphan(0, "ghost", "result_without_call")]


def test_split_head_pins_leading_system_messages_and_finds_the_previous_summary() -> None:
    """Leading system messages are pinned; a summary right after them is the previous summary."""
    summary = Message.user("earlier", metadata={SUMMARY_METADATA_KEY: True})
    messages = [Message.system("a"), Message.system("b"), summary, Message.user("hi")]
    assert split_head(messages) == (2, summary)
    assert split_head([Message.user("hi")]) == (0, None)
    assert split_head([summary, Message.user("hi")]) == (0, summary)


# plans ----------------------------------------------------------------------------


def conversation(turns: int) -> list[Message]:
    out: list[Message] = []
    for i in range(turns):
        out.append(Message.user(f"question {i}"))
        out.extend(step(f"t{i}", 40))
        out.append(Message.assistant(f"answer {i}"))
    return out


def test_plan_keeps_the_pinned_head_and_previous_summary_out_of_the_cut() -> None:
    """The system prompt and previous summary are neither dropped nor counted as turns."""
    summary = Message.system("so far", metadata={SUMMARY_METADATA_KEY: True})
    head = [Message.system("you are helpful"), summary]
    body = conversation(4)
    plan = CompactionConfig(TurnCount(3), SlidingWindow(2), min_recent_turns=0).plan(head + body)
    assert plan.pinned == (head[0],)
    assert plan.previous_summary == summary
    assert plan.reason == "turn_count"
    assert plan.dropped + plan.kept == tuple(body)
    assert plan.kept == tuple(body[-3:])  # the last tool step (2 messages) and the answer
    assert plan.kept_turns == 2
    assert plan.dropped_turns == 10


def test_a_pending_tail_is_kept_without_blocking_older_cuts() -> None:
    """With SlidingWindow(0) and no floor the pending tail stays and everything older goes."""
    body = [*conversation(2), Message.assistant(None, tool_calls=[call("late")])]
    plan = CompactionConfig(TurnCount(0), SlidingWindow(0), min_recent_turns=0).plan(body)
    assert plan.kept == (body[-1],)
    assert plan.dropped == tuple(body[:-1])


def test_keeping_no_turns_drops_the_whole_body_but_not_the_head() -> None:
    """SlidingWindow(0) with no floor drops every unit of the body and keeps the pinned head."""
    head = Message.system("rules")
    body = conversation(2)
    plan = CompactionConfig(TurnCount(0), SlidingWindow(0), min_recent_turns=0).plan([head, *body])
    assert plan.kept == ()
    assert plan.dropped == tuple(body)
    assert plan.pinned == (head,)
    assert (plan.kept_turns, plan.dropped_turns) == (0, 6)


def test_min_recent_messages_keeps_whole_units_covering_that_many_messages() -> None:
    """A floor of three messages keeps the two newest units when they hold one and two messages."""
    body = conversation(3)
    config = CompactionConfig(TurnCount(0), SlidingWindow(0), min_recent_turns=0, min_recent_messages=3)
    plan = config.plan(body)
    assert plan.kept == tuple(body[-3:])  # the tool step (2 messages) and the answer (1)


def test_forced_plans_skip_the_trigger() -> None:
    """force_reason plans a cut even when the trigger would not fire, and names that reason."""
    plan = CompactionConfig(TurnCount(1000), SlidingWindow(1), min_recent_turns=0).plan(
        conversation(2), force_reason="manual_recovery"
    )
    assert plan.reason == "manual_recovery"
    assert plan.kept_turns == 1


def test_message_tokens_replace_the_estimate() -> None:
    """Given per-message token counts, TokenBudget keeps exactly the newest units that fit."""
    body = [Message.user(str(i)) for i in range(5)]
    config = CompactionConfig(TokenCount(1), TokenBudget(25), min_recent_turns=0)
    plan = config.plan(body, 50, message_tokens=[10] * 5)
    assert plan.kept == tuple(body[-2:])
    with pytest.raises(ConfigError) as info:
        config.plan(body, 50, message_tokens=[10] * 4)
    assert info.value.key == "message_tokens"


def test_observation_masking_replaces_only_old_tool_outputs() -> None:
    """ObservationMasking keeps every message, masking tool outputs older than the newest turns."""
    body = conversation(3)
    config = CompactionConfig(TurnCount(0), ObservationMasking(2, "[{tool_call_id}: {tokens} tokens]"))
    plan = config.plan(body)
    assert plan.dropped == ()
    assert len(plan.kept) == len(body)
    assert plan.masked == 2
    for before, after in zip(body, plan.kept, strict=True):
        assert (after.role, after.tool_calls, after.tool_call_id) == (
            before.role,
            before.tool_calls,
            before.tool_call_id,
        )
    masked = [m for m in plan.kept if m.metadata.get(MASKED_METADATA_KEY)]
    assert [m.content for m in masked] == ["[call_t0: 10 tokens]", "[call_t1: 10 tokens]"]
    assert plan.kept[-2].content == "x" * 40  # the newest tool output is untouched
    again = config.plan(list(plan.kept))
    assert again.masked == 0 and not again.compacts


def test_observation_masking_leaves_outputs_no_longer_than_the_placeholder() -> None:
    """A tool output shorter than its placeholder stays as it is, since masking it would cost more."""
    body = [Message.user("time?"), *step("clock", 0), Message.user("weather?"), *step("sky", 0)]
    short, long = Message.tool("call_clock", "12:00"), Message.tool("call_sky", "cloudy " * 20)
    body[2], body[5] = short, long
    plan = CompactionConfig(
        TurnCount(0), ObservationMasking(0, "[elided {tokens}]"), min_recent_turns=0
    ).plan(body)
    assert plan.masked == 1
    assert plan.kept[2] == short
    assert plan.kept[5].content == f"[elided {ApproximateCounter().count(long)}]"


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: ObservationMasking(1, 5), "ObservationMasking.placeholder"),  # type: ignore[arg-type]
        (lambda: ObservationMasking(1, "{tokens.real}"), "ObservationMasking.placeholder"),
        (lambda: ObservationMasking(1, "{tool_call_id[0]}"), "ObservationMasking.placeholder"),
        (lambda: ObservationMasking(1, "{}"), "ObservationMasking.placeholder"),
        (lambda: ObservationMasking(1, "{tokens!z}"), "ObservationMasking.placeholder"),
        (lambda: ObservationMasking(1, "{tokens"), "ObservationMasking.placeholder"),
        (lambda: SlidingWindow(-1), "SlidingWindow.keep_recent_turns"),
        (lambda: TokenBudget(-1), "TokenBudget.max_tokens"),
        (lambda: TokenBudget(10, keep_recent_turns=-2), "TokenBudget.keep_recent_turns"),
        (lambda: ObservationMasking(-1), "ObservationMasking.keep_recent_turns"),
        (lambda: ObservationMasking(1, "{call_id}"), "ObservationMasking.placeholder"),
        (lambda: CompactionConfig(TurnCount(1), SlidingWindow(1), min_recent_turns=-1), "min_recent_turns"),
        (lambda: CompactionConfig("turns", SlidingWindow(1)), "trigger"),  # type: ignore[arg-type]
        (lambda: CompactionConfig(TurnCount(1), 3), "strategy"),  # type: ignore[arg-type]
    ],
)
def test_bad_strategy_settings_are_config_errors(build: object, key: str) -> None:
    """Negative counts, unknown placeholder fields and wrong types name their key."""
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert info.value.key == key


@pytest.mark.parametrize(
    ("strategy", "named"),
    [
        ("drop", "strategy='drop'"),
        (["drop"], "strategy[0]='drop'"),
        ((SlidingWindow(1), "mask"), "strategy[1]='mask'"),
        (b"drop", "strategy=b'drop'"),
    ],
)
def test_a_strategy_that_is_no_strategy_is_named_whole_and_by_its_position_in_a_list(
    strategy: object, named: str
) -> None:
    """``strategy="drop"`` was walked letter by letter (``strategy[0]='d'``); ``["drop"]`` lost its index."""
    with pytest.raises(ConfigError) as info:
        CompactionConfig(TurnCount(1), strategy)  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{named}: must be a Strategy such as SlidingWindow(8)")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: TokenBudget(-1),
            "TokenBudget.max_tokens=-1: must be a whole number >= 1, for example TokenBudget(4000)",
        ),
        (
            lambda: SlidingWindow(-2),
            "SlidingWindow.keep_recent_turns=-2: must be a whole number >= 0, for example SlidingWindow(8)",
        ),
        (
            lambda: CompactionConfig(TurnCount(1), SlidingWindow(1), keep_first=-1),
            "keep_first=-1: must be a whole number >= 0, for example 0 (the default), or 1 to pin the task",
        ),
    ],
    ids=["token-budget", "sliding-window", "keep-first"],
)
def test_a_negative_count_names_a_value_that_works(build: object, message: str) -> None:
    """A strategy's or planner's negative count says a value that would be accepted."""
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert str(info.value) == message


def test_mask_then_summarize_drops_the_original_outputs_and_counts_only_masks_that_stay() -> None:
    """When masking is not enough, the dropped part holds the tool outputs as they were, for the summary."""
    body = [
        m
        for n in range(6)
        for m in (
            Message.user(f"question {n} " + "word " * 20),
            Message.assistant(None, tool_calls=[ToolCall(id=f"c{n}", name="search", arguments="{}")]),
            Message.tool(f"c{n}", f"FACT-{n} " + "res " * 40),
        )
    ]
    config = CompactionConfig(
        TokenCount(100), [ObservationMasking(2, "[masked]"), TokenBudget(120)], min_recent_turns=0
    )
    plan = config.plan(body, 10_000)
    assert plan.dropped and plan.kept
    assert list(plan.dropped) == body[: len(plan.dropped)]
    assert [m.text for m in plan.dropped if m.tool_call_id] == [
        body[i].text for i in range(len(plan.dropped)) if body[i].tool_call_id
    ]
    assert all(m.text.startswith("FACT-") for m in plan.dropped if m.tool_call_id)
    masked = [m for m in plan.kept if m.metadata.get(MASKED_METADATA_KEY)]
    assert masked and all(m.text == "[masked]" for m in masked)
    assert plan.masked == len(masked)
    assert len(plan.dropped) + len(plan.kept) == len(body)


def test_masking_sizes_a_part_holding_a_uuid_or_a_datetime_by_the_json_a_store_keeps() -> None:
    """The pure planner takes the messages as given: such a part raised ``TypeError`` when sized."""
    import uuid
    from datetime import UTC, datetime

    result = Message.tool(
        "c1",
        [
            {
                "type": "custom",
                "id": uuid.UUID(int=7),
                "at": datetime(2026, 1, 1, tzinfo=UTC),
                "rows": "r" * 400,
            }
        ],
    )
    masked = ObservationMasking(0).mask(result, 120, "lookup")
    assert masked is not None and masked.text == "[tool output elided by contextfold: 120 tokens]"
    tiny = Message.tool("c2", [{"type": "custom", "id": uuid.UUID(int=7)}])
    assert ObservationMasking(0, placeholder="x" * 80).mask(tiny, 5) is None  # no shorter: kept
