"""CompactionMiddleware without a checkpointer, under an application that sends the whole chat each run."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Literal, get_args

import pytest
from pydantic import Field

from contextfold import Compactor, RunOptions, SummarizeOptions, conversation
from contextfold.stores import MemoryStore, SQLiteStore

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from contextfold.integrations.langchain import CompactionMiddleware

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
CONFIG: Any = {"configurable": {"thread_id": "t"}}
QUESTIONS = ["q0", "q1", "ok", "ok"]
"""A user who really says "ok" twice: both are recorded and sent."""
EXPECTED = ["q0", "answer to q0", "q1", "answer to q1", "ok", "answer to ok", "ok", "answer to ok"]

Resend = Literal["dicts", "fresh objects", "user dicts, replies kept", "state passed back"]


class Echo(GenericFakeChatModel):
    """Answers each request after its last message, and records what it was sent."""

    requests: list[list[str]] = Field(default_factory=list)

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        self.requests.append([m.text for m in messages])
        reply = AIMessage(f"answer to {messages[-1].text}", id=f"ai-{uuid.uuid4().hex}")  # as a provider's
        return ChatResult(generations=[ChatGeneration(message=reply)])


def stateless(store: Any) -> tuple[Any, Echo]:
    """An agent whose state no checkpointer keeps, over a new compactor (a new process, as it were)."""
    model = Echo(messages=iter(()))
    middleware = CompactionMiddleware(Compactor(store, options=NEVER_FOLDS))
    return create_agent(model, [], middleware=[middleware]), model


def as_sent(chat: list[Any], resend: Resend) -> list[Any]:
    """The chat as the application sends it: new dicts or new message objects carry no id."""
    if resend == "fresh objects":
        return [HumanMessage(m.text) if isinstance(m, HumanMessage) else AIMessage(m.text) for m in chat]
    return list(chat)


def kept(state: dict[str, Any], resend: Resend) -> Any:
    """What the application keeps of a run's answer."""
    reply = state["messages"][-1]
    if resend == "dicts":
        return {"role": "assistant", "content": reply.text}
    if resend == "fresh objects":
        return AIMessage(reply.text)
    return reply


async def said(store: Any) -> list[str]:
    """The conversation a replay of the log gives."""
    return [m.text for m in conversation([r async for r in store.replay("t")])]


@pytest.mark.parametrize("resend", get_args(Resend))
async def test_a_chat_sent_again_each_run_is_recorded_and_sent_once(tmp_path: Path, resend: Resend) -> None:
    """Four runs, a restart half way: each message is recorded once and the model gets each once.

    LangGraph gives every message sent without an id a new random one on each
    run; before, the middleware took those for the framework's ids, recorded
    the whole chat again each run and sent the model every earlier turn again.
    """
    chat: list[Any] = []
    requests: list[list[str]] = []
    for half in (QUESTIONS[:2], QUESTIONS[2:]):
        async with SQLiteStore(tmp_path / "resent.db") as store:
            graph, model = stateless(store)
            for question in half:
                if resend == "fresh objects":
                    chat.append(HumanMessage(question))
                else:
                    chat.append({"role": "user", "content": question})
                state = await graph.ainvoke({"messages": as_sent(chat, resend)}, CONFIG)
                if resend == "state passed back":
                    chat = list(state["messages"])
                else:
                    chat.append(kept(state, resend))
            requests += model.requests
            recorded = await said(store)
    assert recorded == EXPECTED
    assert requests == [EXPECTED[: 2 * n + 1] for n in range(len(QUESTIONS))]


async def test_a_turn_the_application_drops_is_still_removed() -> None:
    """A chat sent again without its first question (the replies under their ids) is an edit followed."""
    async with MemoryStore() as store:
        graph, model = stateless(store)
        chat: list[Any] = []
        for question in ("q0", "q1"):
            chat.append({"role": "user", "content": question})
            state = await graph.ainvoke({"messages": list(chat)}, CONFIG)
            chat.append(state["messages"][-1])
        del chat[0]
        chat.append({"role": "user", "content": "q2"})
        await graph.ainvoke({"messages": chat}, CONFIG)
        after = ["answer to q0", "q1", "answer to q1", "q2"]
        assert model.requests[-1] == after
        assert await said(store) == [*after, "answer to q2"]
