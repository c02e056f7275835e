"""CompactionMiddleware's per-step cost does not grow with the conversation: counted, not timed."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from contextfold import Compactor, Message, RunOptions, SummarizeOptions

from .scenario import CountingStore

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.checkpoint.memory import InMemorySaver

from contextfold.integrations import langchain as module
from contextfold.integrations.langchain import CompactionMiddleware

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
CONFIG: Any = {"configurable": {"thread_id": "t"}}
TURNS = 30


class Echo(GenericFakeChatModel):
    """Answers each request after its last message."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        reply = AIMessage(f"answer to {messages[-1].text}", id=f"ai-{len(messages)}")
        return ChatResult(generations=[ChatGeneration(message=reply)])


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the middleware converts a message and compares one with the working context."""
    counts: Counter[str] = Counter()
    convert, same = module.from_langchain, module.alike

    def counted_convert(message: BaseMessage) -> Message:
        counts["from_langchain"] += 1
        return convert(message)

    def counted_same(first: Message, second: Message) -> bool:
        counts["_same"] += 1
        return same(first, second)

    monkeypatch.setattr(module, "from_langchain", counted_convert)
    monkeypatch.setattr(module, "alike", counted_same)
    return counts


async def test_a_step_reads_the_store_as_often_at_turn_30_as_at_turn_2(work: Counter[str]) -> None:
    """A model call whose state only added messages reads nothing more and converts only what is new."""
    async with CountingStore() as store:
        middleware = CompactionMiddleware(Compactor(store, options=NEVER_FOLDS), thread="t")
        messages: list[BaseMessage] = []
        per_step: list[tuple[dict[str, int], dict[str, int]]] = []
        for n in range(TURNS):
            messages.append(HumanMessage(f"question {n}", id=f"h{n}"))
            store.reads.clear()
            work.clear()
            await middleware.abefore_model({"messages": list(messages)}, None)  # type: ignore[arg-type]
            per_step.append((dict(store.reads), dict(work)))
            messages.append(AIMessage(f"answer {n}", id=f"a{n}"))
        # The first step reads the context to compare the state with; after it, an answer and a question.
        assert per_step[1:] == [({"replay": 2}, {"from_langchain": 2})] * (TURNS - 1)


async def test_a_new_run_of_a_checkpointed_agent_reads_no_more_than_the_one_before(
    work: Counter[str],
) -> None:
    """The state a checkpointer loads for the next run equals the one the last run left: no edit to seek."""
    async with CountingStore() as store:
        model = Echo(messages=iter(()))
        graph = create_agent(
            model,
            [],
            middleware=[CompactionMiddleware(Compactor(store, options=NEVER_FOLDS))],
            checkpointer=InMemorySaver(),
        )
        per_run: list[tuple[dict[str, int], dict[str, int]]] = []
        for n in range(TURNS):
            store.reads.clear()
            work.clear()
            await graph.ainvoke({"messages": [HumanMessage(f"question {n}")]}, CONFIG)
            per_run.append((dict(store.reads), dict(work)))
        # Each run: before the model call and after the agent, the log read for what is new (twice
        # each). The context after the final answer is recorded is the cache: the answer's write
        # read the thread back, which stands for it for 10 ms; a slower machine reads the tail once.
        for reads, converted in per_run[1:]:
            assert converted == {"from_langchain": 2}
            assert reads.pop("replay") == 4
            assert reads in ({}, {"tail": 1})
