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
from contextfold.episodes import SummaryCheckpoint
from contextfold.stores import MemoryStore, SQLiteStore

from .scenario import (
    BUDGET,
    COUNTER,
    MODEL,
    TURNS,
    FakeProvider,
    agent,
    answer,
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

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    SessionSettings,
    SQLiteSession,
    function_tool,
    handoff,
)
from agents.extensions import handoff_filters
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


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("per_call", [True, False], ids=["filter", "no-filter"])
async def test_the_filter_keeps_a_long_run_under_budget(
    httpserver: HTTPServer, per_call: bool, streamed: bool
) -> None:
    """Within one run of 24 tool calls, only the model input filter keeps every request under budget.

    A streamed run saves its input after the first model call, and reads the session's newest items
    in between: the filter still knows each later input for the run's own.
    """
    provider = serve(httpserver, researcher(24))
    async with MemoryStore() as store:
        session = CompactingSession("s", compactor(store))
        bot = make_agent(httpserver)
        config = RunConfig(
            tracing_disabled=True, call_model_input_filter=session.model_input_filter if per_call else None
        )
        ask = "Read records 0 to 23."
        if streamed:
            result = Runner.run_streamed(bot, ask, session=session, run_config=config, max_turns=30)
            async for _ in result.stream_events():
                pass
        else:
            await Runner.run(bot, ask, session=session, run_config=config, max_turns=30)
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


HAND_OVER = "Hand me over to the specialist."


def front_desk(messages: Any) -> Message:
    """The scenario's model for every agent but the specialist, which hands over when asked to."""
    system = messages[0].text if messages and messages[0].role.value == "system" else ""
    if system.startswith("Specialist"):
        return Message.assistant("The specialist here.")
    if messages[-1].role.value == "user" and messages[-1].text == HAND_OVER:
        return Message.assistant(
            None, tool_calls=[ToolCall(id="call_h", name="transfer_to_b", arguments="{}")]
        )
    return agent(messages)


def sent(request: list[Message]) -> list[str]:
    return [text_of(m) for m in request if m.role.value != "system"]


async def run_turns_of(
    httpserver: HTTPServer, session: Any, starting: Agent[Any], config: RunConfig, inputs: list[str]
) -> tuple[list[list[Message]], list[Any]]:
    """Run ``inputs`` as turns over ``session``: what the model was sent, and the items the session holds."""
    httpserver.clear()
    provider = serve(httpserver, front_desk)
    for text in inputs:
        await Runner.run(starting, text, session=session, run_config=config)
    return provider.requests, await session.get_items()


def specialist_desk(server: HTTPServer, *, input_filter: Any = None) -> Agent[Any]:
    client = AsyncOpenAI(base_url=server.url_for("/v1"), api_key="sk-test", max_retries=0)
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    specialist = Agent(name="b", instructions="Specialist.", model=model)
    return Agent(
        name="a",
        instructions="Look records up.",
        tools=[lookup],
        model=model,
        handoffs=[handoff(specialist, input_filter=input_filter) if input_filter else specialist],
    )


@pytest.mark.parametrize("rewrite", ["none", "input_filter", "nested"])
async def test_a_handoff_sends_and_keeps_what_the_sdks_own_session_does(
    httpserver: HTTPServer, rewrite: str
) -> None:
    """A handoff's input, rewritten by a filter or nested, reaches the agent as built; nothing is kept twice.

    Before, the rewritten list was laid against the log as new items: the whole history was recorded
    again, the specialist was sent it twice (or, nested, the history beside the SDK's summary of it),
    and the session kept the copy.
    """
    input_filter = handoff_filters.remove_all_tools if rewrite == "input_filter" else None
    config = RunConfig(tracing_disabled=True, nest_handoff_history=rewrite == "nested")
    turns = [question(1), HAND_OVER]
    expected = await run_turns_of(
        httpserver, SQLiteSession("s"), specialist_desk(httpserver, input_filter=input_filter), config, turns
    )
    async with MemoryStore() as store:
        session = CompactingSession("s", compactor(store))
        config = RunConfig(
            tracing_disabled=True,
            nest_handoff_history=rewrite == "nested",
            call_model_input_filter=session.model_input_filter,
        )
        requests, items = await run_turns_of(
            httpserver, session, specialist_desk(httpserver, input_filter=input_filter), config, turns
        )
        users = [m.text for m in conversation([r async for r in store.replay("s")]) if m.role.value == "user"]
    assert [sent(r) for r in requests] == [sent(r) for r in expected[0]]
    assert items == expected[1]
    assert users == turns  # the log holds each of the user's messages once


