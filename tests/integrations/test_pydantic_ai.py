"""CompactionCapability with a real pydantic-ai Agent and its FunctionModel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from contextfold import Compactor, Message, Role, RunOptions, SummarizeOptions, conversation
from contextfold.episodes import SummaryCheckpoint
from contextfold.stores import MemoryStore, SQLiteStore

from .scenario import (
    TURNS,
    agent,
    check_log,
    check_requests,
    check_requests_whole,
    codes_summarizer,
    compactor,
    question,
    record_text,
    text_of,
    transcript,
    turn_of,
)

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.messages import (
    CompactionPart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

from contextfold.integrations.pydantic_ai import (
    CompactionCapability,
    from_pydantic_ai,
    to_pydantic_ai,
)


class Scripted:
    """A FunctionModel body playing the scenario's agent; records what each request carried."""

    def __init__(self) -> None:
        self.requests: list[list[Message]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        converted, _ = from_pydantic_ai(messages)
        self.requests.append(converted)
        reply = agent([m for m in converted if m.role.value != "system"])
        if reply.tool_calls:
            call = reply.tool_calls[0]
            return ModelResponse(parts=[ToolCallPart(call.name, call.arguments, tool_call_id=call.id)])
        return ModelResponse(parts=[TextPart(reply.text)])


def make_agent(store: Any, script: Scripted, thread: str | None = None) -> Agent[None, str]:
    bot: Agent[None, str] = Agent(
        FunctionModel(script),
        instructions="Look records up.",
        capabilities=[CompactionCapability(compactor(store), thread=thread)],
    )

    @bot.tool_plain
    def lookup(n: int) -> str:
        """Look a record up by its number."""
        return record_text(n)

    return bot


async def test_a_long_session_folds_and_resumes(tmp_path: Path) -> None:
    """Forty turns over the run's conversation_id fold, and a new agent over the same file resumes them."""
    path = tmp_path / "pai.db"
    history: list[ModelMessage] = []
    requests: list[list[Message]] = []
    conversation_id = None
    for first, last in ((0, TURNS // 2), (TURNS // 2, TURNS)):
        async with SQLiteStore(path) as store:
            script = Scripted()
            bot = make_agent(store, script)
            for n in range(first, last):
                result = await bot.run(question(n), message_history=history, conversation_id=conversation_id)
                history, conversation_id = result.all_messages(), result.conversation_id
            requests += script.requests
            c = compactor(store)
            if last == TURNS:
                await check_log(c, conversation_id, range(TURNS))
                kinds = {r.episode.kind async for r in store.replay(conversation_id)}
                assert not kinds & {"messages_retracted", "history_cleared"}  # passed back: no edit
    check_requests(requests)
    assert any("Codes seen:" in m.text for m in from_pydantic_ai(history)[0][:1])


async def test_rebuilt_history_is_not_recorded_again() -> None:
    """History rebuilt from JSON keeps its conversation_id as the thread and adds no duplicate."""
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    async with MemoryStore() as store:
        bot = make_agent(store, Scripted())
        result = await bot.run(question(0), conversation_id="conv-1")
        for n in range(1, 3):
            history = ModelMessagesTypeAdapter.validate_json(result.all_messages_json())
            result = await bot.run(question(n), message_history=history)
        assert result.conversation_id == "conv-1"
        await check_log_without_fold(compactor(store), "conv-1", 3)


async def check_log_without_fold(c: Any, thread: str, turns: int) -> None:
    from contextfold import conversation

    from .scenario import text_of, transcript

    texts = [text_of(m) for m in conversation([r async for r in c.episodic.replay(thread)])]
    assert texts == transcript(range(turns))


def test_every_part_kind_converts_both_ways() -> None:
    """System, user, tool-return, retried, thinking and text parts come back equal after a round trip."""
    at = datetime(2026, 1, 1, tzinfo=UTC)
    messages: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("sys", timestamp=at), UserPromptPart("hi", timestamp=at)]),
        ModelResponse(
            parts=[
                ThinkingPart("hmm", signature="s1"),
                TextPart("x"),
                ToolCallPart("f", {"a": 1}, tool_call_id="c1"),
            ],
            timestamp=at,
        ),
        ModelRequest(
            parts=[
                ToolReturnPart("f", "result", tool_call_id="c1", timestamp=at),
                ToolReturnPart("f", "bad args", tool_call_id="c2", outcome="retried", timestamp=at),
            ]
        ),
    ]
    converted, ids = from_pydantic_ai(messages)
    assert [m.role.value for m in converted] == ["system", "user", "assistant", "tool", "tool"]
    assert ids[2] == "pydantic_ai.calls:c1" and ids[3] == "pydantic_ai.result:c1"
    assert converted[4].metadata["is_error"] is True
    assert to_pydantic_ai(converted) == messages


