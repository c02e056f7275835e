"""StepLoop: hook order, error propagation, and the same compaction in blocking and streaming runs."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold import (
    Compactor,
    ConfigError,
    Hook,
    Message,
    RunOptions,
    Step,
    StepLoop,
    SummarizeOptions,
    ToolCall,
    conversation,
    to_anthropic,
)
from contextfold.episodes import LlmCallEpisode, RunCompletedEpisode, SummaryCheckpoint, ToolCallEpisode
from contextfold.events import (
    BackgroundSummaryApplied,
    BackgroundSummaryDiscarded,
    BackgroundSummaryStarted,
    CompactionEvent,
)
from contextfold.loop import Compacted, RunFinished, TextDelta, ToolFinished
from contextfold.messages import TOOL_ERROR_METADATA_KEY
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.testing import ScriptedModel, tool_step
from contextfold.tokens import ApproximateCounter

OPTIONS = RunOptions(
    max_history_tokens=1_200,
    compaction=SummarizeOptions(trigger_token_budget=300, max_summary_tokens=60, min_recent_messages=2),
)


def agent(messages: list[Message]) -> Message:
    """Call one tool after each user message, then answer."""
    if messages[-1].role.value == "tool":
        return Message.assistant("answered " + "ok " * 10)
    return tool_step("fetch", '{"url": "https://example.org/a"}', call_id=f"c{len(messages)}")


async def fetch(url: str) -> str:
    return f"{url}\n" + "payload line\n" * 60


class Recording(Hook):
    def __init__(self, name: str, log: list[str], *, fail: bool = False, optional: bool = False) -> None:
        self.name, self.log, self.fail, self.optional = name, log, fail, optional

    async def before_request(self, step: Step) -> None:
        self.log.append(f"before:{self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} broke")

    async def after_response(self, step: Step) -> None:
        self.log.append(f"after:{self.name}")

    async def on_run_completed(self, thread: str, clean: bool) -> None:
        self.log.append(f"done:{self.name}:{clean}")


def make_loop(store: Any, *hooks: Hook) -> StepLoop:
    return StepLoop(Compactor(store, options=OPTIONS, counter=ApproximateCounter()), hooks=hooks)


async def test_before_hooks_run_in_order_and_after_hooks_in_reverse() -> None:
    """before_request runs first-to-last, after_response and run completion last-to-first."""
    log: list[str] = []
    async with MemoryStore() as store:
        loop = make_loop(store, Recording("a", log), Recording("b", log))
        await loop.run("t", "hi", llm=ScriptedModel([Message.assistant("hello")]))
    assert log == ["before:a", "before:b", "after:b", "after:a", "done:b:True", "done:a:True"]


async def test_a_failing_hook_stops_the_step() -> None:
    """A hook's error propagates and the model is never called."""
    model = ScriptedModel([Message.assistant("never")])
    async with MemoryStore() as store:
        loop = make_loop(store, Recording("bad", []), Recording("broken", [], fail=True))
        with pytest.raises(RuntimeError, match="broken broke"):
            await loop.run("t", "hi", llm=model)
    assert model.calls == 0


async def test_an_optional_hook_failure_is_logged_and_the_chain_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hook marked optional fails without stopping the run; the failure is logged."""
    log: list[str] = []
    async with MemoryStore() as store:
        loop = make_loop(store, Recording("flaky", log, fail=True, optional=True), Recording("next", log))
        result = await loop.run("t", "hi", llm=ScriptedModel([Message.assistant("hello")]))
    assert result.reply.text == "hello"
    assert "before:next" in log
    assert "flaky broke" in caplog.text


async def test_non_hooks_are_rejected() -> None:
    """Passing something that is not a Hook names its position."""
    async with MemoryStore() as store:
        with pytest.raises(ConfigError, match=r"hooks\[0\]"):
            StepLoop(Compactor(store, options=OPTIONS), hooks=[object()])  # type: ignore[list-item]


async def test_blocking_and_streaming_runs_compact_the_same_way(tmp_path: Path) -> None:
    """The same script leaves the same working context and the same compactions in run() and stream()."""
    async with SQLiteStore(tmp_path / "loop.db") as store:
        loop = make_loop(store)
        blocking_compactions = 0
        for n in range(6):
            result = await loop.run(
                "blocking", f"question {n}", llm=ScriptedModel(agent), tools={"fetch": fetch}
            )
            blocking_compactions += len(result.compactions)
        streaming = ScriptedModel(agent, chunk_size=3)
        events: list[Any] = []
        for n in range(6):
            events += [
                e
                async for e in loop.stream(
                    "streaming", f"question {n}", llm=streaming.stream, tools={"fetch": fetch}
                )
            ]
        blocking = await loop.compactor.context("blocking")
        streamed = await loop.compactor.context("streaming")
    assert blocking_compactions > 0
    assert blocking_compactions == sum(isinstance(e, Compacted) for e in events)
    assert [(m.role, m.text) for m in blocking] == [(m.role, m.text) for m in streamed]
    last_tool = max(i for i, e in enumerate(events) if isinstance(e, ToolFinished))
    deltas = "".join(e.text for e in events[last_tool:] if isinstance(e, TextDelta))
    assert deltas == blocking[-1].text


class Transcript(Hook):
    """Keeps every message each step recorded, as the agent produced it."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def after_response(self, step: Step) -> None:
        self.messages.extend(step.recorded)