async def test_a_sub_agent_run_as_a_tool_is_neither_sent_nor_given_the_session(
    httpserver: HTTPServer,
) -> None:
    """``Agent.as_tool`` runs with the parent's RunConfig: its model calls pass the filter as they came.

    Before, the sub-agent was sent the session's conversation before its own input, and the session kept
    that input as a user message of its own.
    """

    def script(messages: Any) -> Message:
        if messages[0].text.startswith("Translate"):
            return Message.assistant("hello")
        if messages[-1].role.value == "tool":
            return Message.assistant("Done.")
        return Message.assistant(
            None, tool_calls=[ToolCall(id="call_t", name="translate", arguments='{"input": "bonjour"}')]
        )

    def parent() -> Agent[Any]:
        client = AsyncOpenAI(base_url=httpserver.url_for("/v1"), api_key="sk-test", max_retries=0)
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        translator = Agent(name="translator", instructions="Translate.", model=model)
        return Agent(
            name="main",
            instructions="Main.",
            tools=[translator.as_tool("translate", "Translate.")],
            model=model,
        )

    outcomes = []
    for own in (False, True):
        httpserver.clear()
        provider = serve(httpserver, script)
        async with MemoryStore() as store:
            session: Any = CompactingSession("s", compactor(store)) if own else SQLiteSession("s")
            config = RunConfig(
                tracing_disabled=True, call_model_input_filter=session.model_input_filter if own else None
            )
            await Runner.run(parent(), "Please translate my note.", session=session, run_config=config)
            outcomes.append(([sent(r) for r in provider.requests], await session.get_items()))
    assert outcomes[1] == outcomes[0]
    assert outcomes[1][0][1] == ["bonjour"]  # the sub-agent's request: its input alone


async def test_a_session_input_callback_chooses_what_the_model_is_sent(httpserver: HTTPServer) -> None:
    """What ``session_input_callback`` kept of the history is what the model gets; the log keeps every turn.

    Before, the filter sent the whole context in place of the callback's choice.
    """

    def last_two(history: list[Any], new: list[Any]) -> list[Any]:
        return history[-2:] + new

    config = RunConfig(tracing_disabled=True, session_input_callback=last_two)
    turns = [question(n) for n in range(3)]
    expected = await run_turns_of(httpserver, SQLiteSession("s"), make_agent(httpserver), config, turns)
    async with MemoryStore() as store:
        c = compactor(store)
        session = CompactingSession("s", c)
        config = RunConfig(
            tracing_disabled=True,
            session_input_callback=last_two,
            call_model_input_filter=session.model_input_filter,
        )
        requests, items = await run_turns_of(httpserver, session, make_agent(httpserver), config, turns)
        texts = [text_of(m) for m in conversation([r async for r in c.episodic.replay("s")])]
    assert [sent(r) for r in requests] == [sent(r) for r in expected[0]]
    assert sent(requests[-1])[:2] == [record_text(1), answer(1)]
    assert items == expected[1]
    assert texts == transcript(range(3))


async def test_session_settings_limit_chooses_what_the_model_is_sent(httpserver: HTTPServer) -> None:
    """``SessionSettings(limit=2)``: the model gets the newest two items and the new ones, as SQLiteSession's.

    Before, the filter sent the whole context, whatever the limit.
    """
    config = RunConfig(tracing_disabled=True, session_settings=SessionSettings(limit=2))
    turns = [question(n) for n in range(3)]
    expected = await run_turns_of(httpserver, SQLiteSession("s"), make_agent(httpserver), config, turns)
    async with MemoryStore() as store:
        session = CompactingSession("s", compactor(store))
        config = RunConfig(
            tracing_disabled=True,
            session_settings=SessionSettings(limit=2),
            call_model_input_filter=session.model_input_filter,
        )
        requests, items = await run_turns_of(httpserver, session, make_agent(httpserver), config, turns)
    assert [sent(r) for r in requests] == [sent(r) for r in expected[0]]
    assert sent(requests[-2]) == [answer(1), question(2)]  # the SDK drops an output whose call it cut
    assert items == expected[1]


async def test_a_filtered_handoff_after_a_fold_records_nothing_twice(httpserver: HTTPServer) -> None:
    """After folds, a handoff through ``remove_all_tools`` leaves each user message once in log and request.

    Before, the filtered history (the summary and the turns kept) was recorded again after the log's end.
    """
    async with MemoryStore() as store:
        c = compactor(store)
        session = CompactingSession("s", c)
        config = RunConfig(tracing_disabled=True, call_model_input_filter=session.model_input_filter)
        desk = specialist_desk(httpserver, input_filter=handoff_filters.remove_all_tools)
        turns = [question(n) for n in range(12)] + [HAND_OVER]
        requests, items = await run_turns_of(httpserver, session, desk, config, turns)
        records = [r async for r in c.episodic.replay("s")]
    assert any(isinstance(r.episode, SummaryCheckpoint) for r in records)
    assert [m.text for m in conversation(records) if m.role.value == "user"] == turns
    handed = sent(requests[-1])
    assert handed[-1] == HAND_OVER and len(handed) == len(set(handed))
    assert [i.get("content") for i in items if i.get("role") == "user"].count(HAND_OVER) == 1
