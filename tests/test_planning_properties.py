"""Planning invariants over random conversations.

Conversations have pinned system heads, previous summaries, parallel tool
calls whose results arrive late, out of order and after other turns, results
with no call, calls never answered, and calls still pending at the tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from contextfold import (
    Message,
    ObservationMasking,
    Role,
    SlidingWindow,
    TokenBudget,
    TokenCount,
    ToolCall,
    TurnCount,
)
from contextfold.messages import MASKED_METADATA_KEY, SUMMARY_METADATA_KEY
from contextfold.planning import CompactionConfig, CompactionPlan, Strategy, Trigger, Unit, group_units

PROPERTY_SETTINGS = settings(max_examples=120, deadline=None)


@dataclass(frozen=True)
class Conversation:
    messages: list[Message]
    pinned: int
    has_summary: bool
    orphan_results: frozenset[str]
    unanswered: tuple[str, ...]
    """Calls never answered, in call order."""

    @property
    def body(self) -> list[Message]:
        return self.messages[self.pinned + self.has_summary :]


@st.composite
def conversations(draw: st.DrawFn) -> Conversation:
    messages = [Message.system(f"rule {n}") for n in range(draw(st.integers(0, 2)))]
    pinned = len(messages)
    has_summary = draw(st.booleans())
    if has_summary:
        role = draw(st.sampled_from([Role.USER, Role.SYSTEM, Role.ASSISTANT]))
        messages.append(Message(role=role, content="so far", metadata={SUMMARY_METADATA_KEY: True}))
    outstanding: list[str] = []
    orphans: set[str] = set()
    serial = 0
    actions = ["user", "text", "calls", "calls", "result", "result", "result", "orphan", "system"]
    for _ in range(draw(st.integers(0, 30))):
        serial += 1
        action = draw(st.sampled_from(actions))
        words = draw(st.text(alphabet="abc xyz", max_size=40))
        if action == "user":
            messages.append(Message.user(words))
        elif action == "text":
            messages.append(Message.assistant(words))
        elif action == "calls":
            ids = [f"call_{serial}_{n}" for n in range(draw(st.integers(1, 3)))]
            calls = [ToolCall(id=i, name="search", arguments=f'{{"q": "{words}"}}') for i in ids]
            messages.append(Message.assistant(draw(st.none() | st.just(words)), tool_calls=calls))
            outstanding.extend(ids)
        elif action == "result" and outstanding:
            call_id = outstanding.pop(draw(st.integers(0, len(outstanding) - 1)))
            messages.append(Message.tool(call_id, words))
        elif action == "orphan":
            orphans.add(f"ghost_{serial}")
            messages.append(Message.tool(f"ghost_{serial}", words))
        elif action == "system":
            messages.append(Message.system(f"note {words}"))
    while pinned < len(messages) and messages[pinned].role is Role.SYSTEM and not messages[pinned].is_summary:
        pinned += 1  # a "system" action right after the head extends the head
    return Conversation(messages, pinned, has_summary, frozenset(orphans), tuple(outstanding))


strategies_ = st.one_of(
    st.builds(SlidingWindow, st.integers(0, 6)),
    st.builds(TokenBudget, st.integers(1, 300), st.integers(0, 4)),
    st.builds(ObservationMasking, st.integers(0, 6)),
)
triggers = st.one_of(
    st.builds(TurnCount, st.integers(0, 8)),
    st.builds(TokenCount, st.integers(0, 400)),
    st.just(TurnCount(0) | TokenCount(0)),
)


@st.composite
def configs(draw: st.DrawFn, strategy: st.SearchStrategy[Strategy] = strategies_) -> CompactionConfig:
    return CompactionConfig(
        draw(triggers),
        draw(strategy),
        min_recent_turns=draw(st.integers(0, 3)),
        min_recent_messages=draw(st.integers(0, 4)),
    )


def tokens_for(messages: Sequence[Message]) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 60), min_size=len(messages), max_size=len(messages))


def call_ids(messages: Sequence[Message]) -> set[str]:
    return {call.id for m in messages for call in m.tool_calls}


def result_ids(messages: Sequence[Message]) -> set[str]:
    return {m.tool_call_id for m in messages if m.tool_call_id is not None}


def unit_of(units: Sequence[Unit]) -> list[int]:
    return [n for n, unit in enumerate(units) for _ in range(unit.start, unit.stop)]


def plan_for(conversation: Conversation, config: CompactionConfig, tokens: int) -> CompactionPlan:
    return config.plan(conversation.messages, tokens)


# grouping -------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(conversations())
def test_units_partition_the_body_and_keep_calls_with_their_results(conversation: Conversation) -> None:
    """Units tile the body in order, each result shares its call's unit, and only the tail may be pending."""
    body = conversation.body
    units, _ = group_units(body)
    assert [u.start for u in units] == [0, *(u.stop for u in units)][: len(units)]
    assert all(u.stop > u.start for u in units)
    assert (units[-1].stop if units else 0) == len(body)
    owner = unit_of(units)
    caller = {call.id: i for i, m in enumerate(body) for call in m.tool_calls}
    for index, message in enumerate(body):
        if message.tool_call_id in caller:
            assert owner[index] == owner[caller[message.tool_call_id]]
    for unit in units:
        assert len(unit) == 1 or unit.kind == "assistant"
    waiting = set(conversation.unanswered)
    for unit in units:
        assert unit.pending == bool(call_ids(body[unit.start : unit.stop]) & waiting)


