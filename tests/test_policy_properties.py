"""Runtime invariants of folding, over random histories driven through a real Compactor.

Histories have pinned system prompts of random size, parallel tool calls
answered late and out of order, calls that are never answered (and get
abandoned), and other writers appending while calls are pending.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold._strategies import group_units, split_head
from contextfold.stores import MemoryStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import ApproximateCounter

BUDGET = 3_000
TARGET = BUDGET // 2
MIN_RECENT_TURNS = 2

Action = tuple[str, int, int]


def no_orphan(context: Sequence[Message]) -> None:
    open_calls: dict[str, int] = {}
    for message in context:
        for call in message.tool_calls:
            open_calls[call.id] = open_calls.get(call.id, 0) + 1
        if message.tool_call_id is not None:
            assert open_calls.get(message.tool_call_id, 0) > 0, f"orphaned result {message.tool_call_id}"
            open_calls[message.tool_call_id] -= 1


def protected_units(body: Sequence[Message]) -> int:
    units, _ = group_units(body)
    first_pending = next((n for n, u in enumerate(units) if u.pending), len(units))
    return min(len(units), max(MIN_RECENT_TURNS, len(units) - first_pending))


async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
    return f"{(previous or '')[:200]} +{len(messages)} messages"


async def drive(pinned_words: int, actions: list[Action]) -> None:
    options = RunOptions(
        max_history_tokens=BUDGET * 4,
        compaction=SummarizeOptions(
            trigger_token_budget=BUDGET, min_recent_messages=0, abandon_after_turns=6, max_summary_tokens=200
        ),
    )
    counter = ApproximateCounter()
    async with MemoryStore() as store:
        compactor = Compactor(
            store, options=options, summarizer=FunctionSummarizer(summarize), counter=counter
        )
        if pinned_words:
            await compactor.append("t", [Message.system("rule " * pinned_words)])
        outstanding: list[str] = []
        serial = 0
        for kind, size, pick in actions:
            serial += 1
            if kind == "user":
                await compactor.append("t", [Message.user("word " * size)])
            elif kind == "calls":
                calls = [
                    ToolCall(id=f"c{serial}_{n}", name="tool", arguments="{}") for n in range(1 + pick % 3)
                ]
                await compactor.append("t", [Message.assistant(None, tool_calls=calls)])
                outstanding.extend(c.id for c in calls)
            elif kind == "result" and outstanding:
                call_id = outstanding.pop(pick % len(outstanding))
                await compactor.append("t", [Message.tool(call_id, "line " * size)])
            result = await compactor.maybe_compact("t")
            context, tokens = await compactor.context_tokens("t")
            no_orphan(context)
            if result is not None and result.compacted:
                pinned, summary = split_head(context)
                body = context[pinned + (summary is not None) :]
                if tokens > TARGET:
                    # Over the target only when what is left is all protected: the floor or a pending step.
                    units, _ = group_units(body)
                    assert len(units) <= protected_units(body), (tokens, len(units))


actions = st.lists(
    st.tuples(
        st.sampled_from(["user", "calls", "result", "result"]), st.integers(1, 300), st.integers(0, 50)
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 900), actions)
def test_no_orphan_and_no_context_over_the_target_after_any_fold(
    pinned_words: int, steps: list[Action]
) -> None:
    """After any fold no result lacks its call; the request is in target unless it is all protected."""
    anyio.run(drive, pinned_words, steps)