def test_a_part_kind_without_a_branch_is_kept() -> None:
    """A request part this module has no branch for (a CompactionPart of other code) survives a round trip."""
    at = datetime(2026, 1, 1, tzinfo=UTC)
    messages: list[ModelMessage] = [
        ModelRequest(
            parts=[CompactionPart(content="earlier: code-0001"), UserPromptPart("go on", timestamp=at)]
        )
    ]
    converted, _ = from_pydantic_ai(messages)
    assert [m.role.value for m in converted] == ["user", "user"] and "code-0001" in converted[0].text
    assert not converted[0].is_summary
    assert to_pydantic_ai(converted) == messages


def test_parts_of_two_requests_come_back_as_two_requests() -> None:
    """Consecutive requests keep their own fields after a round trip; a summary is a request of its own.

    Before, they came back as one request with the first one's fields (its ``run_id``, say).
    """
    at = datetime(2026, 1, 1, tzinfo=UTC)
    messages: list[ModelMessage] = [
        ModelRequest(parts=[ToolReturnPart("f", "done", tool_call_id="c1", timestamp=at)], run_id="run-1"),
        ModelRequest(parts=[UserPromptPart("next", timestamp=at)], run_id="run-2"),
    ]
    converted, _ = from_pydantic_ai(messages)
    assert to_pydantic_ai(converted) == messages
    summary = Message.user("Codes seen: code-0001", metadata={"contextfold.summary": True})
    rebuilt = to_pydantic_ai([summary, *converted[1:]])
    assert [m.run_id for m in rebuilt] == [None, "run-2"]


def test_two_requests_alike_but_for_their_parts_come_back_as_two() -> None:
    """Two requests an application built (no timestamp, no run) come back as two, each with its parts.

    Fails on ab5d4d1: their request-level fields were equal, so the round trip merged them into one
    request of two parts.
    """
    at = datetime(2026, 1, 1, tzinfo=UTC)
    messages: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("a", timestamp=at)]),
        ModelRequest(parts=[UserPromptPart("b", timestamp=at), UserPromptPart("c", timestamp=at)]),
        ModelResponse(parts=[TextPart("d")], timestamp=at),
    ]
    converted, _ = from_pydantic_ai(messages)
    assert to_pydantic_ai(converted) == messages


def test_the_summary_goes_back_as_a_marked_compaction_part() -> None:
    """A contextfold summary becomes a CompactionPart that converts back to a summary, never a user turn."""
    summary = Message.user(
        "[compacted summary of earlier turns]\nCodes seen: code-0001", metadata={"contextfold.summary": True}
    )
    [request] = to_pydantic_ai([summary, Message.user("next")])
    assert isinstance(request, ModelRequest) and isinstance(request.parts[0], CompactionPart)
    back, _ = from_pydantic_ai([request])
    assert back[0].is_summary and back[0].text == summary.text


class SameIds(Scripted):
    """The scenario's model, naming every tool call as pydantic-ai's TestModel does: after its tool."""

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        response = super().__call__(messages, info)
        for part in response.parts:
            if isinstance(part, ToolCallPart):
                part.tool_call_id = "pyd_ai_tool_call_id__lookup"
        return response


