"""An agent's instructions, sent beside the run's messages, count toward the budget as a system prompt."""

from __future__ import annotations

import pytest

from contextfold import Message
from contextfold.events import CompactionEvent, FoldStalled
from contextfold.stores import MemoryStore

from .scenario import BUDGET, COUNTER, agent, check_requests, question, record_text

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from contextfold.integrations.pydantic_ai import CompactionCapability, from_pydantic_ai

from .test_openai_agents_instructions import TARGET, Summaries, instructions


class Sent:
    """A FunctionModel body playing the scenario's agent; records each request as the model reads it.

    The instructions, which pydantic-ai hands the model apart from the messages, as the system message
    a provider receives them as, ahead of the messages.
    """

    def __init__(self) -> None:
        self.requests: list[list[Message]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        converted, _ = from_pydantic_ai(messages)
        head = [Message.system(info.instructions)] if info.instructions else []
        self.requests.append([*head, *converted])
        reply = agent([m for m in converted if m.role.value != "system"])
        if reply.tool_calls:
            call = reply.tool_calls[0]
            return ModelResponse(parts=[ToolCallPart(call.name, call.arguments, tool_call_id=call.id)])
        return ModelResponse(parts=[TextPart(reply.text)])


async def run(prompt: str, turns: int) -> tuple[Sent, Summaries, list[CompactionEvent]]:
    """``turns`` runs of the scenario's conversation by an agent with ``prompt`` as its instructions."""
    sent, summaries = Sent(), Summaries()
    events: list[CompactionEvent] = []
    async with MemoryStore() as store:
        c = summaries.compactor(store, events)
        bot: Agent[None, str] = Agent(
            FunctionModel(sent), instructions=prompt, capabilities=[CompactionCapability(c, thread="t")]
        )

        @bot.tool_plain
        def lookup(n: int) -> str:
            """Look a record up by its number."""
            return record_text(n)

        history: list[ModelMessage] = []
        for n in range(turns):
            history = (await bot.run(question(n), message_history=history)).all_messages()
    return sent, summaries, events


async def test_a_request_with_large_instructions_stays_under_budget() -> None:
    """Every request, instructions included, stays within the budget, and the last carries the summary.

    Fails on ab5d4d1: the instructions went uncounted, so every request after the first fold was over
    the budget by about the whole 300-token prompt.
    """
    prompt = instructions(300)
    sent, summaries, _ = await run(prompt, 16)
    assert sent.requests[-1][0] == Message.system(prompt)
    largest = max(sum(COUNTER.count(m) for m in request) for request in sent.requests)
    assert largest <= BUDGET
    assert summaries.calls
    check_requests(sent.requests)


async def test_instructions_alone_over_the_target_stall_the_fold() -> None:
    """Instructions that alone hold the target stall the fold, saying so, and the summarizer is never called.

    Fails on ab5d4d1: the fold took the history down to the target beside 600 uncounted tokens of
    instructions, calling the summarizer for a request that could not fit.
    """
    prompt = instructions(600)
    sent, summaries, events = await run(prompt, 12)
    stalls = [event for event in events if isinstance(event, FoldStalled)]
    assert stalls and summaries.calls == 0
    tokens = COUNTER.count(Message.system(prompt))
    assert f"the pinned head alone holds 0 tokens (and the provider adds {tokens})" in stalls[0].detail
    assert f"at or over the {TARGET}-token target" in stalls[0].detail
    assert all("Codes seen:" not in m.text for request in sent.requests for m in request)
