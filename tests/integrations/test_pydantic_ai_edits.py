"""CompactionCapability follows edits made to the message_history an application passes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio
import pytest

from contextfold import Compactor, Message, RunOptions, StoreError, SummarizeOptions, conversation
from contextfold.episodes import SummaryCheckpoint
from contextfold.stores import MemoryStore, SQLiteStore

from .scenario import (
    COUNTER,
    RacingStore,
    agreeing,
    check_log,
    check_requests,
    compactor,
    question,
    race,
    record_text,
    refusing_withdrawals,
    text_of,
    transcript,
)

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from contextfold.integrations.pydantic_ai import CompactionCapability, from_pydantic_ai

from .test_pydantic_ai import Scripted, make_agent

NEVER_FOLDS = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
EDITS = {"messages_retracted", "history_cleared"}


class Echo:
    """A FunctionModel body answering each prompt by name; records the texts each request carried."""

    def __init__(self) -> None:
        self.requests: list[list[str]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append([m.text for m in from_pydantic_ai(messages)[0]])
        return ModelResponse(parts=[TextPart(f"answer to {self.requests[-1][-1]}")])


def echo_agent(store: MemoryStore | None) -> tuple[Agent[None, str], Echo]:
    model = Echo()
    capabilities = [CompactionCapability(Compactor(store, options=NEVER_FOLDS))] if store else []
    return Agent(FunctionModel(model), capabilities=capabilities), model


async def said(store: Any, thread: str = "c") -> list[str]:
    """The conversation a replay of the log gives."""
    return [text_of(m) for m in conversation([r async for r in store.replay(thread)])]


async def kinds(store: Any, thread: str = "c") -> set[str]:
    return {record.episode.kind async for record in store.replay(thread)}


async def asked(store: Any) -> list[str]:
    """Every user message the log recorded, withdrawn ones included."""
    return [r.episode.message.text async for r in store.replay("c") if r.episode.kind == "user_message"]


async def drop_first_exchange(store: MemoryStore | None) -> list[str]:
    """Two exchanges, then a third with the first left out of the history: what the model was sent."""
    bot, model = echo_agent(store)
    first = await bot.run("my card number is 4111-1111", conversation_id="c")
    second = await bot.run("what's the weather?", message_history=first.all_messages())
    await bot.run("and tomorrow?", message_history=second.all_messages()[2:])
    return model.requests[-1]


async def test_earlier_messages_left_out_of_the_history_stay_out() -> None:
    """The model is sent what it is sent without contextfold; the log replays that and keeps the original.

    Before, the thread sent the first exchange again.
    """
    plain = await drop_first_exchange(None)
    async with MemoryStore() as store:
        assert await drop_first_exchange(store) == plain
        assert plain == ["what's the weather?", "answer to what's the weather?", "and tomorrow?"]
        assert await said(store) == [*plain, "answer to and tomorrow?"]
        assert "my card number is 4111-1111" in await asked(store)


async def rewrite_first_prompt(store: MemoryStore | None) -> list[str]:
    """Two exchanges, then a third with the first prompt rewritten in its request: what the model was sent."""
    bot, model = echo_agent(store)
    first = await bot.run("my card number is 4111-1111", conversation_id="c")
    history = (await bot.run("what's the weather?", message_history=first.all_messages())).all_messages()
    request = history[0]
    assert isinstance(request, ModelRequest)
    history[0] = replace(request, parts=[UserPromptPart("my card number is [redacted]")])
    await bot.run("and tomorrow?", message_history=history)
    return model.requests[-1]


async def test_a_message_rewritten_in_the_history_stays_rewritten() -> None:
    """A prompt rewritten in place reaches the model rewritten; the log replays it so and keeps the original.

    Before, the model got the original prompt and the rewritten one after the last answer.
    """
    plain = await rewrite_first_prompt(None)
    async with MemoryStore() as store:
        assert await rewrite_first_prompt(store) == plain
        assert plain[0] == "my card number is [redacted]" and len(plain) == 5
        assert await said(store) == [*plain, "answer to and tomorrow?"]
        assert "my card number is 4111-1111" in await asked(store)


async def test_continuing_from_an_older_history_leaves_the_later_turns() -> None:
    """A run given the history of an earlier run continues from there; the log replays that branch."""
    async with MemoryStore() as store:
        bot, model = echo_agent(store)
        first = await bot.run("first", conversation_id="c")
        await bot.run("wrong turn", message_history=first.all_messages())
        await bot.run("better turn", message_history=first.all_messages())
        assert model.requests[-1] == ["first", "answer to first", "better turn"]
        assert await said(store) == [*model.requests[-1], "answer to better turn"]


async def test_a_run_given_no_history_is_given_the_threads() -> None:
    """A run with an existing conversation_id and no message_history gets the thread's earlier turns."""
    async with MemoryStore() as store:
        bot, model = echo_agent(store)
        await bot.run("first", conversation_id="c")
        await bot.run("second", conversation_id="c")
        assert model.requests[-1] == ["first", "answer to first", "second"]
        assert not await kinds(store) & EDITS