async def test_replay_gives_back_the_whole_conversation_after_many_compactions(tmp_path: Path) -> None:
    """After many compactions, replaying the episodic log yields exactly the messages of the conversation."""
    transcript = Transcript()
    expected: list[Message] = []
    async with SQLiteStore(tmp_path / "replay.db") as store:
        loop = make_loop(store, transcript)
        compactions = 0
        for n in range(15):
            user = Message.user(f"question {n}", metadata={"n": n})
            before = len(transcript.messages)
            result = await loop.run("t", user, llm=ScriptedModel(agent), tools={"fetch": fetch})
            expected += [user, *transcript.messages[before:]]
            compactions += len(result.compactions)
        records = [r async for r in store.replay("t")]
        context = await loop.compactor.context("t")
    assert compactions >= 3
    assert len(context) < len(expected)
    assert conversation(records) == expected
    tool_calls = [r.episode.call for r in records if isinstance(r.episode, ToolCallEpisode)]
    assert tool_calls == [call for m in expected for call in m.tool_calls]


def two_tools(messages: list[Message]) -> Message:
    """Call two tools at once after a user message, then answer."""
    if messages[-1].role.value == "tool":
        return Message.assistant("both done")
    calls = [
        ToolCall(id="a", name="fetch", arguments='{"url": "https://example.org/a"}'),
        ToolCall(id="b", name="fetch", arguments='{"url": "https://example.org/b"}'),
    ]
    return Message.assistant(None, tool_calls=calls)


