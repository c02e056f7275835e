"""CompactionMiddleware under ``create_agent(system_prompt=...)``: the prompt counts toward the budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import anyio
import pytest
from pydantic import Field

from contextfold import Compactor, FunctionSummarizer, Message, RunOptions, SummarizeOptions
from contextfold.stores import MemoryStore
from contextfold.tokens import ApproximateCounter

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from contextfold.integrations.langchain import CompactionMiddleware, from_langchain

COUNTER = ApproximateCounter()
BUDGET = 1_000
OPTIONS = RunOptions(
    max_history_tokens=4_000,
    compaction=SummarizeOptions(trigger_token_budget=BUDGET, max_summary_tokens=100, min_recent_messages=2),
)
PROMPT = "You are helpful and cite each record. " + "rule " * 240  # about 300 tokens
CONFIG: Any = {"configurable": {"thread_id": "t"}}


class Sizing(GenericFakeChatModel):
    """Answers with a 60-word reply; notes each request's tokens, system prompt included."""

    sizes: list[int] = Field(default_factory=list)
    texts: list[list[str]] = Field(default_factory=list)

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        sent = [from_langchain(m) for m in messages]
        self.sizes.append(COUNTER.count_messages(sent))
        self.texts.append([m.text for m in sent])
        reply = AIMessage("reply " + "pad " * 60)
        return ChatResult(generations=[ChatGeneration(message=reply)])


async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
    return "summary of earlier turns"


def compactor_on(store: MemoryStore) -> Compactor:
    """The compactor every test here runs: the 1,000-token budget, a fixed summary."""
    return Compactor(store, options=OPTIONS, summarizer=FunctionSummarizer(summarize), counter=COUNTER)


async def ask_twenty(agent: Any, call: Literal["ainvoke", "invoke"]) -> None:
    """Twenty questions of about 60 words each, by ``ainvoke`` or by ``invoke`` in a worker thread."""
    for n in range(20):
        turn = {"messages": [HumanMessage(f"q{n} " + "word " * 60)]}
        if call == "ainvoke":
            await agent.ainvoke(turn, CONFIG)
        else:
            await anyio.to_thread.run_sync(agent.invoke, turn, CONFIG)


@pytest.mark.parametrize("call", ["ainvoke", "invoke"])
async def test_the_agents_system_prompt_counts_toward_the_budget(call: Literal["ainvoke", "invoke"]) -> None:
    """Twenty turns under a 1,000-token budget with a 300-token system prompt: every request within it.

    The prompt goes to the model beside the state's messages, which the
    middleware saw without it: requests after a fold reached 1,217 tokens, the
    budget plus the whole prompt.
    """
    async with MemoryStore() as store:
        compactor = compactor_on(store)
        model = Sizing(messages=iter(()))
        agent = create_agent(model, [], system_prompt=PROMPT, middleware=[CompactionMiddleware(compactor)])
        await ask_twenty(agent, call)
    prompt_tokens = COUNTER.count_messages([Message.system(PROMPT)])
    assert prompt_tokens > 250
    assert max(model.sizes) > 900  # the conversation grew to the budget: folds were due
    assert max(model.sizes) <= BUDGET
    assert model.texts[-1][0] == PROMPT and "summary of earlier turns" in model.texts[-1][1]


class Delegating(GenericFakeChatModel):
    """The outer agent's model: asks its sub-agent, then answers; notes each request's tokens."""

    sizes: list[int] = Field(default_factory=list)

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        self.sizes.append(COUNTER.count_messages([from_langchain(m) for m in messages]))
        n = len(self.sizes)
        if isinstance(messages[-1], ToolMessage):
            reply = AIMessage("reply " + "pad " * 60, id=f"out-{n}")
        else:
            call = {"name": "ask", "args": {"q": "x"}, "id": f"call-{n}"}
            reply = AIMessage("", tool_calls=[call], id=f"out-{n}")
        return ChatResult(generations=[ChatGeneration(message=reply)])


