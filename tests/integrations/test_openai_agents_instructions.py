"""An agent's instructions, sent beside the session's items, count toward the budget as a system prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from pytest_httpserver import HTTPServer

from contextfold import Compactor, FunctionSummarizer, Message
from contextfold.events import CompactionEvent, FoldStalled
from contextfold.stores import MemoryStore

from .scenario import BUDGET, COUNTER, MODEL, OPTIONS, FakeProvider, check_requests, question, summary_of

pytest.importorskip("agents")

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner
from openai import AsyncOpenAI

from contextfold.integrations.openai_agents import CompactingSession

from .test_openai_agents import lookup

TARGET = BUDGET // 2  # the scenario's target: SummarizeOptions' default, half the budget


def instructions(tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens, as the scenario's counter counts it."""
    return ("Look records up and cite each record's code. " * (tokens * 4 // 45)).rstrip()


class Summaries:
    """The scenario's summarizer, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.summarizer = FunctionSummarizer(self._summarize, model="codes")

    async def _summarize(self, messages: Sequence[Message], previous: str | None, limit: int) -> str:
        self.calls += 1
        return summary_of((previous or "") + " ".join(m.text for m in messages))

    def compactor(self, store: Any, events: list[CompactionEvent]) -> Compactor:
        """The scenario's compactor on ``store``, summarizing with this, its events into ``events``."""
        return Compactor(
            store, options=OPTIONS, summarizer=self.summarizer, counter=COUNTER, subscribers=[events.append]
        )


async def run(server: HTTPServer, prompt: str, turns: int) -> tuple[FakeProvider, Summaries, list[Any]]:
    """``turns`` runs of the scenario's session by an agent with ``prompt`` as its instructions."""
    provider = FakeProvider("openai")
    server.expect_request("/v1/chat/completions", method="POST").respond_with_handler(provider)
    summaries = Summaries()
    events: list[CompactionEvent] = []
    client = AsyncOpenAI(base_url=server.url_for("/v1"), api_key="sk-test", max_retries=0)
    bot = Agent(
        name="records",
        instructions=prompt,
        tools=[lookup],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
    )
    async with MemoryStore() as store:
        session = CompactingSession("s", summaries.compactor(store, events))
        config = RunConfig(tracing_disabled=True, call_model_input_filter=session.model_input_filter)
        for n in range(turns):
            await Runner.run(bot, question(n), session=session, run_config=config)
    await client.close()
    return provider, summaries, events


async def test_a_request_with_large_instructions_stays_under_budget(httpserver: HTTPServer) -> None:
    """Every request, instructions included, stays within the budget, and the last carries the summary.

    Fails on ab5d4d1: the instructions went uncounted, so every request after the first fold was over
    the budget by about the whole 300-token prompt.
    """
    prompt = instructions(300)
    provider, summaries, _ = await run(httpserver, prompt, 16)
    assert provider.requests[-1][0] == Message.system(prompt)
    assert 290 <= COUNTER.count(Message.system(prompt)) <= 300
    largest = max(sum(COUNTER.count(m) for m in request) for request in provider.requests)
    assert largest <= BUDGET
    assert summaries.calls
    check_requests(provider.requests)


async def test_instructions_alone_over_the_target_stall_the_fold(httpserver: HTTPServer) -> None:
    """Instructions that alone hold the target stall the fold, saying so, and the summarizer is never called.

    Fails on ab5d4d1: the fold took the history down to the target beside 600 uncounted tokens of
    instructions, calling the summarizer for a request that could not fit.
    """
    prompt = instructions(600)
    provider, summaries, events = await run(httpserver, prompt, 12)
    stalls = [event for event in events if isinstance(event, FoldStalled)]
    assert stalls and summaries.calls == 0
    tokens = COUNTER.count(Message.system(prompt))
    assert f"the pinned head alone holds 0 tokens (and the provider adds {tokens})" in stalls[0].detail
    assert f"at or over the {TARGET}-token target" in stalls[0].detail
    assert "shorten the system prompt" in stalls[0].detail
    assert all("Codes seen:" not in m.text for request in provider.requests for m in request)