@contextmanager
def store_calls(store: Any) -> Iterator[list[tuple[list[str], list[str], list[int]]]]:
    """Every record_and_append the store gets: its episodes' kinds, its messages' roles and their links."""
    calls: list[tuple[list[str], list[str], list[int]]] = []
    record_and_append = store.record_and_append

    async def spy(thread: str, episodes: Any, messages: Any, tokens: Any, **kw: Any) -> Any:
        links = list(kw.get("message_episodes") or [])
        calls.append(([e.kind for e in episodes], [m.role.value for m in messages], links))
        return await record_and_append(thread, episodes, messages, tokens, **kw)

    async def no_bare_append(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a message reached the context without its episode")

    store.record_and_append, store.append = spy, no_bare_append
    try:
        yield calls
    finally:
        del store.record_and_append, store.append  # the class's methods again


async def test_a_steps_reply_tool_starts_and_results_go_in_one_store_call() -> None:
    """A step that runs two tools records its reply, both starts and both results in one transaction."""
    async with MemoryStore() as store:
        with store_calls(store) as calls:
            loop = make_loop(store)  # built with the spy in place, so every step goes through it
            await loop.run("t", "hi", llm=ScriptedModel(two_tools), tools={"fetch": fetch})
        records = [r.episode async for r in store.replay("t")]
        context = await loop.compactor.context("t")
    assert calls == [
        (["user_message"], ["user"], [0]),
        (
            ["llm_call", "tool_call", "tool_result", "tool_call", "tool_result"],
            ["assistant", "tool", "tool"],
            [0, 2, 4],
        ),
        (["llm_call"], ["assistant"], [0]),
    ]
    started = [e.call.id for e in records if isinstance(e, ToolCallEpisode)]
    assert started == ["a", "b"]
    assert [(m.role.value, m.tool_call_id) for m in context] == [
        ("user", None),
        ("assistant", None),
        ("tool", "a"),
        ("tool", "b"),
        ("assistant", None),
    ]


async def test_a_step_whose_record_fails_leaves_nothing_of_it_stored() -> None:
    """The store refusing a step's record leaves neither its reply nor a tool's start behind."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        record_and_append = store.record_and_append

        async def refuse_results(thread: str, episodes: Any, messages: Any, tokens: Any, **kw: Any) -> Any:
            if any(m.role.value == "tool" for m in messages):
                raise OSError("disk full")
            return await record_and_append(thread, episodes, messages, tokens, **kw)

        store.record_and_append = refuse_results  # type: ignore[method-assign]
        with pytest.raises(OSError, match="disk full"):
            await loop.run("t", "hi", llm=ScriptedModel(two_tools), tools={"fetch": fetch})
        del store.record_and_append
        records = [r.episode.kind async for r in store.replay("t")]
        context = await loop.compactor.context("t")
    assert records == ["user_message"]
    assert [m.role.value for m in context] == ["user"]


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_run_cancelled_as_its_last_tool_returns_records_the_step(
    backend: str, tmp_path: Path
) -> None:
    """A cancellation that arrives once every tool ran waits for the step's record; it does not lose it.

    Only the path that caught the cancellation inside the tools was shielded.
    One arriving as the last tool returned hit the record's first await, before
    anything was written: the tool had run (a file deleted, say), and neither
    the log nor the context held its call or its result.
    """
    scope = anyio.CancelScope()
    deleted = Message.assistant("I'll delete it", tool_calls=[ToolCall(id="c1", name="rm", arguments="{}")])

    async def rm() -> str:
        scope.cancel()  # a deadline or a shutdown, arriving as the tool finishes
        return "deleted /important"

    store = MemoryStore() if backend == "memory" else SQLiteStore(tmp_path / "a.db")
    async with store:
        loop = make_loop(store)
        with scope:
            model = ScriptedModel([deleted, Message.assistant("done")])
            await loop.run("t", "delete the file", llm=model, tools={"rm": rm})
        assert scope.cancelled_caught
        log = [r.episode async for r in store.replay("t")]
        context = (await store.load("t")).plain
    # The cancellation ends the run at its next await: before or after the second reply.
    assert [e.kind for e in log][:4] == ["user_message", "llm_call", "tool_call", "tool_result"]
    assert [(m.role.value, m.text) for m in context][:3] == [
        ("user", "delete the file"),
        ("assistant", "I'll delete it"),
        ("tool", "deleted /important"),
    ]


async def test_a_step_cut_short_keeps_what_it_had_and_answers_the_calls_it_did_not_finish() -> None:
    """Stopping after the first tool, or cancelling in the second, records what the step had, in order.

    Each call the step did not finish gets an error result: left unanswered,
    it was followed by the next user message in every later request, which
    providers refuse (``user, assistant[a, b], tool a, user``).
    """
    second_started = anyio.Event()

    async def slow(url: str) -> str:
        if url.endswith("/b"):
            second_started.set()
            await anyio.sleep_forever()
        return f"{url}: ok"

    async with MemoryStore() as store:
        loop = make_loop(store)
        async with aclosing(
            loop.stream("stopped", "hi", llm=ScriptedModel(two_tools).stream, tools={"fetch": slow})
        ) as events:
            async for event in events:
                if isinstance(event, ToolFinished):
                    break
        async with anyio.create_task_group() as group:
            group.start_soon(
                partial(loop.run, "cancelled", "hi", llm=ScriptedModel(two_tools), tools={"fetch": slow})
            )
            await second_started.wait()
            group.cancel_scope.cancel()
        logs = {t: [r.episode async for r in store.replay(t)] for t in ("stopped", "cancelled")}
        contexts = {t: await loop.compactor.context(t) for t in ("stopped", "cancelled")}
        follow_up = ScriptedModel([Message.assistant("next answer")])
        await loop.run("stopped", "next question", llm=follow_up)
    assert [e.kind for e in logs["stopped"]] == [
        "user_message",
        "llm_call",
        "tool_call",
        "tool_result",
        "tool_result",
    ]
    assert [e.kind for e in logs["cancelled"]] == [
        "user_message",
        "llm_call",
        "tool_call",
        "tool_result",
        "tool_call",
        "tool_result",
    ]
    assert [e.call.id for e in logs["cancelled"] if isinstance(e, ToolCallEpisode)] == ["a", "b"]
    for thread, what in (("stopped", "ran"), ("cancelled", "returned")):
        context = contexts[thread]
        assert [(m.role.value, m.tool_call_id) for m in context] == [
            ("user", None),
            ("assistant", None),
            ("tool", "a"),
            ("tool", "b"),
        ]
        assert context[2].text == "https://example.org/a: ok"
        assert context[3].metadata[TOOL_ERROR_METADATA_KEY] is True
        assert context[3].text == f"error: interrupted: the step was cut short before this tool {what}"
    # The next request answers both calls right after them, as providers require.
    assert [(m.role.value, m.tool_call_id) for m in follow_up.requests[0]] == [
        ("user", None),
        ("assistant", None),
        ("tool", "a"),
        ("tool", "b"),
        ("user", None),
    ]


@pytest.mark.parametrize("stores", ["one store", "two stores"])
async def test_append_notes_each_started_call_right_before_its_result(stores: str) -> None:
    """``append(..., started=...)`` logs reply, start, result, start, result; on one store or two."""
    reply = two_tools([Message.user("go")])
    results = [Message.tool("b", "b done"), Message.tool("a", "a done")]  # answered out of order
    async with MemoryStore() as store, MemoryStore() as log:
        if stores == "one store":
            compactor = Compactor(store, options=OPTIONS, counter=ApproximateCounter())
        else:
            compactor = Compactor(
                short_term=store, episodic=log, options=OPTIONS, counter=ApproximateCounter()
            )
        await compactor.append("t", [reply, *results], started=reply.tool_calls)
        episodes = [r.episode async for r in compactor.episodic.replay("t")]
        context = await compactor.context("t")
    assert [(e.kind, getattr(e, "call", None) and e.call.id) for e in episodes] == [  # type: ignore[attr-defined]
        ("llm_call", None),
        ("tool_call", "b"),
        ("tool_result", None),
        ("tool_call", "a"),
        ("tool_result", None),
    ]
    assert context == [reply, *results]


_KILLED_MID_TOOL = """
import sys, time
from pathlib import Path
import anyio
from contextfold import Compactor, Message, StepLoop, ToolCall
from contextfold.stores import SQLiteStore
from contextfold.testing import ScriptedModel
from contextfold.tokens import ApproximateCounter

async def hang(url):
    Path(sys.argv[2]).write_text("running")
    time.sleep(60)  # killed here, while the step's tool runs

async def main():
    reply = Message.assistant(None, tool_calls=[ToolCall(id="a", name="fetch", arguments='{"url": "x"}')])
    async with SQLiteStore(sys.argv[1]) as store:
        loop = StepLoop(Compactor(store, counter=ApproximateCounter()))
        await loop.run("t", "hi", llm=ScriptedModel([reply]), tools={"fetch": hang})

anyio.run(main)
"""


async def test_a_process_killed_while_a_tool_runs_leaves_no_half_of_the_step(tmp_path: Path) -> None:
    """SIGKILL during a step's tool: the log and the context hold the user message, not a dangling reply."""
    db, marker = tmp_path / "killed.db", tmp_path / "running"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MID_TOOL, str(db), str(marker)])
    try:
        with anyio.fail_after(60):
            while not marker.exists():
                assert child.poll() is None, "the child ended before its tool ran"
                await anyio.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    async with SQLiteStore(db) as store:
        log = [r.episode.kind async for r in store.replay("t")]
        context = [m.message.role.value for m in (await store.load("t")).messages]
    assert log == ["user_message"]
    assert context == ["user"]