@pytest.mark.parametrize("fold", [False, True], ids=["no-fold", "fold"])
async def test_a_tool_call_id_the_model_gives_every_run_is_a_new_call(fold: bool) -> None:
    """Every run's call has the same id: each run still takes two requests, and the log holds every turn.

    Before, the later runs' calls and results were taken for recorded ones and left out of the requests:
    the model never saw its call answered and called again until the request limit.
    """
    turns = 12 if fold else 4
    async with MemoryStore() as store:
        script = SameIds()
        bot = make_agent(store, script)
        history: list[ModelMessage] = []
        for n in range(turns):
            history = (
                await bot.run(question(n), message_history=history, conversation_id="c")
            ).all_messages()
        assert len(script.requests) == 2 * turns
        c = compactor(store)
        records = [r async for r in c.episodic.replay("c")]
        texts = [text_of(m) for m in conversation(records)]
        assert texts == [
            "pyd_ai_tool_call_id__lookup" if text.startswith("call_") else text
            for text in transcript(range(turns))
        ]
        assert any(isinstance(r.episode, SummaryCheckpoint) for r in records) is fold
        assert not {r.episode.kind for r in records} & {"messages_retracted", "history_cleared"}
    check_requests_whole(script.requests)


async def test_a_runs_responses_keep_its_fields_after_a_fold() -> None:
    """new_messages() after a fold holds the run's own responses: its run_id and conversation_id on each.

    Before, they were rebuilt from what was recorded, before pydantic-ai stamped them, and carried neither.
    """
    async with MemoryStore() as store:
        bot = make_agent(store, Scripted())
        history: list[ModelMessage] = []
        folded = 0
        for n in range(12):
            result = await bot.run(question(n), message_history=history, conversation_id="c")
            history = result.all_messages()
            folded += any("Codes seen:" in m.text for m in from_pydantic_ai(history)[0])
            responses = [m for m in result.new_messages() if isinstance(m, ModelResponse)]
            assert len(responses) == 2
            assert all(m.run_id == result.run_id and m.conversation_id == "c" for m in responses), n
        assert folded


class Long:
    """A FunctionModel body answering every prompt at length; records what each request carried."""

    def __init__(self) -> None:
        self.requests: list[list[ModelMessage]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(messages)
        text = "ok " + "x " * 400
        if info.output_tools:
            return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, {"text": text})])
        return ModelResponse(parts=[TextPart(text)])


@pytest.mark.parametrize(
    ("structured", "keep"),
    [(False, 1), (True, 4)],
    ids=["summary-then-prompt", "output-tool-return-then-prompt"],
)
async def test_new_messages_after_a_fold_at_a_runs_first_request_are_the_runs_own(
    structured: bool, keep: int
) -> None:
    """A fold before a run's first request leaves new_messages() what the run added, the prompt first.

    Before, a request was rebuilt from the parts of two: new_messages() began with the summary merged
    into the run's prompt, or, when the prompt was merged into the previous run's output tool return,
    with the model's response.
    """
    options = RunOptions(
        max_history_tokens=2_000,
        compaction=SummarizeOptions(trigger_token_budget=500, min_recent_messages=keep, min_recent_turns=1),
    )
    async with MemoryStore() as store:
        script = Long()
        bot: Agent[None, Any] = Agent(
            FunctionModel(script),
            instructions="Answer.",
            capabilities=[
                CompactionCapability(Compactor(store, options=options, summarizer=codes_summarizer()))
            ],
            output_type=Answer if structured else str,
        )
        history: list[ModelMessage] = []
        folded = 0
        for n in range(8):
            result = await bot.run(
                f"question {n} " + "y " * 400, message_history=history, conversation_id="c"
            )
            history = result.all_messages()
            new = result.new_messages()
            sent = from_pydantic_ai(script.requests[-1])[0]
            folded += sent[0].is_summary
            assert sent[-1].text.startswith(f"question {n} "), n
            assert isinstance(new[0], ModelRequest) and isinstance(new[0].parts[0], UserPromptPart), n
            assert new[0].parts[0].content.startswith(f"question {n} ")
            assert all(m.run_id == result.run_id for m in new), n
            assert [type(m) for m in new] == [ModelRequest, ModelResponse] + [ModelRequest] * structured
            assert not any(m.is_summary for m in from_pydantic_ai(new)[0]), n
            assert history[-len(new) :] == new
        assert folded > 1


@dataclass
class Answer:
    text: str


