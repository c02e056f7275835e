"""CompactionMiddleware follows edits made through LangGraph: removals, rewrites, time travel, clears."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from pydantic import Field

from contextfold import Compactor, RunOptions, StoreError, SummarizeOptions, conversation
from contextfold.stores import MemoryStore, SQLiteStore

from .scenario import COUNTER, RacingStore, agreeing, compactor, question, race, refusing_withdrawals

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, RemoveMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from contextfold.integrations.langchain import CompactionMiddleware

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
CONFIG: Any = {"configurable": {"thread_id": "t"}}


class Echo(GenericFakeChatModel):
    """Answers each request after its last message, and records what it was sent."""

    requests: list[list[str]] = Field(default_factory=list)
    prefix: str = "ai"
    """Of its replies' ids: a provider's ids are unique, also across processes."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        self.requests.append([m.text for m in messages])
        n = len(self.requests)
        reply = AIMessage(f"answer to {messages[-1].text}", id=f"{self.prefix}-{n}")
        return ChatResult(generations=[ChatGeneration(message=reply)])


def build(c: Compactor | None, *, checkpointer: Any = None, prefix: str = "ai") -> tuple[Any, Echo]:
    model = Echo(messages=iter(()), prefix=prefix)
    middleware = [CompactionMiddleware(c)] if c is not None else []
    saver = InMemorySaver() if checkpointer is None else checkpointer
    return create_agent(model, [], middleware=middleware, checkpointer=saver or None), model


async def said(store: Any) -> list[str]:
    """The conversation a replay of the log gives."""
    return [m.text for m in conversation([r async for r in store.replay("t")])]


async def asked(store: Any) -> list[str]:
    """Every user message the log recorded, withdrawn ones included."""
    return [r.episode.message.text async for r in store.replay("t") if r.episode.kind == "user_message"]


async def redact(store: MemoryStore | None, *, sync: bool) -> tuple[list[str], list[str]]:
    """Delete the first question and rewrite the answer the LangGraph way, then ask again."""
    graph, model = build(Compactor(store, options=NEVER_FOLDS) if store else None)

    async def ask(text: str, id_: str) -> None:
        given = {"messages": [HumanMessage(text, id=id_)]}
        if sync:
            await anyio.to_thread.run_sync(lambda: graph.invoke(given, CONFIG))
        else:
            await graph.ainvoke(given, CONFIG)

    await ask("my password is hunter2", "h1")
    answer = (await graph.aget_state(CONFIG)).values["messages"][-1]
    await graph.aupdate_state(
        CONFIG, {"messages": [RemoveMessage(id="h1"), AIMessage("[redacted]", id=answer.id)]}
    )
    await ask("hello again", "h2")
    state = [m.text for m in (await graph.aget_state(CONFIG)).values["messages"]]
    return model.requests[-1], state


@pytest.mark.parametrize("sync", [False, True], ids=["ainvoke", "invoke"])
async def test_a_removed_and_a_rewritten_message_stay_so(sync: bool) -> None:
    """Model and state see the edit as without the middleware; the log replays it and keeps the original."""
    plain = await redact(None, sync=sync)
    async with MemoryStore() as store:
        assert (
            await redact(store, sync=sync)
            == plain
            == (
                ["[redacted]", "hello again"],
                ["[redacted]", "hello again", "answer to hello again"],
            )
        )
        assert await said(store) == plain[1]
        assert "my password is hunter2" in await asked(store)


async def fork(store: MemoryStore | None) -> list[str]:
    """Two turns, then a third from the checkpoint after the first: LangGraph's time travel."""
    graph, model = build(Compactor(store, options=NEVER_FOLDS) if store else None)
    for text in ("first", "wrong turn"):
        await graph.ainvoke({"messages": [HumanMessage(text)]}, CONFIG)
    history = [snapshot async for snapshot in graph.aget_state_history(CONFIG)]
    earlier = next(s for s in history if len(s.values.get("messages", [])) == 2 and not s.next)
    await graph.ainvoke({"messages": [HumanMessage("better turn")]}, earlier.config)
    return model.requests[-1]


async def test_continuing_from_an_earlier_checkpoint_leaves_the_abandoned_branch() -> None:
    """A fork sends what it sends without the middleware, and the log replays the fork's conversation."""
    plain = await fork(None)
    async with MemoryStore() as store:
        assert await fork(store) == plain == ["first", "answer to first", "better turn"]
        assert await said(store) == [*plain, "answer to better turn"]
        assert "wrong turn" in await asked(store)


async def test_removing_every_message_starts_the_thread_over() -> None:
    """After RemoveMessage(REMOVE_ALL_MESSAGES) the model gets only the new turn; the log replays only it."""
    async with MemoryStore() as store:
        graph, model = build(Compactor(store, options=NEVER_FOLDS))
        await graph.ainvoke({"messages": [HumanMessage("old")]}, CONFIG)
        await graph.aupdate_state(CONFIG, {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES)]})
        await graph.ainvoke({"messages": [HumanMessage("new")]}, CONFIG)
        assert model.requests[-1] == ["new"]
        assert await said(store) == ["new", "answer to new"]


async def test_a_checkpointer_that_lost_the_thread_gets_it_back_from_the_store(tmp_path: Any) -> None:
    """A restarted process with a new InMemorySaver: the thread supplies the history, as before.

    Its state holds none of the context, as after REMOVE_ALL_MESSAGES, but the
    checkpointer kept no earlier run of the thread: nothing was cleared.
    """
    path = tmp_path / "restart.db"
    async with SQLiteStore(path) as store:
        graph, _ = build(Compactor(store, options=NEVER_FOLDS))
        await graph.ainvoke({"messages": [HumanMessage("first")]}, CONFIG)
    async with SQLiteStore(path) as store:  # the process restarted: its InMemorySaver is new
        graph, model = build(Compactor(store, options=NEVER_FOLDS), prefix="restarted")
        await graph.ainvoke({"messages": [HumanMessage("second")]}, CONFIG)
        assert model.requests[-1] == ["first", "answer to first", "second"]
        assert await said(store) == ["first", "answer to first", "second", "answer to second"]


