"""CompactionCapability under a system prompt that changes between runs of one conversation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pytest

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, conversation
from contextfold.stores import MemoryStore

from .scenario import check_requests, compactor, question, record_text, text_of, transcript

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from contextfold.integrations.pydantic_ai import CompactionCapability, from_pydantic_ai

from .test_pydantic_ai import Scripted

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
EDITS = {"messages_retracted", "history_cleared"}
Prompt = Literal["dynamic", "append", "static", "instructions"]


class Echo:
    """A FunctionModel body answering each prompt by name; records the texts each request carried."""

    def __init__(self) -> None:
        self.requests: list[list[str]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append([m.text for m in from_pydantic_ai(messages)[0]])
        return ModelResponse(parts=[TextPart(f"answer to {self.requests[-1][-1]}")])


def agents(store: MemoryStore | None, prompt: Prompt) -> tuple[Callable[[int], Agent[None, str]], Echo]:
    """The agent of each run (its system prompt says the run's number), and the model they share."""
    model = Echo()
    capabilities = [CompactionCapability(Compactor(store, options=NEVER_FOLDS))] if store else []
    runs = [0]

    def dynamic() -> str:
        runs[0] += 1
        return f"prompt {runs[0]}"

    shared: Agent[None, str] = Agent(FunctionModel(model), capabilities=capabilities)
    if prompt == "dynamic":
        shared.system_prompt(dynamic=True)(dynamic)
    elif prompt == "append":
        shared.system_prompt(on_change="append")(dynamic)

    def agent(n: int) -> Agent[None, str]:
        if prompt == "static":
            return Agent(FunctionModel(model), capabilities=capabilities, system_prompt=f"prompt {n + 1}")
        if prompt == "instructions":
            return Agent(FunctionModel(model), capabilities=capabilities, instructions=f"prompt {n + 1}")
        return shared

    return agent, model


async def passing_back(store: MemoryStore | None, prompt: Prompt) -> list[list[str]]:
    """Four runs, each given the last one's all_messages(): what the model was sent."""
    agent, model = agents(store, prompt)
    history: list[ModelMessage] = []
    for n in range(4):
        history = (await agent(n).run(f"q{n}", message_history=history, conversation_id="c")).all_messages()
    return model.requests


async def said(store: MemoryStore) -> list[str]:
    return [text_of(m) for m in conversation([r async for r in store.replay("c")])]


async def kinds(store: MemoryStore) -> set[str]:
    return {record.episode.kind async for record in store.replay("c")}


TURNS = [f"{text}{n}" for n in range(4) for text in ("q", "answer to q")]


@pytest.mark.parametrize("prompt", ["dynamic", "append", "static", "instructions"])
async def test_a_history_passed_back_is_sent_as_pydantic_ai_sends_it(prompt: Prompt) -> None:
    """Each run sends what pydantic-ai alone sends, system prompt included; no turn is logged twice.

    Before, a dynamic prompt rendered anew made the thread record the conversation again: q0 reached the
    model up to four times a request, and an appended statement came back as a user message.
    """
    plain = await passing_back(None, prompt)
    async with MemoryStore() as store:
        assert await passing_back(store, prompt) == plain
        assert [text for text in await said(store) if not text.startswith("prompt")] == TURNS
        assert not await kinds(store) & EDITS
    assert all(request.count("q0") == 1 for request in plain)


async def without_history(store: MemoryStore, prompt: Prompt) -> list[list[str]]:
    """Four runs given no history: what the model was sent."""
    agent, model = agents(store, prompt)
    for n in range(4):
        result = await agent(n).run(f"q{n}", conversation_id="c")
        added = [m.text for m in from_pydantic_ai(result.new_messages())[0]]
        assert added == ["prompt 1"] * (n == 0) + [
            f"q{n}",
            f"answer to q{n}",
        ]  # the thread's prompt is not new
    return model.requests


@pytest.mark.parametrize("prompt", ["dynamic", "static"])
async def test_a_run_given_no_history_gets_the_threads_under_its_own_system_prompt(prompt: Prompt) -> None:
    """The thread's turns, once each, after the run's own prompt; the log records each prompt where it came.

    Before, the new prompt and the run's question were recorded after the old turns, and the model got the
    old prompt first and the new one in mid-conversation, with earlier turns repeated.
    """
    async with MemoryStore() as store:
        requests = await without_history(store, prompt)
        for n, request in enumerate(requests):
            assert request == [f"prompt {n + 1}", *TURNS[: 2 * n], f"q{n}"]
        assert await said(store) == [
            text for n in range(4) for text in (f"prompt {n + 1}", *TURNS[2 * n : 2 * n + 2])
        ]
        assert not await kinds(store) & EDITS


async def test_the_same_system_prompt_without_history_is_recorded_once() -> None:
    """A run given no history under the thread's own system prompt sends it once, and records it no more.

    Before, the prompt was recorded again after the thread's turns and sent again in mid-conversation.
    """
    async with MemoryStore() as store:
        model = Echo()
        bot = Agent(
            FunctionModel(model),
            system_prompt="Be brief.",
            capabilities=[CompactionCapability(Compactor(store, options=NEVER_FOLDS))],
        )
        for n in range(3):
            await bot.run(f"q{n}", conversation_id="c")
        assert model.requests[-1] == ["Be brief.", *TURNS[:4], "q2"]
        assert await said(store) == ["Be brief.", *TURNS[:6]]


@pytest.mark.parametrize("history", ["all_messages", "own-list", "none"])
async def test_a_dynamic_system_prompt_over_folds(history: str) -> None:
    """Sixteen tool-using turns fold; every request opens with the run's prompt alone and holds no turn twice.

    Before, each run recorded the conversation again (or, given no history, its prompt in mid-conversation).
    """
    async with MemoryStore() as store:
        script = Scripted()
        bot: Agent[None, str] = Agent(
            FunctionModel(script), capabilities=[CompactionCapability(compactor(store))]
        )
        runs = [0]

        @bot.system_prompt(dynamic=True)
        def now() -> str:
            runs[0] += 1
            return f"It is run {runs[0]}."

        @bot.tool_plain
        def lookup(n: int) -> str:
            """Look a record up by its number."""
            return record_text(n)

        messages: list[ModelMessage] = []
        for n in range(16):
            given = messages if history != "none" else None
            result = await bot.run(question(n), message_history=given, conversation_id="c")
            messages = (
                result.all_messages() if history == "all_messages" else [*messages, *result.new_messages()]
            )
            for request in script.requests[-2:]:
                assert [m.text for m in request if m.role.value == "system"] == [f"It is run {n + 1}."], n
                assert not duplicated(request), n
        check_requests(script.requests)
        log = [text for text in await said(store) if not text.startswith("It is run")]
        assert log == transcript(range(16))
        assert not await kinds(store) & EDITS


def duplicated(request: list[Message]) -> set[str]:
    texts = [m.text for m in request if m.role.value == "user"]
    return {text for text in texts if texts.count(text) > 1}


async def fork(store: MemoryStore | None) -> list[list[str]]:
    """Two runs under an appending prompt, then a third continuing from the first: what the model was sent."""
    agent, model = agents(store, "append")
    first = await agent(0).run("first", conversation_id="c")
    await agent(1).run("wrong turn", message_history=first.all_messages())
    await agent(2).run("better turn", message_history=first.all_messages())
    return model.requests


async def test_continuing_from_an_older_history_under_an_appending_prompt() -> None:
    """The branch left drops its appended statement too; the model gets what pydantic-ai alone sends.

    Before, the statement was taken for a prompt rendered anew, the edit was missed, and the first turn
    was sent twice.
    """
    plain = await fork(None)
    async with MemoryStore() as store:
        assert await fork(store) == plain
        assert "wrong turn" not in await said(store)