class Structured:
    """A FunctionModel body that looks the asked record up, then answers through the output tool.

    Records what each request carried; ``stream`` plays the same model for ``run_stream``.
    """

    def __init__(self) -> None:
        self.requests: list[list[Message]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        converted, _ = from_pydantic_ai(messages)
        self.requests.append(converted)
        last = converted[-1]
        n = turn_of(last.text)
        if last.role is Role.USER:
            return ModelResponse(parts=[ToolCallPart("lookup", {"n": n}, tool_call_id=f"call_{n}")])
        output = info.output_tools[0].name
        return ModelResponse(parts=[ToolCallPart(output, {"text": f"code-{n:04d}"}, tool_call_id=f"out_{n}")])

    async def stream(self, messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[DeltaToolCalls]:
        [call] = self(messages, info).parts
        assert isinstance(call, ToolCallPart)
        yield {0: DeltaToolCall(call.tool_name, call.args_as_json_str(), tool_call_id=call.tool_call_id)}


def structured_turn(n: int) -> list[str]:
    return [question(n), f"call_{n}", record_text(n), f"out_{n}", "Final result processed."]


@pytest.mark.parametrize("mode", ["run", "run-history", "run_stream-history"])
async def test_the_output_tools_return_is_recorded(mode: str) -> None:
    """A run that ends through the output tool records its return: the next run sends the call answered.

    ``run_stream`` keeps that return out of the run's history, so it comes with the history passed back.
    Before, the return pydantic-ai adds after the run's last model request was never recorded: a run
    given no history sent every earlier output call as interrupted, and a fold later closed each one
    as abandoned.
    """
    async with MemoryStore() as store:
        script = Structured()
        bot: Agent[None, Answer] = Agent(
            FunctionModel(script, stream_function=script.stream),
            output_type=Answer,
            capabilities=[CompactionCapability(compactor(store))],
        )

        @bot.tool_plain
        def lookup(n: int) -> str:
            """Look a record up by its number."""
            return record_text(n)

        history: list[ModelMessage] = []
        for n in range(3):
            given = history if mode.endswith("-history") else None
            if mode.startswith("run_stream"):
                async with bot.run_stream(question(n), message_history=given, conversation_id="c") as stream:
                    output = await stream.get_output()
                history = stream.all_messages()
            else:
                result = await bot.run(question(n), message_history=given, conversation_id="c")
                output, history = result.output, result.all_messages()
            assert output == Answer(f"code-{n:04d}")
        records = [r async for r in store.replay("c")]
    expected = [*structured_turn(0), *structured_turn(1), question(2)]
    assert [text_of(m) for m in script.requests[-2]] == expected
    expected += ["call_2", record_text(2), "out_2"]
    if mode != "run_stream-history":  # a stream's return is its result's only, until passed back
        expected.append("Final result processed.")
    assert [text_of(m) for m in conversation(records)] == expected
    assert not {r.episode.kind for r in records} & {"messages_retracted", "history_cleared"}


class Down(Exception):
    """What the lookup of record 1 raises: its call is left without a result."""


@pytest.mark.parametrize("keep", [8, 10], ids=["call-folded", "call-kept"])
async def test_an_abandoned_calls_result_written_beside_a_new_prompt_records_nothing_twice(keep: int) -> None:
    """A check that closes an abandoned call at a run's first request records its result after the run's
    new prompt (in the context it goes right after the call); then a fold: nothing is recorded twice.

    Before, the prompt and the reply before it were taken for new, recorded and sent again, and with
    the call kept in the context, its error result too.
    """
    options = RunOptions(
        max_history_tokens=4_000,
        compaction=SummarizeOptions(
            trigger_token_budget=1_400, min_recent_messages=keep, min_recent_turns=1, abandon_after_turns=3
        ),
    )
    requests: list[list[Message]] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        """Look the asked record up, then say it was noted."""
        requests.append(from_pydantic_ai(messages)[0])
        last = requests[-1][-1]
        if last.role is Role.USER:
            n = turn_of(last.text)
            return ModelResponse(parts=[ToolCallPart("lookup", {"n": n}, tool_call_id=f"call_{n}")])
        return ModelResponse(parts=[TextPart("noted")])

    async with MemoryStore() as store:
        c = Compactor(store, options=options, summarizer=codes_summarizer())
        bot = Agent(FunctionModel(model), capabilities=[CompactionCapability(c)])

        @bot.tool_plain
        def lookup(n: int) -> str:
            """Look a record up by its number."""
            if n == 1:
                raise Down
            return f"record {n}"

        prompts = [f"What does record {n} say? " + "please " * 300 for n in range(5)]
        for n, prompt in enumerate(prompts):
            if n == 1:
                with pytest.raises(Down):
                    await bot.run(prompt, conversation_id="c")
            else:
                await bot.run(prompt, conversation_id="c")
        records = [r async for r in store.replay("c")]
    texts = [text_of(m) for m in conversation(records)]
    closed = texts[11]  # three turns after the call: at run 3's first request, beside its prompt
    assert closed.startswith("error: no result arrived for tool call 'call_1'")
    turn = {n: [prompts[n], f"call_{n}", f"record {n}", "noted"] for n in (0, 2, 3, 4)}
    assert texts == [*turn[0], prompts[1], "call_1", *turn[2], prompts[3], closed, *turn[3][1:], *turn[4]]
    assert any(isinstance(r.episode, SummaryCheckpoint) for r in records)
    # The fold came at the last run's first request: each of its two requests sends the prompt once.
    first, second = ([text_of(m) for m in request] for request in requests[-2:])
    assert requests[-2][0].is_summary
    kept = ["call_1", closed, *turn[2]] if keep == 10 else turn[2][1:]
    assert first[1:] == [*kept, *turn[3], prompts[4]]
    assert second == [*first, "call_4", "record 4"]


async def test_an_output_retry_counts_as_the_text_the_model_is_sent() -> None:
    """An output validator's ``ModelRetry``: the model reads pydantic-ai's feedback around its message.

    The retry part was counted as its bare ``content`` ("say it again"),
    while pydantic-ai sends it wrapped in about 40 tokens of instructions,
    so requests with retries went over the budget unseen.
    """
    from pydantic_ai import ModelRetry

    sent: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        for part in messages[-1].parts:  # pydantic-ai renders the retry as the model is to read it
            content = getattr(part, "content", None)
            if isinstance(content, str) and "say it again" in content:
                sent.append(content)
        return ModelResponse(parts=[TextPart("the answer")])

    async with MemoryStore() as store:
        c = compactor(store)
        bot: Agent[None, str] = Agent(FunctionModel(model), capabilities=[CompactionCapability(c)])
        tried: list[str] = []

        @bot.output_validator
        def check(output: str) -> str:
            if not tried:
                tried.append(output)
                raise ModelRetry("say it again")
            return output

        await bot.run("question", conversation_id="c")
        await bot.run("again", conversation_id="c", message_history=[])
        context = await c.context("c")
    assert sent and "say it again" in sent[0] and len(sent[0]) > len("say it again") * 3
    retry = [m for m in context if "say it again" in m.text]
    assert [m.text for m in retry] == sent[:1]


async def test_a_call_whose_arguments_are_not_json_is_retried_as_without_the_capability() -> None:
    """A model writes cut-off arguments: pydantic-ai answers with a retry, and the run goes on.

    With the capability the run ended on contextfold's ``InvalidMessageError``
    ("arguments: must be a JSON text"), converting the reply before
    pydantic-ai could answer it.
    """
    calls = 0

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            return ModelResponse(parts=[ToolCallPart("lookup", '{"n": 1, ', tool_call_id="c1")])
        return ModelResponse(parts=[TextPart("done")])

    async with MemoryStore() as store:
        c = compactor(store)
        bot: Agent[None, str] = Agent(FunctionModel(model), capabilities=[CompactionCapability(c)])

        @bot.tool_plain
        def lookup(n: int) -> str:
            """Look a record up by its number."""
            return record_text(n)

        result = await bot.run("question", conversation_id="c")
        logged = conversation([record async for record in store.replay("c")])
    assert result.output == "done" and calls == 2
    history = result.all_messages()
    assert to_pydantic_ai(from_pydantic_ai(history)[0]) == history
    call = next(m for m in logged if m.tool_calls)
    assert call.tool_calls[0].parsed_arguments() == '{"n": 1, '  # the model's text, kept