async def test_step_record_rejects_started_calls_that_are_not_tool_calls() -> None:
    """``started`` must name ToolCall objects; the error says so and nothing is recorded."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        async with loop.step("t") as step:
            with pytest.raises(ConfigError, match="started"):
                await step.record(Message.assistant("x"), started=["a"])  # type: ignore[list-item]
            with pytest.raises(ConfigError, match="started"):
                await step.record(Message.assistant("x"), started=None)  # type: ignore[arg-type]
        assert await loop.compactor.context("t") == []


async def test_llm_call_episodes_say_what_was_sent() -> None:
    """An LLM-call episode records how many messages and tokens the request carried."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        await loop.append("t", Message.system("You are a careful agent. " * 10))
        await loop.run("t", "hi", llm=ScriptedModel([Message.assistant("hello")]))
        calls = [r.episode async for r in store.replay("t") if isinstance(r.episode, LlmCallEpisode)]
    assert calls[0].request_messages == 2
    assert calls[0].request_tokens > 0


async def test_a_clean_run_completion_resets_unfinished_turns() -> None:
    """Finishing a run records run_completed and resets the unfinished-turns count."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        await loop.append("t", Message.user("one"), Message.user("two"))
        assert (await store.pressure("t")).user_messages_after_latest_run_completed == 2
        await loop.run("t", "three", llm=ScriptedModel([Message.assistant("done")]))
        pressure = await store.pressure("t")
        last = [r.episode async for r in store.replay("t")][-1]
    assert pressure.user_messages_after_latest_run_completed == 0
    assert isinstance(last, RunCompletedEpisode) and last.clean


async def test_running_out_of_steps_ends_the_run_uncleanly() -> None:
    """A run that hits max_steps ends with RunFinished(clean=False) and an unclean completion."""
    always_tool = ScriptedModel(lambda m: tool_step("fetch", '{"url": "u"}', call_id=f"c{len(m)}"))
    async with MemoryStore() as store:
        loop = make_loop(store)
        events = [
            e
            async for e in loop.stream(
                "t", "loop forever", llm=always_tool.stream, tools={"fetch": fetch}, max_steps=3
            )
        ]
        last = [r.episode async for r in store.replay("t")][-1]
    assert isinstance(events[-1], RunFinished) and not events[-1].clean and events[-1].steps == 3
    assert isinstance(last, RunCompletedEpisode) and not last.clean


async def test_tool_failures_become_error_results_for_the_model() -> None:
    """An unknown tool or a raising tool yields an error tool result instead of crashing the run."""

    async def explode(**_: Any) -> str:
        raise ValueError("disk on fire")

    calls = [
        ToolCall(id="x1", name="missing", arguments="{}"),
        ToolCall(id="x2", name="explode", arguments="{}"),
    ]
    model = ScriptedModel([Message.assistant(None, tool_calls=calls), Message.assistant("sorry")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        events = [e async for e in loop.stream("t", "go", llm=model.stream, tools={"explode": explode})]
    results = [e.result for e in events if isinstance(e, ToolFinished)]
    assert "no tool named 'missing'" in results[0].text
    assert "ValueError: disk on fire" in results[1].text
    assert all(r.metadata.get(TOOL_ERROR_METADATA_KEY) for r in results)
    _, wire = to_anthropic([Message.assistant(None, tool_calls=calls), *results])
    assert all(block["is_error"] for block in wire[1]["content"])


async def test_max_steps_must_be_positive() -> None:
    """max_steps below 1 is a ConfigError naming the option."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError, match="max_steps"):
            await loop.run("t", "hi", llm=ScriptedModel([]), max_steps=0)


