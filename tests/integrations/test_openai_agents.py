"""CompactingSession with the real Agents SDK Runner, over a fake Chat Completions server on 127.0.0.1."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anyio
import pytest
from pytest_httpserver import HTTPServer

from contextfold import Compactor, Message, ToolCall, conversation
from contextfold import _tokens as tokens_module
from contextfold.stores import MemoryStore, SQLiteStore

from .scenario import (
    BUDGET,
    COUNTER,
    MODEL,
    TURNS,
    FakeProvider,
    agent,
    check_log,
    check_requests,
    check_requests_whole,
    compactor,
    question,
    record_text,
    text_of,
    transcript,
)

pytest.importorskip("agents")

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openai import AsyncOpenAI

from contextfold.integrations.openai_agents import CompactingSession, from_items, to_items


@function_tool
def lookup(n: int) -> str:
    """Look a record up by its number."""
    return record_text(n)


def make_agent(server: HTTPServer) -> Agent[Any]:
    client = AsyncOpenAI(base_url=server.url_for("/v1"), api_key="sk-test", max_retries=0)
    return Agent(
        name="records",
        instructions="Look records up.",
        tools=[lookup],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
    )


def serve(server: HTTPServer, script: Any = agent) -> FakeProvider:
    provider = FakeProvider("openai", script)
    server.expect_request("/v1/chat/completions", method="POST").respond_with_handler(provider)
    return provider


async def run_turns(
    session: CompactingSession, server: HTTPServer, turns: range, *, per_call: bool = True
) -> None:
    bot = make_agent(server)
    config = RunConfig(
        tracing_disabled=True, call_model_input_filter=session.model_input_filter if per_call else None
    )
    for n in turns:
        await Runner.run(bot, question(n), session=session, run_config=config)


async def test_a_long_session_folds_before_every_model_call_and_resumes(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """Forty turns fold before model calls, every request stays whole and small, and a new session resumes."""
    provider = serve(httpserver)
    path = tmp_path / "agents.db"
    async with SQLiteStore(path) as store:
        await run_turns(CompactingSession("s", compactor(store)), httpserver, range(TURNS // 2))
    async with SQLiteStore(path) as store:
        c = compactor(store)
        await run_turns(CompactingSession("s", c), httpserver, range(TURNS // 2, TURNS))
        await check_log(c, "s", range(TURNS))
    requests = [[m for m in r if m.role.value != "system"] for r in provider.requests]
    check_requests(requests)


async def test_pop_and_clear_are_replayed_from_the_log(httpserver: HTTPServer) -> None:
    """After pop_item and clear_session, replaying the log gives back exactly the session's items."""
    serve(httpserver)
    async with MemoryStore() as store:
        c = compactor(store)
        session = CompactingSession("s", c)
        await run_turns(session, httpserver, range(2))
        popped = await session.pop_item()
        assert popped is not None and popped.get("role") == "assistant"
        replayed = conversation([r async for r in c.episodic.replay("s")])
        assert to_items(replayed) == await session.get_items()
        assert len(await session.get_items()) == 7
        await session.clear_session()
        assert await session.get_items() == []
        await run_turns(session, httpserver, range(5, 6))
        replayed = conversation([r async for r in c.episodic.replay("s")])
        assert to_items(replayed) == await session.get_items()
        assert replayed[0].text == question(5)


