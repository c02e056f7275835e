"""chat_llm over the real AsyncOpenAI / AsyncAnthropic clients, against a fake provider on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pytest_httpserver import HTTPServer

from contextfold import Message, StepLoop, Usage
from contextfold._loop import Reply
from contextfold.episodes import LlmCallEpisode
from contextfold.stores import SQLiteStore

from .scenario import MODEL, TURNS, FakeProvider, check_log, check_requests, compactor, lookup, question

pytest.importorskip("openai")
pytest.importorskip("anthropic")


def client(api: str, server: HTTPServer) -> Any:
    if api == "openai":
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=server.url_for("/v1"), api_key="sk-test", max_retries=0)
    from anthropic import AsyncAnthropic

    return AsyncAnthropic(base_url=server.url_for("/"), api_key="sk-test", max_retries=0)


def chat_llm(api: str, server: HTTPServer) -> Any:
    tools = {"lookup": lookup}
    if api == "openai":
        from contextfold.integrations.openai import chat_llm as openai_llm

        return openai_llm(client(api, server), MODEL, tools=tools, temperature=0)
    from contextfold.integrations.anthropic import chat_llm as anthropic_llm

    return anthropic_llm(client(api, server), MODEL, tools=tools, max_tokens=512)


def serve(api: str, server: HTTPServer) -> FakeProvider:
    provider = FakeProvider(api)
    path = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    server.expect_request(path, method="POST").respond_with_handler(provider)
    return provider


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_long_session_folds_and_resumes(api: str, httpserver: HTTPServer, tmp_path: Path) -> None:
    """Forty tool-using turns, blocking then streaming across a restart, fold and keep every message once."""
    provider = serve(api, httpserver)
    path = tmp_path / "llm.db"
    tools = {"lookup": lookup}
    half = TURNS // 2
    async with SQLiteStore(path) as store:
        loop = StepLoop(compactor(store))
        llm = chat_llm(api, httpserver)
        for n in range(half):
            await loop.run("t", question(n), llm=llm, tools=tools)
    async with SQLiteStore(path) as store:
        c = compactor(store)
        loop = StepLoop(c)
        llm = chat_llm(api, httpserver)
        for n in range(half, TURNS):
            async for _ in loop.stream("t", question(n), llm=llm.stream, tools=tools):
                pass
        await check_log(c, "t", range(TURNS))
        check_requests(provider.requests)
        calls = [r.episode async for r in c.episodic.replay("t") if isinstance(r.episode, LlmCallEpisode)]
        assert len(calls) == 2 * TURNS
        assert all(call.model == MODEL and call.usage and call.usage.input_tokens > 0 for call in calls)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_tool_schemas_are_sent(api: str, httpserver: HTTPServer) -> None:
    """The request carries the lookup tool's name, docstring and argument schema."""
    provider = serve(api, httpserver)
    reply = await chat_llm(api, httpserver)([Message.user(question(3))])
    assert isinstance(reply, Reply)
    assert reply.message.tool_calls[0].name == "lookup"
    assert reply.usage is not None and reply.usage.output_tokens > 0
    [tool] = provider.bodies[0]["tools"]
    spec = tool["function"] if api == "openai" else tool
    schema = spec["parameters"] if api == "openai" else spec["input_schema"]
    assert spec["name"] == "lookup" and spec["description"] == "Look a record up by its number."
    assert schema["properties"]["n"]["type"] == "integer" and schema["required"] == ["n"]


async def test_openai_requests_carry_no_nulls(httpserver: HTTPServer) -> None:
    """A tool-calling reply parsed from the SDK goes back out without null fields."""
    provider = serve("openai", httpserver)
    llm = chat_llm("openai", httpserver)
    first = await llm([Message.user(question(1))])
    await llm([Message.user(question(1)), first.message, Message.tool("call_1", "record 1")])
    sent = provider.bodies[1]["messages"][1]
    assert None not in sent.values() and "refusal" not in sent and sent["tool_calls"][0]["id"] == "call_1"


def test_usage_adds_up() -> None:
    """Usage values add field by field (the loop sums them per thread)."""
    assert Usage(input_tokens=1, output_tokens=2) + Usage(input_tokens=3) == Usage(
        input_tokens=4, output_tokens=2
    )