async def test_without_a_checkpointer_the_thread_supplies_the_history() -> None:
    """An agent whose state is not kept gets the thread's earlier turns: there is no state to have edited."""
    async with MemoryStore() as store:
        graph, model = build(Compactor(store, options=NEVER_FOLDS), checkpointer=False)
        for text in ("first", "second"):
            await graph.ainvoke({"messages": [HumanMessage(text)]}, CONFIG)
        assert model.requests[-1] == ["first", "answer to first", "second"]


async def test_a_message_removed_after_a_fold_stays_removed(tmp_path: Any) -> None:
    """A kept turn removed after a fold leaves the context and the replay; the summary and the rest stay."""

    def long(n: int) -> str:
        return f"{question(n)} " + "padding " * 40

    async with SQLiteStore(tmp_path / "edits.db") as store:
        graph, model = build(compactor(store))
        for n in range(12):
            await graph.ainvoke({"messages": [HumanMessage(long(n))]}, CONFIG)
        before = await said(store)
        state = (await graph.aget_state(CONFIG)).values["messages"]
        assert state[0].id.startswith("contextfold.summary:")
        gone = next(m for m in state if m.text == long(11))
        await graph.aupdate_state(CONFIG, {"messages": [RemoveMessage(id=gone.id)]})
        await graph.ainvoke({"messages": [HumanMessage(long(12))]}, CONFIG)
        sent = model.requests[-1]
        assert long(11) not in sent and sent[0] == state[0].text and sent[-1] == long(12)
        assert await said(store) == [
            *(text for text in before if text != long(11)),
            long(12),
            f"answer to {long(12)}",
        ]
        assert long(11) in await asked(store)


async def both(store: Any) -> tuple[Any, ...]:
    """All the thread holds in both memories."""
    return (await store.load("t"), [r async for r in store.replay("t")])


async def test_an_edit_whose_log_write_fails_leaves_both_memories_as_they_were(tmp_path: Any) -> None:
    """The log refusing the edit leaves the working context unedited too; the next step makes the edit.

    Before, the context took the edit in a write of its own: the model no
    longer saw the removed message, and a replay of the log still gave it.
    """
    path = tmp_path / "edits.db"
    async with SQLiteStore(path) as store:
        graph, model = build(Compactor(store, options=NEVER_FOLDS))
        await graph.ainvoke({"messages": [HumanMessage("my password is hunter2", id="h1")]}, CONFIG)
        answer = (await graph.aget_state(CONFIG)).values["messages"][-1]
        await graph.aupdate_state(
            CONFIG, {"messages": [RemoveMessage(id="h1"), AIMessage("[redacted]", id=answer.id)]}
        )
        before = await both(store)
        with refusing_withdrawals(path), pytest.raises(StoreError, match="injected failure"):
            await graph.ainvoke({"messages": [HumanMessage("hello again", id="h2")]}, CONFIG)
        assert await both(store) == before
        await graph.ainvoke({"messages": [HumanMessage("hello again", id="h2")]}, CONFIG)
        assert model.requests[-1] == ["[redacted]", "hello again"]
        assert await agreeing(store, "t") == ["[redacted]", "hello again", "answer to hello again"]


async def test_a_step_of_the_thread_cannot_land_inside_an_edit() -> None:
    """A sync started while the middleware follows an update_state lands after it, in both memories.

    Before, it landed between the edit's read of the log and its write; the
    clear the edit then recorded took it from the log, and the context kept it.
    """
    store = RacingStore()
    async with store:
        c = Compactor(store, options=NEVER_FOLDS, counter=COUNTER)
        graph, _ = build(c)
        await graph.ainvoke({"messages": [HumanMessage("my password is hunter2", id="h1")]}, CONFIG)
        answer = (await graph.aget_state(CONFIG)).values["messages"][-1]
        await graph.aupdate_state(
            CONFIG, {"messages": [RemoveMessage(id="h1"), AIMessage("[redacted]", id=answer.id)]}
        )
        async with anyio.create_task_group() as group:
            stepped = race(store, c, "t", group)
            await graph.ainvoke({"messages": [HumanMessage("hello again", id="h2")]}, CONFIG)
        assert stepped.is_set()
        context = await agreeing(store, "t")
        assert "meanwhile" in context and "[redacted]" in context
        assert "my password is hunter2" not in context


async def test_with_two_stores_an_edit_reaches_both() -> None:
    """A compactor over a separate context and log follows the edit in both (two writes, context first)."""
    async with MemoryStore() as context, MemoryStore() as log:
        graph, model = build(Compactor(options=NEVER_FOLDS, short_term=context, episodic=log))
        await graph.ainvoke({"messages": [HumanMessage("my password is hunter2", id="h1")]}, CONFIG)
        answer = (await graph.aget_state(CONFIG)).values["messages"][-1]
        await graph.aupdate_state(
            CONFIG, {"messages": [RemoveMessage(id="h1"), AIMessage("[redacted]", id=answer.id)]}
        )
        await graph.ainvoke({"messages": [HumanMessage("hello again", id="h2")]}, CONFIG)
        assert model.requests[-1] == ["[redacted]", "hello again"]
        replayed = [m.text for m in conversation([r async for r in log.replay("t")])]
        assert (
            replayed
            == [m.text for m in (await context.load("t")).plain]
            == [
                "[redacted]",
                "hello again",
                "answer to hello again",
            ]
        )