class Expert(GenericFakeChatModel):
    """The sub-agent's model: a 100-word answer."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        return ChatResult(generations=[ChatGeneration(message=AIMessage("expert says " + "fact " * 100))])


async def test_a_middleware_shared_with_a_sub_agent_counts_each_agents_own_prompt() -> None:
    """One middleware for an agent without a system prompt and its sub-agent with a 560-token one.

    The middleware kept one prompt for every agent: after each sub-agent run
    the outer agent's check counted the sub-agent's prompt, over the target,
    and stalled, so 33 of its 40 requests went over the budget (up to 5,292).
    """
    async with MemoryStore() as store:
        compactor = compactor_on(store)
        middleware = CompactionMiddleware(compactor)
        inner = create_agent(
            Expert(messages=iter(())),
            [],
            system_prompt="You are an expert. " + "rule " * 450,
            middleware=[middleware],
        )

        @tool
        async def ask(q: str) -> str:
            """Ask the sub-agent."""
            state = await inner.ainvoke({"messages": [HumanMessage(q)]})
            return str(state["messages"][-1].text)

        model = Delegating(messages=iter(()))
        outer = create_agent(model, [ask], middleware=[middleware], checkpointer=InMemorySaver())
        for n in range(20):
            await outer.ainvoke({"messages": [HumanMessage(f"q{n} " + "word " * 60)]}, CONFIG)
    assert len(model.sizes) == 40
    assert max(model.sizes) <= BUDGET


async def test_a_dynamic_prompt_listed_before_the_middleware_counts_toward_the_budget() -> None:
    """``middleware=[dynamic_prompt, CompactionMiddleware(...)]``, as the README says to list them.

    The compaction middleware sees the model call as the middleware listed
    before it left it, so a prompt set there is counted: every request stays
    within the budget.
    """
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    @dynamic_prompt
    def prompt(request: ModelRequest[Any]) -> str:
        return PROMPT

    async with MemoryStore() as store:
        compactor = compactor_on(store)
        model = Sizing(messages=iter(()))
        agent = create_agent(model, [], middleware=[prompt, CompactionMiddleware(compactor)])
        for n in range(20):
            await agent.ainvoke({"messages": [HumanMessage(f"q{n} " + "word " * 60)]}, CONFIG)
    assert max(model.sizes) > 900
    assert max(model.sizes) <= BUDGET
    assert model.texts[-1][0] == PROMPT


class Billing(Sizing):
    """A provider that bills 300 input tokens the messages do not show (tool schemas, say)."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        sent = [from_langchain(m) for m in messages]
        billed = COUNTER.count_messages(sent) + 300
        self.sizes.append(billed)
        self.texts.append([m.text for m in sent])
        usage = {"input_tokens": billed, "output_tokens": 60, "total_tokens": billed + 60}
        reply = AIMessage("reply " + "pad " * 60, usage_metadata=usage)  # type: ignore[arg-type]
        return ChatResult(generations=[ChatGeneration(message=reply)])


@pytest.mark.parametrize("call", ["ainvoke", "invoke"])
async def test_what_the_provider_bills_beyond_the_messages_counts_toward_the_budget(
    call: Literal["ainvoke", "invoke"],
) -> None:
    """A reply's ``usage_metadata`` says what the request cost; what the messages do not show counts too.

    300 billed tokens the state's messages and the system prompt do not hold
    (tool schemas, a prompt set by middleware inside this one) went uncounted:
    requests after a fold reached 1,216 billed tokens against the 1,000 budget.
    """
    async with MemoryStore() as store:
        compactor = compactor_on(store)
        model = Billing(messages=iter(()))
        agent = create_agent(model, [], middleware=[CompactionMiddleware(compactor)])
        await ask_twenty(agent, call)
    assert max(model.sizes) > 900  # folds were due
    assert max(model.sizes[1:]) <= BUDGET  # from the first reply's usage on
    assert "summary of earlier turns" in model.texts[-1][0]


class FoldingMidCall(Billing):
    """Bills 300 unseen tokens; while it answers a request near the budget, the thread is folded.

    As a background fold that lands during the model call would.
    """

    compactor: Any = None
    events: list[Any] = Field(default_factory=list)
    folded_at: int | None = None

    async def _agenerate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        result = self._generate(messages, stop, run_manager, **kw)
        if self.folded_at is None and self.sizes[-1] > 850:
            self.events.clear()
            folded = await self.compactor.compact_now("t")
            assert folded is not None and folded.compacted
            self.folded_at = len(self.sizes)
        return result


async def test_usage_is_set_against_the_context_as_it_was_sent() -> None:
    """A fold applied while the model answers does not make the request's messages look billed beyond them.

    Measured against the context after the call, the folded-away tokens read
    as provider overhead, so the next checks saw the old size again and
    folded or stalled on "the provider adds" them.
    """
    async with MemoryStore() as store:
        compactor = compactor_on(store)
        model = FoldingMidCall(messages=iter(()), compactor=compactor)
        compactor.subscribe(model.events.append)
        agent = create_agent(model, [], middleware=[CompactionMiddleware(compactor)])
        n = 0
        while model.folded_at is None or len(model.sizes) < model.folded_at + 2:
            await agent.ainvoke({"messages": [HumanMessage(f"q{n} " + "word " * 60)]}, CONFIG)
            n += 1
        _, tokens = await compactor.context_tokens("t")
    assert [type(e).__name__ for e in model.events] == ["FoldApplied"]  # the mid-call fold, then none
    assert tokens < BUDGET
