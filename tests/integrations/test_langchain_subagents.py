"""CompactionMiddleware in an agent that a tool of another agent invokes: each keeps its own conversation."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import Field

from contextfold import Compactor, RunOptions, SummarizeOptions, conversation
from contextfold.stores import MemoryStore

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from contextfold.integrations.langchain import CompactionMiddleware

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))


class Expert(GenericFakeChatModel):
    """The outer agent asks the expert about each question; the expert answers what it is asked."""

    requests: list[list[str]] = Field(default_factory=list)
    inner: bool = False
    ids: Any = Field(default_factory=itertools.count)

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        self.requests.append([f"{m.type}:{m.text}" for m in messages])
        last, n = messages[-1], next(self.ids)
        if self.inner:
            reply = AIMessage(f"expert on {last.text}", id=f"inner-{n}")
        elif isinstance(last, ToolMessage):
            reply = AIMessage("final", id=f"outer-{n}")
        else:
            call = {"name": "ask_expert", "args": {"question": f"sub {last.text}"}, "id": f"call-{n}"}
            reply = AIMessage("", tool_calls=[call], id=f"outer-{n}")
        return ChatResult(generations=[ChatGeneration(message=reply)])


async def run(store: MemoryStore | None, inner_checkpointer: bool | None) -> tuple[Expert, Expert]:
    """Two turns of an agent whose tool invokes an inner agent; both have the middleware if ``store``."""
    middleware = [CompactionMiddleware(Compactor(store, options=NEVER_FOLDS))] if store else []
    inner_model, outer_model = Expert(messages=iter(()), inner=True), Expert(messages=iter(()))
    inner = create_agent(inner_model, [], middleware=middleware, checkpointer=inner_checkpointer)

    @tool
    async def ask_expert(question: str) -> str:
        """Ask the expert sub-agent."""
        state = await inner.ainvoke({"messages": [HumanMessage(question)]})
        return str(state["messages"][-1].text)

    outer = create_agent(outer_model, [ask_expert], middleware=middleware, checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "main"}}
    for text in ("first", "second"):
        await outer.ainvoke({"messages": [HumanMessage(text)]}, config)
    return inner_model, outer_model


@pytest.mark.parametrize(
    ("inner_checkpointer", "inner_threads"),
    [(None, 2), (True, 1)],
    ids=["fresh-per-call", "checkpointer-true"],
)
async def test_a_sub_agent_keeps_its_own_thread_as_langgraph_keeps_its_state(
    inner_checkpointer: bool | None, inner_threads: int
) -> None:
    """Each model is sent what it is sent without the middleware; the outer thread holds only its turns."""
    plain_inner, plain_outer = await run(None, inner_checkpointer)
    async with MemoryStore() as store:
        inner, outer = await run(store, inner_checkpointer)
        log = [f"{m.role.value}:{m.text}" for m in conversation([r async for r in store.replay("main")])]
        threads = {info.thread for info in await store.threads()} - {"main"}
    assert inner.requests == plain_inner.requests
    assert outer.requests == plain_outer.requests
    assert not any("expert on" in text and not text.startswith("tool:") for text in log)
    assert log[:3] == ["user:first", "assistant:", "tool:expert on sub first"]
    assert len(threads) == inner_threads  # one per call, or one for all calls (task ids left out)
    assert {thread.partition(":")[0] for thread in threads} == {"main|tools"}