@PROPERTY_SETTINGS
@given(conversations())
def test_orphans_are_reported_not_raised(conversation: Conversation) -> None:
    """Results without a call are reported as orphans; unanswered calls are pending, not orphans."""
    _, orphans = group_units(conversation.body)
    reported_results = {o.tool_call_id for o in orphans if o.problem == "result_without_call"}
    assert reported_results == set(conversation.orphan_results)
    plan = CompactionConfig(TurnCount(0), SlidingWindow(1)).plan(conversation.messages)
    assert set(plan.orphans) == set(orphans)


# plans ------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(conversations(), configs(st.one_of(strategies_.filter(lambda s: not s.masks))), st.integers(0, 2000))
def test_a_cut_keeps_a_suffix_and_never_parts_a_call_from_its_result(
    conversation: Conversation, config: CompactionConfig, tokens: int
) -> None:
    """dropped + kept is the body in order; no kept result lost its call, no kept call lost its result."""
    plan = plan_for(conversation, config, tokens)
    body = conversation.body
    assert list(plan.dropped) + list(plan.kept) == body
    assert len(plan.kept) + len(plan.dropped) == len(body) == plan.total
    units, _ = group_units(body)
    assert plan.kept_turns + plan.dropped_turns == len(units)

    dropped_calls, kept_calls = call_ids(plan.dropped), call_ids(plan.kept)
    kept_results = result_ids(plan.kept)
    assert not dropped_calls & kept_results, "a kept result whose call was dropped"
    assert not (kept_calls & result_ids(plan.dropped)), "a kept call whose result was dropped"
    new_orphans = {o.tool_call_id for o in group_units(plan.kept)[1] if o.problem == "result_without_call"}
    assert new_orphans <= set(conversation.orphan_results)


@PROPERTY_SETTINGS
@given(conversations(), configs(), st.integers(0, 2000))
def test_the_pinned_head_previous_summary_and_floor_survive(
    conversation: Conversation, config: CompactionConfig, tokens: int
) -> None:
    """The pinned head and previous summary are never dropped; the newest min_recent_turns units stay."""
    plan = plan_for(conversation, config, tokens)
    assert list(plan.pinned) == conversation.messages[: conversation.pinned]
    if conversation.has_summary:
        assert plan.previous_summary == conversation.messages[conversation.pinned]
    else:
        assert plan.previous_summary is None
    body = conversation.body
    units, _ = group_units(body)
    floor = min(config.min_recent_turns, len(units))
    protected = len(body) - units[-floor].start if floor else 0
    assert len(plan.kept) >= protected
    assert list(plan.kept[len(plan.kept) - protected :]) == body[len(body) - protected :]
    assert len(plan.kept) >= min(config.min_recent_messages, len(body))
    assert plan.kept_turns >= floor


@PROPERTY_SETTINGS
@given(conversations())
def test_a_pending_unit_anywhere_is_kept_with_everything_after_it(conversation: Conversation) -> None:
    """Keeping nothing on purpose still keeps the first pending unit and all after it, and drops the rest."""
    body = conversation.body
    units, _ = group_units(body)
    plan = CompactionConfig(TurnCount(0), SlidingWindow(0), min_recent_turns=0).plan(conversation.messages)
    first = next((n for n, unit in enumerate(units) if unit.pending), None)
    if first is not None:
        assert list(plan.kept) == body[units[first].start :]
        assert list(plan.dropped) == body[: units[first].start]
        assert plan.kept_turns == len(units) - first
    elif len(units) > 0:
        assert plan.kept == ()
        assert list(plan.dropped) == body


@PROPERTY_SETTINGS
@given(conversations(), configs())
def test_nothing_changes_when_the_trigger_does_not_fire(
    conversation: Conversation, config: CompactionConfig
) -> None:
    """Under a trigger that cannot fire the plan keeps every message and masks nothing."""
    quiet = CompactionConfig(
        TurnCount(10_000), config.strategy, config.min_recent_turns, config.min_recent_messages
    )
    plan = quiet.plan(conversation.messages, 10**9)
    assert plan.reason is None
    assert list(plan.kept) == conversation.body
    assert plan.dropped == ()
    assert not plan.compacts


