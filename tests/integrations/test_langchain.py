"""CompactionMiddleware and LangChainSummarizer with create_agent and LangChain's fake chat models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import Field

from contextfold import ConfigError, Message
from contextfold._sync import SUMMARY_KEY_PREFIX
from contextfold.stores import MemoryStore, SQLiteStore

from .scenario import (
    TURNS,
    agent,
    check_log,
    check_requests,
    compactor,
    question,
    record_text,
    summary_of,
)

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from contextfold.integrations.langchain import (
    CompactionMiddleware,
    LangChainSummarizer,
    from_langchain,
    to_langchain,
)


class ScriptedChatModel(GenericFakeChatModel):
    """LangChain's fake chat model, answering from the scenario's script and recording each request."""

    requests: list[list[BaseMessage]] = Field(default_factory=list)
    summarizes: bool = False

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        self.requests.append(list(messages))
        if self.summarizes:
            reply = AIMessage(
                summary_of(messages[-1].text),
                usage_metadata={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
            )
        else:
            reply = to_langchain(agent([from_langchain(m) for m in messages]))
        return ChatResult(generations=[ChatGeneration(message=reply)])


@tool
def lookup(n: int) -> str:
    """Look a record up by its number."""
    return record_text(n)


def build(store: Any, saver: InMemorySaver) -> tuple[Any, ScriptedChatModel]:
    model = ScriptedChatModel(messages=iter(()))
    summarizer = LangChainSummarizer(ScriptedChatModel(messages=iter(()), summarizes=True))
    middleware = CompactionMiddleware(compactor(store, summarizer))
    return create_agent(model, [lookup], middleware=[middleware], checkpointer=saver), model


async def test_a_long_session_folds_under_invoke_and_ainvoke_and_resumes(tmp_path: Path) -> None:
    """Forty turns, sync invoke then ainvoke across a restart, fold and keep every message once."""
    path, saver = tmp_path / "lc.db", InMemorySaver()
    config = {"configurable": {"thread_id": "t"}}
    half = TURNS // 2
    requests: list[list[Message]] = []
    async with SQLiteStore(path) as store:
        graph, model = build(store, saver)
        for n in range(half):
            await anyio.to_thread.run_sync(
                lambda n=n: graph.invoke({"messages": [HumanMessage(question(n))]}, config)
            )
        requests += [[from_langchain(m) for m in r] for r in model.requests]
    async with SQLiteStore(path) as store:
        graph, model = build(store, saver)
        for n in range(half, TURNS):
            await graph.ainvoke({"messages": [HumanMessage(question(n))]}, config)
        requests += [[from_langchain(m) for m in r] for r in model.requests]
        c = compactor(store)
        await check_log(c, "t", range(TURNS))
        check_requests(requests)
        kinds = {record.episode.kind async for record in store.replay("t")}
        assert not kinds & {"messages_retracted", "history_cleared"}  # no fold or restart reads as an edit
    state = (await graph.aget_state(config)).values["messages"]
    assert state[0].id.startswith(SUMMARY_KEY_PREFIX)


async def test_a_missing_thread_id_names_the_fix() -> None:
    """Running without a thread_id fails with a ConfigError that says how to pass one."""
    async with MemoryStore() as store:
        graph, _ = build(store, InMemorySaver())
        with pytest.raises(ConfigError, match="thread_id"):
            await graph.ainvoke({"messages": [HumanMessage("hi")]}, {"configurable": {"thread_id": ""}})


def test_messages_convert_both_ways() -> None:
    """A LangChain AI message with tool calls, and a failed tool result, come back as they were."""
    from langchain_core.messages import ToolMessage

    ai = AIMessage(
        "",
        id="m1",
        tool_calls=[{"name": "f", "args": {"a": 1}, "id": "c1"}],
        response_metadata={"model_name": "x"},
    )
    result = ToolMessage("boom", tool_call_id="c1", status="error", id="m2")
    assert [to_langchain(from_langchain(m)) for m in (ai, result)] == [ai, result]


async def test_the_summarizer_uses_the_incremental_prompt() -> None:
    """LangChainSummarizer sends the previous summary and the new messages, and reads usage back."""
    model = ScriptedChatModel(messages=iter(()), summarizes=True)
    summary = await LangChainSummarizer(model).summarize(
        [Message.tool("c", "record 7: code-0007")],
        previous_summary="Codes seen: code-0001",
        max_summary_tokens=50,
    )
    assert summary.text == "Codes seen: code-0001 code-0007"
    assert summary.usage.input_tokens == 10
    prompt = model.requests[0][-1].text
    assert "<previous_summary>" in prompt and "<conversation>" in prompt
