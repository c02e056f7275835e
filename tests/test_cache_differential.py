"""One ``Store`` (the compactor keeps a cached context) against two stores (no cache), step by step.

Random histories with parallel tool calls answered late and out of order,
ids reused while their first call is still open, calls never answered (and
then abandoned), results arriving after their call was abandoned, and folds:
after every step the compactor on one store and the compactor on two stores
send the same context, fold at the same steps, and a new compactor reading
the one store cold sends it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import MemoryStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import ApproximateCounter

OPTIONS = RunOptions(
    max_history_tokens=6_000,
    compaction=SummarizeOptions(
        trigger_token_budget=1_500, min_recent_messages=0, abandon_after_turns=4, max_summary_tokens=100
    ),
)

Action = tuple[str, int, int]


async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
    return f"{(previous or '')[:100]} +{len(messages)} messages"


def compactor(*stores: MemoryStore) -> Compactor:
    summarizer = FunctionSummarizer(summarize)
    counter = ApproximateCounter()
    if len(stores) == 1:
        return Compactor(stores[0], options=OPTIONS, summarizer=summarizer, counter=counter)
    short_term, episodic = stores
    return Compactor(
        short_term=short_term, episodic=episodic, options=OPTIONS, summarizer=summarizer, counter=counter
    )


async def drive(actions: list[Action]) -> None:
    async with MemoryStore() as one, MemoryStore() as short_term, MemoryStore() as episodic:
        cached, uncached = compactor(one), compactor(short_term, episodic)
        outstanding: list[str] = []  # ids called and not yet answered here (abandoned ones too)
        for serial, (kind, size, pick) in enumerate(actions):
            if kind == "user":
                step = [Message.user("word " * size)]
            elif kind == "calls":
                ids = [f"c{serial}_{n}" for n in range(1 + pick % 3)]
                if outstanding and pick % 4 == 0:  # a provider that numbers calls per reply
                    ids[0] = outstanding[pick % len(outstanding)]
                step = [
                    Message.assistant(
                        None, tool_calls=[ToolCall(id=i, name="tool", arguments="{}") for i in ids]
                    )
                ]
                outstanding.extend(ids)
            elif outstanding:
                step = [Message.tool(outstanding.pop(pick % len(outstanding)), "line " * size)]
            else:
                continue
            for c in (cached, uncached):
                await c.append("t", step)
            results = [await c.maybe_compact("t") for c in (cached, uncached)]
            folded = [r is not None and r.compacted for r in results]
            assert folded[0] == folded[1], (serial, results)
            sent = await cached.context("t")
            assert sent == await uncached.context("t"), serial
            assert sent == await compactor(one).context("t"), serial


actions = st.lists(
    st.tuples(
        st.sampled_from(["user", "calls", "result", "result"]), st.integers(1, 200), st.integers(0, 50)
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions)
def test_one_store_and_two_stores_send_the_same_context_after_every_step(steps: list[Action]) -> None:
    """The cached context never differs from the one read without a cache, folds included."""
    anyio.run(drive, steps)