async def test_run_records_the_model_and_usage_a_reply_carries() -> None:
    """A model callable returning a Reply has its model and usage recorded with the reply in the log."""
    from contextfold import MemoryStore, RunOptions, Usage
    from contextfold._loop import Reply
    from contextfold.episodes import LlmCallEpisode

    async def llm(messages: list[Message]) -> Reply:
        return Reply(Message.assistant("done"), model="m-1", usage=Usage(input_tokens=7, output_tokens=2))

    async with MemoryStore() as store:
        loop = StepLoop(Compactor(store, options=RunOptions.without_compaction()))
        await loop.run("t", "hi", llm=llm)
        calls = [r.episode async for r in store.replay("t") if isinstance(r.episode, LlmCallEpisode)]
    assert [(c.model, c.usage) for c in calls] == [("m-1", Usage(input_tokens=7, output_tokens=2))]


@contextmanager
def generators_left_to_the_collector() -> Iterator[list[str]]:
    """Collect the names of async generators that nobody closed, finalized by the garbage collector.

    Such a generator is closed later in a task of the event loop's own (asyncio and
    trio both do this), so a name here is a task left behind by its consumer.
    """
    firstiter, finalizer = sys.get_asyncgen_hooks()
    left: list[str] = []

    def on_finalize(generator: AsyncGenerator[Any, None]) -> None:
        left.append(generator.__qualname__)
        if finalizer is not None:
            finalizer(generator)

    sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=on_finalize)
    try:
        yield left
        gc.collect()
    finally:
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)