@PROPERTY_SETTINGS
@given(st.data(), conversations(), st.integers(1, 300), st.integers(0, 4), st.integers(0, 3))
def test_token_budget_keeps_exactly_the_newest_units_that_fit(
    data: st.DataObject, conversation: Conversation, budget: int, keep: int, floor: int
) -> None:
    """TokenBudget keeps the newest units that fit with the head and summary, never fewer than its minimum."""
    counts = data.draw(tokens_for(conversation.messages))
    config = CompactionConfig(TokenCount(0), TokenBudget(budget, keep), min_recent_turns=floor)
    plan = config.plan(conversation.messages, 1, message_tokens=counts)
    head = conversation.pinned + conversation.has_summary
    body_counts = counts[head:]
    budget -= sum(counts[:head])  # the pinned head and the summary count against the budget
    units, _ = group_units(conversation.body)
    unit_tokens = [sum(body_counts[u.start : u.stop]) for u in units]
    first_pending = next((n for n, u in enumerate(units) if u.pending), len(units))
    minimum = min(max(keep, floor, len(units) - first_pending), len(units))
    kept = plan.kept_turns
    assert kept >= minimum
    kept_tokens = sum(unit_tokens[len(units) - kept :])
    if kept > minimum:
        assert kept_tokens <= budget
    if kept < len(units) and kept >= minimum:
        assert kept_tokens + unit_tokens[len(units) - kept - 1] > budget


@PROPERTY_SETTINGS
@given(
    conversations(),
    configs(
        st.builds(ObservationMasking, st.integers(0, 6), st.sampled_from(["[masked]", "<{tool_call_id}>"]))
    ),
)
def test_observation_masking_keeps_structure_and_masks_only_old_tool_outputs(
    conversation: Conversation, config: CompactionConfig
) -> None:
    """Masking keeps roles, calls and call ids; it masks exactly the old outputs longer than a placeholder."""
    plan = config.plan(conversation.messages, 10**6)
    body = conversation.body
    assert plan.dropped == ()
    assert len(plan.kept) == len(body)
    changed = 0
    for before, after in zip(body, plan.kept, strict=True):
        assert (after.role, after.tool_calls, after.tool_call_id, after.name) == (
            before.role,
            before.tool_calls,
            before.tool_call_id,
            before.name,
        )
        if after != before:
            changed += 1
            assert before.role is Role.TOOL
            assert after.metadata[MASKED_METADATA_KEY] is True
    assert changed == plan.masked
    units, _ = group_units(body)
    if units and plan.reason is not None:
        assert isinstance(config.strategy, ObservationMasking)
        assert config.strategies == (config.strategy,)
        first_pending = next((n for n, u in enumerate(units) if u.pending), len(units))
        floor = min(max(config.strategy.keep_recent_turns, config.min_recent_turns), len(units))
        floor = max(floor, len(units) - first_pending)
        untouched = units[-floor].start if floor else len(body)
        assert list(plan.kept[untouched:]) == body[untouched:]
        placeholder = config.strategy.placeholder
        masked_region = [
            m
            for m in body[:untouched]
            if m.role is Role.TOOL
            and len(m.text) > len(placeholder.format(tool_call_id=m.tool_call_id, tokens=0))
        ]
        if config.min_recent_messages == 0:
            assert plan.masked == len(masked_region)


@PROPERTY_SETTINGS
@given(conversations(), configs(), st.integers(0, 2000))
def test_turn_pressure_is_the_number_of_units(
    conversation: Conversation, config: CompactionConfig, tokens: int
) -> None:
    """TurnCount counts the body's units as turns: it fires exactly when there are more than its limit."""
    units, _ = group_units(conversation.body)
    for limit in (len(units) - 1, len(units)):
        if limit < 0:
            continue
        trigger: Trigger = TurnCount(limit)
        plan = CompactionConfig(trigger, config.strategy).plan(conversation.messages, tokens)
        assert (plan.reason == "turn_count") is (len(units) > limit)


pipelines = st.builds(
    lambda masking, budget: [masking, budget],
    st.builds(
        ObservationMasking,
        st.integers(0, 4),
        st.sampled_from(["[m]", "<{tool_call_id}>"]),
        clear_arguments=st.booleans(),
    ),
    st.builds(TokenBudget, st.integers(1, 300), st.integers(0, 3)),
)


@PROPERTY_SETTINGS
@given(conversations(), configs(pipelines), st.integers(0, 2000))
def test_a_mask_then_budget_pipeline_drops_originals_and_masks_only_what_stays(
    conversation: Conversation, config: CompactionConfig, tokens: int
) -> None:
    """Masking before a cut never reaches the dropped part; only kept outputs are masked and counted."""
    plan = plan_for(conversation, config, tokens)
    body = conversation.body
    assert list(plan.pinned) == conversation.messages[: conversation.pinned]
    assert len(plan.dropped) + len(plan.kept) == len(body) == plan.total
    assert list(plan.dropped) == body[: len(plan.dropped)], "the summarizer must get the originals"
    kept_originals = body[len(plan.dropped) :]
    masked = 0
    for before, after in zip(kept_originals, plan.kept, strict=True):
        assert (after.role, after.tool_call_id) == (before.role, before.tool_call_id)
        assert [c.id for c in after.tool_calls] == [c.id for c in before.tool_calls]
        if after.metadata.get(MASKED_METADATA_KEY) and not before.metadata.get(MASKED_METADATA_KEY):
            assert before.role is Role.TOOL and after.content != before.content
            masked += 1
    assert plan.masked == masked
    assert not call_ids(plan.dropped) & result_ids(plan.kept), "a kept result whose call was dropped"
    assert not call_ids(plan.kept) & result_ids(plan.dropped), "a kept call whose result was dropped"