async def test_pop_item_on_a_resumed_session_loads_the_tokenizer_in_a_worker_thread(
    httpserver: HTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process's first call may be pop_item: it counts what stays without loading tiktoken on the loop.

    The blocking detector fails the test if the encoding's ranks are read on the event loop.
    """
    serve(httpserver)
    path = tmp_path / "agents.db"
    async with SQLiteStore(path) as store:
        await run_turns(CompactingSession("s", compactor(store)), httpserver, range(2))
    monkeypatch.setattr(tokens_module, "_LOADED", {})  # as in a new process: no encoding loaded yet
    async with SQLiteStore(path) as store:
        session = CompactingSession("s", Compactor(store))  # the default counter: tiktoken's o200k_base
        before = await session.get_items()
        assert await session.pop_item() == before[-1]
        assert await session.get_items() == before[:-1]
        assert list(tokens_module._LOADED) == [("o200k_base", False)]


def test_items_convert_both_ways() -> None:
    """Reasoning, a message, two function calls and their outputs come back as the same items."""
    items: list[Any] = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {
            "type": "message",
            "role": "assistant",
            "id": "m1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "done", "annotations": []}],
        },
        {"type": "item_reference", "id": "ref_1"},
    ]
    messages, ids = from_items(items)
    assert [m.role.value for m in messages] == ["user", "assistant", "tool", "tool", "assistant", "user"]
    assert [c.id for c in messages[1].tool_calls] == ["c1", "c2"]
    assert ids[1] == "openai_agents.calls:c1,c2" and ids[2] == "openai_agents.output:c1"
    assert to_items(messages) == items


async def test_without_the_filter_a_run_compacts_only_between_runs(httpserver: HTTPServer) -> None:
    """Without model_input_filter the session still records every item once and folds on add_items."""
    serve(httpserver)
    async with MemoryStore() as store:
        c = compactor(store)
        await run_turns(CompactingSession("s", c), httpserver, range(12), per_call=False)
        await check_log(c, "s", range(12))


def researcher(calls: int) -> Any:
    """A model that looks up ``calls`` records in a row within one run, then answers."""
    made = itertools.count()

    def script(messages: Any) -> Message:
        n = next(made)
        if n % (calls + 1) == calls:
            return Message.assistant("Read them all.")
        return Message.assistant(
            None, tool_calls=[ToolCall(id=f"call_{n}", name="lookup", arguments=f'{{"n": {n}}}')]
        )

    return script


@pytest.mark.parametrize("per_call", [True, False], ids=["filter", "no-filter"])
async def test_the_filter_keeps_a_long_run_under_budget(httpserver: HTTPServer, per_call: bool) -> None:
    """Within one run of 24 tool calls, only the model input filter keeps every request under budget."""
    provider = serve(httpserver, researcher(24))
    async with MemoryStore() as store:
        session = CompactingSession("s", compactor(store))
        bot = make_agent(httpserver)
        config = RunConfig(
            tracing_disabled=True, call_model_input_filter=session.model_input_filter if per_call else None
        )
        await Runner.run(bot, "Read records 0 to 23.", session=session, run_config=config, max_turns=30)
    largest = max(
        sum(COUNTER.count(m) for m in request if m.role.value != "system") for request in provider.requests
    )
    assert (largest <= BUDGET) is per_call
    check_requests_whole(provider.requests)


def numbered_per_reply(messages: Any) -> Message:
    """The scenario's model, from a provider that numbers tool calls per reply: every call is ``call_0``."""
    reply = agent(messages)
    calls = tuple(call.model_copy(update={"id": "call_0"}) for call in reply.tool_calls)
    return reply.model_copy(update={"tool_calls": calls})


@pytest.mark.parametrize("per_call", [True, False], ids=["filter", "no-filter"])
async def test_a_call_id_the_provider_gives_again_is_a_new_call(
    httpserver: HTTPServer, per_call: bool
) -> None:
    """Every turn's call is ``call_0``: each run still takes two model calls, and the log holds every turn.

    Before, the reused id made the later turns' calls and results look recorded: they were dropped from
    the log and, with the filter, from what the model was sent, so it called its tool until max_turns.
    """
    provider = serve(httpserver, numbered_per_reply)
    async with MemoryStore() as store:
        c = compactor(store)
        session = CompactingSession("s", c)
        await run_turns(session, httpserver, range(12), per_call=per_call)
        texts = [text_of(m) for m in conversation([r async for r in c.episodic.replay("s")])]
        items = await session.get_items()
    assert len(provider.requests) == 2 * 12
    assert texts == [
        t if t != f"call_{n}" else "call_0" for n in range(12) for t in transcript(range(n, n + 1))
    ]
    tail = [item.get("arguments") or item.get("output") or item.get("content") for item in items[-4:]]
    assert tail[:3] == [question(11), '{"n": 11}', record_text(11)]


async def test_items_added_at_once_are_all_recorded(tmp_path: Path) -> None:
    """As the SDK's own sessions: concurrent add_items keep every item, the same text included."""
    async with SQLiteStore(tmp_path / "s.db") as store:
        session = CompactingSession("s", compactor(store))
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(session.add_items, [{"role": "user", "content": "ping"}])
        assert [item.get("content") for item in await session.get_items()] == ["ping"] * 4
        other = CompactingSession("o", compactor(store))
        async with anyio.create_task_group() as group:
            group.start_soon(other.add_items, [{"role": "user", "content": "ok"}])
            group.start_soon(
                other.add_items, [{"role": "user", "content": "ok"}, {"role": "user", "content": "then"}]
            )
        assert sorted(item.get("content") for item in await other.get_items()) == ["ok", "ok", "then"]


async def test_get_items_limit_is_the_sdks() -> None:
    """``limit``: the newest N; 0 gives none, a negative one (SQLite's LIMIT -1) and None give all."""
    async with MemoryStore() as store:
        session = CompactingSession("s", compactor(store))
        items: list[Any] = [{"role": "user", "content": text} for text in ("a", "b", "c")]
        await session.add_items(items)
        assert await session.get_items(limit=2) == items[1:]
        assert await session.get_items(limit=5) == items
        assert await session.get_items(limit=0) == []
        assert await session.get_items(limit=-1) == items
        assert await session.get_items() == items


async def test_pop_item_empties_a_folded_session(httpserver: HTTPServer) -> None:
    """pop_item returns None only once get_items is empty, also when a summary is all that is left.

    Each pop returns the newest item; once the session is empty, replaying the log gives it back: empty.
    """
    serve(httpserver)
    async with MemoryStore() as store:
        c = compactor(store)
        session = CompactingSession("s", c)
        await run_turns(session, httpserver, range(12))
        items = await session.get_items()
        assert "Codes seen:" in str(items[0].get("content"))
        while items:
            assert await session.pop_item() == items[-1]
            items = await session.get_items()
        assert await session.pop_item() is None
        assert conversation([r async for r in c.episodic.replay("s")]) == []


async def test_a_session_reads_what_another_worker_added(tmp_path: Path) -> None:
    """Two workers, each with its own compactor on one file: each sees the other's items at its next read.

    add_items checks the thread and loads no context after: what that check saw must not stand in for
    the thread at the next get_items, after the other worker wrote.
    """
    path = tmp_path / "shared.db"
    async with SQLiteStore(path) as first_store, SQLiteStore(path) as second_store:
        first = CompactingSession("s", compactor(first_store))
        second = CompactingSession("s", compactor(second_store))
        await first.add_items([{"role": "user", "content": "one"}])
        assert [item.get("content") for item in await first.get_items()] == ["one"]
        await first.add_items([])  # its check sees the thread as the context above holds it
        await second.add_items([{"role": "user", "content": "two"}])
        assert [item.get("content") for item in await first.get_items()] == ["one", "two"]
        await first.clear_session()
        await second.add_items([{"role": "user", "content": "three"}])
        assert [item.get("content") for item in await first.get_items()] == ["three"]


async def test_the_filter_never_sends_a_call_that_pop_item_left_open(httpserver: HTTPServer) -> None:
    """pop_item can leave a call without its output in the session; the filter does not send it, as the SDK.

    Before, the model got the open call (which the Responses API rejects); the session keeps it. The
    SDK's input then lacks that call, and the filter still records nothing of it again.
    """
    provider = serve(httpserver)
    async with MemoryStore() as store:
        session = CompactingSession("s", compactor(store))
        await run_turns(session, httpserver, range(1))
        await session.pop_item()  # the answer
        await session.pop_item()  # the tool's output: its call stays, unanswered
        assert [item.get("type") for item in await session.get_items()][-1] == "function_call"
        await run_turns(session, httpserver, range(1, 3))
        users = [item.get("content") for item in await session.get_items() if item.get("role") == "user"]
    check_requests_whole(provider.requests)
    assert "call_0" not in [text_of(m) for request in provider.requests[2:] for m in request]
    assert users == [question(0), question(1), question(2)]  # nothing recorded twice