async def test_run_closes_the_stream_it_drives() -> None:
    """run() closes stream() itself, leaving no generator for the garbage collector to close elsewhere."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        with generators_left_to_the_collector() as left:
            result = await loop.run("t", "hi", llm=ScriptedModel(agent), tools={"fetch": fetch})
    assert result.reply.text.startswith("answered")
    assert left == []


async def test_stopping_a_stream_early_closes_the_models_stream_before_returning() -> None:
    """Leaving aclosing(stream()) at the first text delta runs the model's finally before the block ends."""
    log: list[str] = []

    async def model(messages: list[Message]) -> AsyncIterator[str]:
        try:
            for word in ("one ", "two ", "three"):
                yield word
        finally:
            log.append("model closed")

    async with MemoryStore() as store:
        loop = make_loop(store)
        with generators_left_to_the_collector() as left:
            async with aclosing(loop.stream("t", "go", llm=model)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        break
            closed_when_the_block_returned = list(log)
    assert closed_when_the_block_returned == ["model closed"]
    assert left == []


async def test_stopping_a_stream_early_closes_a_stream_object_that_is_not_a_generator() -> None:
    """A model's stream object with ``aclose()`` (an SDK's stream wrapper) is closed on an early exit.

    Only async generators were closed; such an object was left open, its
    connection to the garbage collector.
    """
    log: list[str] = []

    class Stream:
        def __init__(self) -> None:
            self.words = iter(("one ", "two ", "three"))

        def __aiter__(self) -> Stream:
            return self

        async def __anext__(self) -> str:
            try:
                return next(self.words)
            except StopIteration:
                raise StopAsyncIteration from None

        async def aclose(self) -> None:
            log.append("stream closed")

    def model(messages: list[Message]) -> Stream:
        return Stream()

    async with MemoryStore() as store:
        loop = make_loop(store)
        async with aclosing(loop.stream("t", "go", llm=model)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    break
        closed_when_the_block_returned = list(log)
    assert closed_when_the_block_returned == ["stream closed"]


async def test_a_model_that_returns_none_is_a_config_error_not_an_empty_reply() -> None:
    """``llm`` with a forgotten ``return``: a ``ConfigError`` naming ``llm``, and no reply recorded.

    ``None`` was recorded as an empty assistant reply and the run finished
    ``clean=True``; a streaming model yielding ``42`` raised a bare
    ``AttributeError``.
    """

    async def forgetful(messages: list[Message]) -> Message:
        Message.assistant("the answer")  # the return went missing
        return None  # type: ignore[return-value]

    async def numbers(messages: list[Message]) -> AsyncIterator[Any]:
        yield 42

    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError) as caught:
            await loop.run("t", "go", llm=forgetful)
        assert caught.value.key == "llm" and "did a return go missing?" in str(caught.value)
        with pytest.raises(ConfigError) as streamed:
            async with aclosing(loop.stream("u", "go", llm=numbers)) as events:
                async for _ in events:
                    pass
        assert streamed.value.key == "llm" and "42" in str(streamed.value)
        assert [m.text for m in await loop.compactor.context("t")] == ["go"]
        log = [record async for record in store.replay("t")]
    assert not any(isinstance(record.episode, LlmCallEpisode | RunCompletedEpisode) for record in log)


async def test_a_tool_returning_another_message_gives_its_call_an_error_result(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tool that returns ``Message.user(...)``: its call gets an error result, so the next request is valid.

    The user message was recorded in place of the result, and every later
    request carried call ``c1`` with no answer.
    """

    async def chatty(**_: Any) -> Message:
        return Message.user("I am not a tool result")

    model = ScriptedModel([tool_step("chatty", "{}", call_id="c1"), Message.assistant("done")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        with caplog.at_level(logging.WARNING, logger="contextfold"):
            result = await loop.run("t", "go", llm=model, tools={"chatty": chatty})
        context = await loop.compactor.context("t")
    assert result.reply.text == "done"
    answers = [m for m in context if m.role.value == "tool"]
    assert [m.tool_call_id for m in answers] == ["c1"]
    assert answers[0].metadata.get(TOOL_ERROR_METADATA_KEY) is True
    assert "returned a user message" in answers[0].text
    assert "I am not a tool result" not in [m.text for m in context]
    assert "chatty" in caplog.text


async def test_a_tool_failure_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A raising tool's exception is logged with its traceback and still becomes an error result."""

    async def explode(**_: Any) -> str:
        raise ValueError("disk on fire")

    model = ScriptedModel([tool_step("explode", "{}", call_id="x1"), Message.assistant("sorry")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        with caplog.at_level(logging.WARNING, logger="contextfold"):
            result = await loop.run("t", "go", llm=model, tools={"explode": explode})
        context = await loop.compactor.context("t")
    failures = [r for r in caplog.records if r.exc_info is not None]
    assert len(failures) == 1 and "explode" in failures[0].getMessage()
    assert failures[0].exc_info is not None and failures[0].exc_info[0] is ValueError
    assert "disk on fire" in caplog.text and "Traceback" in caplog.text
    assert result.reply.text == "sorry"
    assert [m.text for m in context if m.role.value == "tool"] == ["error: ValueError: disk on fire"]


class CountingCompactor(Compactor):
    """A real compactor that counts how often the step loop asks it for the context."""

    context_calls = 0

    async def _counted_context(self, thread: str) -> tuple[list[Message], int]:
        self.context_calls += 1
        return await super()._counted_context(thread)


async def test_a_step_sends_the_compactors_context() -> None:
    """step.messages is the compactor's context for the thread, asked for once per step."""
    async with MemoryStore() as store:
        compactor = CountingCompactor(store, options=OPTIONS, counter=ApproximateCounter())
        loop = StepLoop(compactor)
        await loop.append("t", Message.system("You are terse."), Message.user("hi"))
        async with loop.step("t") as step:
            assert compactor.context_calls == 1
            sent = step.messages
            await step.record(Message.assistant("hello"))
        after = await compactor.context("t")
    assert [m.text for m in sent] == ["You are terse.", "hi"]
    assert step.request_tokens == sum(ApproximateCounter().count(m) for m in sent)
    assert [m.text for m in after] == ["You are terse.", "hi", "hello"]


async def test_a_sync_tool_is_refused_before_the_run_starts() -> None:
    """A plain-def tool is a ConfigError naming it, before anything is recorded or the model is called.

    It used to reach the model as the result "error: TypeError: object str can't be used in 'await'".
    """

    def ls() -> str:
        return "a.txt"

    model = ScriptedModel([tool_step("ls", "{}", call_id="s1"), Message.assistant("done")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError) as info:
            await loop.run("t", "hi", llm=model, tools={"ls": ls})
        recorded = (await store.stats("t")).message_count
    assert info.value.key == "tools['ls']" and info.value.value is ls
    assert "is not async" in info.value.reason and "async def ls(...)" in info.value.reason
    assert model.calls == 0 and recorded == 0


async def test_a_sync_tool_in_a_list_is_refused_by_name_in_stream_too() -> None:
    def ls() -> str:
        return "a.txt"

    model = ScriptedModel([Message.assistant("done")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError) as info:
            [e async for e in loop.stream("t", "hi", llm=model.stream, tools=[fetch, ls])]
    assert info.value.key == "tools['ls']" and info.value.value is ls
    assert model.calls == 0


async def test_a_lambda_tool_is_run_when_it_returns_a_coroutine_and_refused_when_it_does_not() -> None:
    """Python has no async lambda: a lambda's result is checked when called; a bare value names the tool."""
    model = ScriptedModel(agent)
    async with MemoryStore() as store:
        loop = make_loop(store)
        result = await loop.run("ok", "hi", llm=model, tools={"fetch": lambda url: fetch(url)})
        assert result.reply.text.startswith("answered")
        sync_lambda = lambda url: "payload"  # noqa: E731
        with pytest.raises(ConfigError) as info:
            await loop.run("bad", "hi", llm=ScriptedModel(agent), tools={"fetch": sync_lambda})
        context = await loop.compactor.context("bad")
    assert info.value.key == "tools['fetch']" and info.value.value is sync_lambda
    assert "returned a str rather than an awaitable" in info.value.reason
    # The model never got the bare value as a result; the call is answered with the step's failure.
    assert [(m.role.value, m.text) for m in context if m.role.value == "tool"] == [
        ("tool", "error: interrupted: the step stopped on ConfigError before this tool returned")
    ]


async def test_a_tool_called_with_arguments_it_does_not_take_is_still_an_error_result() -> None:
    """A TypeError from the call itself (the model's arguments) reaches the model, as before."""
    calls = [ToolCall(id="x1", name="fetch", arguments='{"uri": "u"}')]
    model = ScriptedModel([Message.assistant(None, tool_calls=calls), Message.assistant("sorry")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        events = [e async for e in loop.stream("t", "go", llm=model.stream, tools={"fetch": fetch})]
    [finished] = [e.result for e in events if isinstance(e, ToolFinished)]
    assert finished.text.startswith("error: TypeError:") and "uri" in finished.text


async def test_a_sync_llm_is_refused_before_the_run_starts() -> None:
    """A plain-def llm is a ConfigError naming llm and the fix, not a raw TypeError at the first call."""

    def llm(messages: list[Message]) -> Message:
        return Message.assistant("sync reply")

    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError) as info:
            await loop.run("t", "hi", llm=llm)  # type: ignore[arg-type]
        recorded = (await store.stats("t")).message_count
    assert info.value.key == "llm" and info.value.value is llm
    assert "is not async" in info.value.reason and "async def llm(messages)" in info.value.reason
    assert recorded == 0


async def test_run_and_stream_each_refuse_the_others_model() -> None:
    """run() given llm.stream, or stream() given the blocking llm, says which one to use."""
    model = ScriptedModel([Message.assistant("hello")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError) as to_run:
            await loop.run("t", "hi", llm=model.stream)  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as to_stream:
            [e async for e in loop.stream("t", "hi", llm=model)]  # type: ignore[arg-type]
        recorded = (await store.stats("t")).message_count
    assert to_run.value.key == "llm" and "pass it to loop.stream(...)" in to_run.value.reason
    assert to_stream.value.key == "llm" and "call loop.run(...) with this one" in to_stream.value.reason
    assert model.calls == 0 and recorded == 0


async def test_a_lambda_llm_works_and_a_stream_from_a_plain_def_works() -> None:
    """A lambda returning a coroutine is a blocking llm; a def returning an async iterator a streaming one."""
    model = ScriptedModel([Message.assistant("hello"), Message.assistant("streamed")], chunk_size=4)

    def streaming(messages: list[Message]) -> AsyncIterator[str | ToolCall]:
        return model.stream(messages)

    async with MemoryStore() as store:
        loop = make_loop(store)
        result = await loop.run("t", "hi", llm=lambda messages: model(messages))
        events = [e async for e in loop.stream("t", "again", llm=streaming)]
        with pytest.raises(ConfigError) as info:
            await loop.run("t", "more", llm=lambda messages: Message.assistant("no"))  # type: ignore[arg-type,return-value]
    assert result.reply.text == "hello"
    assert isinstance(events[-1], RunFinished) and events[-1].reply.text == "streamed"
    assert info.value.key == "llm" and "returned a Message rather than an awaitable" in info.value.reason


async def test_tools_given_as_a_list_like_chat_llm_takes_them_run_by_name() -> None:
    """loop.run accepts the list of functions chat_llm accepts, each tool named as chat_llm names it."""
    from contextfold.integrations._tools import tool_specs

    async def grep(pattern: str) -> str:
        return f"no match for {pattern}"

    tools = [fetch, grep]
    calls = [
        ToolCall(id="a", name="fetch", arguments='{"url": "u"}'),
        ToolCall(id="b", name="grep", arguments='{"pattern": "x"}'),
    ]
    model = ScriptedModel([Message.assistant(None, tool_calls=calls), Message.assistant("done")])
    async with MemoryStore() as store:
        loop = make_loop(store)
        result = await loop.run("t", "hi", llm=model, tools=tools)
        context = await loop.compactor.context("t")
    results = [m for m in context if m.role.value == "tool"]
    assert result.reply.text == "done"
    assert [m.text.splitlines()[0] for m in results] == ["u", "no match for x"]
    assert [spec.name for spec in tool_specs(tools)] == ["fetch", "grep"]


async def named_fetch(url: str) -> str:
    return url


named_fetch.__name__ = "fetch"


WHOLE: Callable[[Any], Any] = lambda tools: tools  # noqa: E731
FIRST: Callable[[Any], Any] = lambda tools: tools[0]  # noqa: E731
SECOND: Callable[[Any], Any] = lambda tools: tools[1]  # noqa: E731


@pytest.mark.parametrize(
    ("tools", "key", "entry", "why"),
    [
        ("fetch", "tools", WHOLE, "or a list of async functions, not a str"),
        ([{"type": "function", "function": {"name": "fetch"}}], "tools[0]", FIRST, "is a tool schema"),
        ([fetch, partial(fetch, "u")], "tools[1]", SECOND, "has no name of its own"),
        ([fetch, lambda url: fetch(url)], "tools[1]", SECOND, "has no name of its own"),
        ([fetch, named_fetch], "tools[1]", SECOND, "is named 'fetch' like another tool"),
        ([fetch, "grep"], "tools[1]", SECOND, "must be an async function"),
        ({"fetch": "fetch"}, "tools['fetch']", lambda tools: tools["fetch"], "must be an async function"),
    ],
    ids=["str", "schema", "partial", "lambda", "duplicate", "not-callable", "mapping-of-str"],
)
async def test_tools_that_cannot_be_run_by_name_are_refused_naming_the_entry(
    tools: Any, key: str, entry: Callable[[Any], Any], why: str
) -> None:
    """A ConfigError names the entry (or tools itself), shows its value and says why, before the run."""
    async with MemoryStore() as store:
        loop = make_loop(store)
        with pytest.raises(ConfigError) as info:
            await loop.run("t", "hi", llm=ScriptedModel([Message.assistant("x")]), tools=tools)
        recorded = (await store.stats("t")).message_count
    assert info.value.key == key and info.value.value is entry(tools) and why in info.value.reason
    assert recorded == 0


BACKGROUND = RunOptions(
    max_history_tokens=8_000,
    compaction=SummarizeOptions(
        trigger_token_budget=2_000, max_summary_tokens=100, min_recent_messages=2, background_at=0.6
    ),
)


def background_compactor(store: MemoryStore, seen: list[CompactionEvent], gate: anyio.Event) -> Compactor:
    """A compactor that folds in the background, its summarizer held at ``gate``."""

    async def summarize(messages: list[Message], previous: str | None, limit: int) -> str:
        await gate.wait()
        return f"{len(messages)} messages"

    return Compactor(
        store,
        options=BACKGROUND,
        summarizer=FunctionSummarizer(summarize),
        counter=ApproximateCounter(),
        subscribers=[seen.append],
        log_events=False,
    )


async def step_past_background_at(loop: StepLoop, seen: list[CompactionEvent]) -> None:
    """Take steps until one starts a background summary (at its check, before the request), and it began."""
    with anyio.fail_after(10):
        while not seen:
            async with loop.step("t") as step:
                await step.record(Message.user("word " * 150))
            await anyio.wait_all_tasks_blocked()  # a summary started by this step's check began by now
    assert [type(e) for e in seen] == [BackgroundSummaryStarted]


async def test_a_step_loops_block_owns_its_compactors_background_folds() -> None:
    """'async with StepLoop(compactor)' enters the compactor; leaving it cancels the summary under way.

    Before, 'async with StepLoop(...)' raised TypeError, so a loop could not own the background folds.
    """
    seen: list[CompactionEvent] = []
    async with MemoryStore() as store:
        async with StepLoop(background_compactor(store, seen, anyio.Event())) as loop:
            await step_past_background_at(loop, seen)
        assert [type(e) for e in seen] == [BackgroundSummaryStarted, BackgroundSummaryDiscarded]
        assert isinstance(seen[1], BackgroundSummaryDiscarded) and seen[1].cause == "closed"
        assert [r async for r in store.replay("t") if isinstance(r.episode, SummaryCheckpoint)] == []


async def test_a_compactor_entered_by_its_owner_outlives_the_step_loops_block() -> None:
    """A compactor entered around the loop is left open by the loop's block: its background fold goes on."""
    seen: list[CompactionEvent] = []
    gate = anyio.Event()
    async with MemoryStore() as store:
        compactor = background_compactor(store, seen, gate)
        async with compactor:
            async with StepLoop(compactor) as loop, loop:  # nested blocks of one loop enter nothing either
                await step_past_background_at(loop, seen)
            gate.set()
            with anyio.fail_after(10):
                while (result := await compactor.maybe_compact("t")) is None:
                    await anyio.wait_all_tasks_blocked()
        assert result.background and result.compacted
        assert [type(e) for e in seen] == [BackgroundSummaryStarted, BackgroundSummaryApplied]