async def session(store: MemoryStore, turns: range, *, own: bool) -> tuple[Scripted, list[ModelMessage]]:
    """The scenario's turns over one conversation; the history is all_messages(), or the app's own list."""
    script = Scripted()
    bot = make_agent(store, script)
    history: list[ModelMessage] = []
    for n in turns:
        result = await bot.run(question(n), message_history=history, conversation_id="c")
        history = [*history, *result.new_messages()] if own else result.all_messages()
    return script, history


@pytest.mark.parametrize("own", [False, True], ids=["all_messages", "own-list"])
async def test_a_folded_history_passed_back_is_no_edit(own: bool) -> None:
    """all_messages() after a fold, and the app's own list of every original, are the conversation as it is.

    Either way the model gets the summary and the recent turns; the log neither withdraws nor repeats one.
    """
    async with MemoryStore() as store:
        script, history = await session(store, range(16), own=own)
        check_requests(script.requests)
        await check_log(compactor(store), "c", range(16))
        assert not await kinds(store) & EDITS
        assert any(m.is_summary for m in from_pydantic_ai(history)[0]) is not own


async def test_a_folded_turn_left_out_of_the_apps_own_list_leaves_the_summary_too() -> None:
    """A folded turn left out of the app's own list reaches the model neither whole nor in the summary.

    The summary that held it is set aside and the conversation left is folded anew.
    Before, the summary still carried the turn's code to the model.
    """
    async with MemoryStore() as store:
        script, history = await session(store, range(12), own=True)
        assert "code-0000" in script.requests[-1][0].text  # the summary carries the first turn's code
        folds = sum([isinstance(r.episode, SummaryCheckpoint) async for r in store.replay("c")])
        bot = make_agent(store, script)
        history = history[4:]
        for n in (12, 13):
            result = await bot.run(question(n), message_history=history, conversation_id="c")
            history = [*history, *result.new_messages()]
            sent = " ".join(m.text for m in script.requests[-2] + script.requests[-1])
            assert "code-0000" not in sent and "code-0001" in sent
        assert await said(store) == transcript(range(1, 14))
        records = [r async for r in store.replay("c")]
        assert sum(isinstance(r.episode, SummaryCheckpoint) for r in records) > folds
        assert [r.episode.kind for r in records].count("history_cleared") == 1  # the next run is no edit
        results = [text_of(r.episode.message) for r in records if r.episode.kind == "tool_result"]
        assert record_text(0) in results  # the log keeps the original


async def test_a_kept_turn_left_out_of_all_messages_after_a_fold_stays_out() -> None:
    """The summary stays; the turn left out leaves the context and the replay, and the log keeps it."""
    async with MemoryStore() as store:
        script, history = await session(store, range(12), own=False)
        messages = from_pydantic_ai(history)[0]
        assert messages[0].is_summary and messages[-1].text == "Noted record 11."
        bot = make_agent(store, script)
        await bot.run(question(12), message_history=history[:-4], conversation_id="c")
        sent: list[Message] = script.requests[-2]
        assert sent[0].is_summary and question(12) == sent[-1].text
        assert question(11) not in [m.text for m in sent]
        assert await said(store) == transcript([*range(11), 12])
        assert question(11) in await asked(store)


async def both(store: Any) -> tuple[Any, ...]:
    """All the thread holds in both memories."""
    return (await store.load("c"), [r async for r in store.replay("c")])


async def test_an_edit_whose_log_write_fails_leaves_both_memories_as_they_were(tmp_path: Any) -> None:
    """The log refusing the edit leaves the working context unedited too; the run made again makes it.

    Before, the context took the edit in a write of its own, and a replay of
    the log still gave the exchange left out.
    """
    path = tmp_path / "edits.db"
    async with SQLiteStore(path) as store:
        bot, model = echo_agent(store)
        first = await bot.run("my card number is 4111-1111", conversation_id="c")
        second = await bot.run("what's the weather?", message_history=first.all_messages())
        before = await both(store)
        with refusing_withdrawals(path), pytest.raises(StoreError, match="injected failure"):
            await bot.run("and tomorrow?", message_history=second.all_messages()[2:])
        assert await both(store) == before
        await bot.run("and tomorrow?", message_history=second.all_messages()[2:])
        sent = ["what's the weather?", "answer to what's the weather?", "and tomorrow?"]
        assert model.requests[-1] == sent
        assert await agreeing(store, "c") == [*sent, "answer to and tomorrow?"]


async def test_a_step_of_the_thread_cannot_land_inside_an_edit() -> None:
    """A sync started while the capability follows an edited history lands after it, in both memories.

    Before, it landed between the edit's read of the log and its write, and
    the edit, which had not seen it, withdrew it from the log, not the context.
    """
    store = RacingStore()
    async with store:
        c = Compactor(store, options=NEVER_FOLDS, counter=COUNTER)
        bot = Agent(FunctionModel(Echo()), capabilities=[CompactionCapability(c)])
        first = await bot.run("my card number is 4111-1111", conversation_id="c")
        second = await bot.run("what's the weather?", message_history=first.all_messages())
        async with anyio.create_task_group() as group:
            stepped = race(store, c, "c", group)
            await bot.run("and tomorrow?", message_history=second.all_messages()[2:])
        assert stepped.is_set()
        context = await agreeing(store, "c")
        assert "meanwhile" in context and "and tomorrow?" in context
        assert "my card number is 4111-1111" not in context
