"""CompactingSession's work per model call does not grow with the session: counted, not timed."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from pytest_httpserver import HTTPServer

from contextfold import Compactor, Message, RunOptions, SummarizeOptions

from .scenario import CountingStore, FakeProvider, agent, question

pytest.importorskip("agents")

from agents import RunConfig, Runner
from agents.run_config import CallModelData, ModelInputData

from contextfold.integrations import openai_agents as module
from contextfold.integrations.openai_agents import CompactingSession

from .test_openai_agents import make_agent, researcher

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
TURNS = 16


class Counted(CompactingSession):
    """The session, noting per model call its store reads, its hashing and the items it converts."""

    def __init__(self, store: CountingStore, work: Counter[str]) -> None:
        super().__init__("s", Compactor(store, options=NEVER_FOLDS))
        self.store, self.work = store, work
        self.calls: list[dict[str, int]] = []

    async def model_input_filter(self, data: CallModelData[Any]) -> ModelInputData:
        self.store.reads.clear()
        self.work.clear()
        filtered = await super().model_input_filter(data)
        self.calls.append(dict(self.store.reads + self.work))
        return filtered


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the session hashes a message and reads an item."""
    counts: Counter[str] = Counter()
    content_hash, plain = module.content_hash, module._plain

    def counted_hash(message: Message) -> str:
        counts["content_hash"] += 1
        return content_hash(message)

    def counted_plain(item: Any) -> dict[str, Any]:
        counts["_plain"] += 1
        return plain(item)

    monkeypatch.setattr(module, "content_hash", counted_hash)
    monkeypatch.setattr(module, "_plain", counted_plain)
    return counts


def serve(server: HTTPServer, script: Any) -> None:
    server.expect_request("/v1/chat/completions", method="POST").respond_with_handler(
        FakeProvider("openai", script)
    )


async def test_a_run_costs_as_much_at_turn_16_as_at_turn_2(
    httpserver: HTTPServer, work: Counter[str]
) -> None:
    """A run (the session read, a tool call, the answer, the items saved) hashes and reads only its items."""
    serve(httpserver, agent)
    async with CountingStore() as store:
        session = CompactingSession("s", Compactor(store, options=NEVER_FOLDS))
        bot = make_agent(httpserver)
        config = RunConfig(tracing_disabled=True, call_model_input_filter=session.model_input_filter)
        runs: list[dict[str, int]] = []
        for n in range(TURNS):
            store.reads.clear()
            work.clear()
            await Runner.run(bot, question(n), session=session, run_config=config)
            runs.append(dict(store.reads + work))
    assert runs[2:] == [runs[1]] * (TURNS - 2)


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_a_long_run_costs_as_much_at_its_24th_call_as_at_its_2nd(
    httpserver: HTTPServer, work: Counter[str], streamed: bool
) -> None:
    """Within one run of 24 tool calls, each model call hashes and reads only the items new since the last."""
    serve(httpserver, researcher(24))
    async with CountingStore() as store:
        session = Counted(store, work)
        bot = make_agent(httpserver)
        config = RunConfig(tracing_disabled=True, call_model_input_filter=session.model_input_filter)
        ask = "Read records 0 to 23."
        if streamed:
            result = Runner.run_streamed(bot, ask, session=session, run_config=config, max_turns=30)
            async for _ in result.stream_events():
                pass
        else:
            await Runner.run(bot, ask, session=session, run_config=config, max_turns=30)
    assert len(session.calls) == 25 and session.calls[3:] == [session.calls[2]] * 22
