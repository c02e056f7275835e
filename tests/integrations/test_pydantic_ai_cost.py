"""What a model request of a pydantic-ai run costs the capability, counted rather than timed."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

import contextfold._sync as core
from contextfold import Compactor, Message, RunOptions, SummarizeOptions
from contextfold.episodes import EpisodeRecord
from contextfold.stores import MemoryStore

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import contextfold.integrations.pydantic_ai as adapter
from contextfold.integrations.pydantic_ai import CompactionCapability, from_pydantic_ai

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))


class Counted(MemoryStore):
    """A memory store that counts its log reads."""

    def __init__(self) -> None:
        super().__init__()
        self.replays = 0

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        self.replays += 1
        async for record in super().replay(thread, from_seq=from_seq):
            yield record


class Hashes:
    """``content_hash``, counting its calls by whether they ran on the event loop's thread."""

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self.calls: Counter[str] = Counter()
        self._hash = core.content_hash

    def __call__(self, message: Message) -> str:
        self.calls["loop" if threading.get_ident() == self.loop_thread else "worker"] += 1
        return self._hash(message)


def counting(monkeypatch: pytest.MonkeyPatch) -> Hashes:
    hashes = Hashes(threading.get_ident())
    monkeypatch.setattr(core, "content_hash", hashes)
    monkeypatch.setattr(adapter, "content_hash", hashes)
    return hashes


class Looker:
    """A FunctionModel body: a tool call for a question, then an answer; counts taken before each request."""

    def __init__(self, store: Counted, hashes: Hashes) -> None:
        self.store, self.hashes = store, hashes
        self.sent: list[int] = []
        self.costs: list[tuple[int, int]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.sent.append(len(from_pydantic_ai(messages)[0]))
        self.costs.append((self.store.replays, self.hashes.calls.total()))
        if messages[-1].parts[-1].part_kind == "user-prompt":
            return ModelResponse(parts=[ToolCallPart("look", {"q": "x"}, tool_call_id=f"c{len(self.sent)}")])
        return ModelResponse(parts=[TextPart("done")])


async def test_a_request_in_mid_run_reads_the_log_and_hashes_the_list_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between a run's two requests the log is read six times and each message hashed at most eight times.

    Those are the two syncs (after the reply, before the request), each reading what the log added since
    and hashing the list to lay the system prompt on the log and as the core sync does. Before, every
    request of a run given a history checked that history for edits again: seven reads and some thirteen
    hashes a message (2,128 at 164 messages).
    """
    hashes = counting(monkeypatch)
    async with Counted() as store:
        model = Looker(store, hashes)
        bot = Agent(
            FunctionModel(model),
            system_prompt="You are helpful.",
            capabilities=[CompactionCapability(Compactor(store, options=NEVER_FOLDS))],
        )

        @bot.tool_plain
        def look(q: str) -> str:
            return "result " * 20

        history: list[ModelMessage] | None = None
        for run in range(12):
            result = await bot.run(f"question {run}", message_history=history, conversation_id="c")
            history = result.all_messages()
        (replays_before, hashed_before), (replays, hashed) = model.costs[-2:]
        sent = model.sent[-1]
        assert sent > 40
        assert replays - replays_before <= 6
        assert hashed - hashed_before <= 8 * sent


async def test_a_long_thread_met_for_the_first_time_is_read_and_hashed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capability new to a 600-message thread reads its log and hashes its messages in worker threads.

    Before, the first read of the log took every episode in on the event loop (a fifth of a second at
    20,000 messages), and the run's list was hashed there on every request.
    """
    async with MemoryStore() as store:
        turns = [
            message
            for n in range(300)
            for message in (Message.user(f"question {n}"), Message.assistant(f"answer {n}"))
        ]
        await Compactor(store, options=NEVER_FOLDS).append("c", turns)
        hashes = counting(monkeypatch)
        added: Counter[str] = Counter()
        add = adapter._Log.add

        def counted_add(log: Any, message: Message) -> None:
            added["loop" if threading.get_ident() == hashes.loop_thread else "worker"] += 1
            add(log, message)

        monkeypatch.setattr(adapter._Log, "add", counted_add)
        bot = Agent(
            FunctionModel(lambda messages, info: ModelResponse(parts=[TextPart("done")])),
            system_prompt="Be brief.",
            capabilities=[CompactionCapability(Compactor(store, options=NEVER_FOLDS))],
        )
        result = await bot.run("one more", conversation_id="c")
        history = result.all_messages()
        assert len(history) > 600
        await bot.run("and another", message_history=history, conversation_id="c")
        assert added["worker"] >= 600
        assert added["loop"] <= 10
        assert hashes.calls["worker"] > 1000
        assert hashes.calls["loop"] <= 20


async def test_what_the_capability_keeps_is_bounded_as_the_compactors_cache_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It keeps its reading of the threads used last, and the runs seen last, as many as the cache holds."""
    monkeypatch.setattr(adapter, "_CACHED_THREADS", 2)
    async with MemoryStore() as store:
        capability = CompactionCapability(Compactor(store, options=NEVER_FOLDS))
        bot = Agent(
            FunctionModel(lambda messages, info: ModelResponse(parts=[TextPart("done")])),
            capabilities=[capability],
        )
        for thread in ("a", "b", "c", "a"):
            await bot.run(f"hello {thread}", conversation_id=thread)
        assert list(capability._logs) == ["c", "a"]
        assert len(capability._runs) == 2
