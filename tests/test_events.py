"""Compaction events: their types, the dispatcher, the hook adapter and the log lines."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold._compactor import CompactionResult, Compactor
from contextfold._config import RunOptions, SummarizeOptions
from contextfold._episodes import SummaryCheckpoint, Usage
from contextfold._errors import ConfigError, SummarizerError
from contextfold._events import (
    LOG_KEYS,
    BackgroundSummaryApplied,
    BackgroundSummaryDiscarded,
    BackgroundSummaryStarted,
    CompactionEvent,
    CompactionEventHook,
    EventDispatcher,
    FoldApplied,
    FoldConflict,
    FoldStalled,
    SummaryDegraded,
    event_line,
    hook_subscriber,
    log_event,
)
from contextfold._loop import Hook, StepLoop
from contextfold._messages import Message
from contextfold._telemetry import Telemetry
from contextfold._tokens import ApproximateCounter
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer, Summary

COMMON = {"thread": "t-1", "reason": "token_count", "tokens_before": 900, "tokens_after": 250}


def applied(**overrides: object) -> FoldApplied:
    fields = {
        **COMMON,
        "messages_folded": 12,
        "summarizer_model": "recorder",
        "usage": Usage(input_tokens=700, output_tokens=80),
        "duration_s": 0.25,
        "checkpoint_seq": 41,
        "through_seq": 17,
        **overrides,
    }
    return FoldApplied(**fields)  # type: ignore[arg-type]


def one_of_each() -> list[CompactionEvent]:
    return [
        BackgroundSummaryStarted(**COMMON, messages_folded=12, through_seq=17),
        SummaryDegraded(
            **COMMON,
            messages_folded=12,
            summarizer_model="gpt-x",
            fallback_model="extractive",
            error_type="contextfold.SummarizerError",
            error="HTTP 503",
        ),
        applied(degraded=True),
        BackgroundSummaryApplied(**COMMON, messages_folded=12, waited_s=0.5),
        FoldStalled(
            **{**COMMON, "tokens_after": 900}, detail="the kept tail alone is too big", skipped_checks=3
        ),
        FoldConflict(**{**COMMON, "tokens_after": 900}),
        BackgroundSummaryDiscarded(**{**COMMON, "tokens_after": 900}, cause="prefix_changed", through_seq=17),
    ]


def parse_line(line: str) -> tuple[str, dict[str, object]]:
    """Split a log line back into its name and its JSON-literal values."""
    name, _, rest = line.partition(" ")
    values: dict[str, object] = {}
    decoder = json.JSONDecoder()
    while rest:
        key, _, rest = rest.partition("=")
        value, end = decoder.raw_decode(rest)
        values[key] = value
        rest = rest[end:].removeprefix(" ")
    return name, values


def test_events_are_frozen_and_slotted() -> None:
    """An event cannot be changed after it was emitted, and carries no per-instance dict."""
    for event in one_of_each():
        with pytest.raises(dataclasses.FrozenInstanceError):
            event.thread = "other"  # type: ignore[misc]
        assert not hasattr(event, "__dict__")


def test_every_event_carries_the_common_figures() -> None:
    """Each event names thread, reason, tokens before and after, messages folded, model, usage, duration."""
    common = ("thread", "reason", "tokens_before", "tokens_after", "messages_folded")
    common += ("summarizer_model", "usage", "duration_s")
    for event in one_of_each():
        names = [f.name for f in dataclasses.fields(event)]
        assert tuple(names[: len(common)]) == common, type(event).__name__


def test_background_fold_is_a_fold() -> None:
    """A fold applied from a background summary matches ``FoldApplied``, so fold counters see it once."""
    event = BackgroundSummaryApplied(**COMMON, messages_folded=3, waited_s=0.1)
    assert isinstance(event, FoldApplied)
    assert event.name == "background_applied"
    assert event.tokens_saved == 650


async def test_subscribers_receive_events_in_registration_order() -> None:
    """Sync and async subscribers get every event, in the order they subscribed."""
    seen: list[tuple[str, str]] = []

    def first(event: CompactionEvent) -> None:
        seen.append(("first", event.name))

    async def second(event: CompactionEvent) -> None:
        seen.append(("second", event.name))

    def third(event: CompactionEvent) -> None:
        seen.append(("third", event.name))

    dispatcher = EventDispatcher([first, second], log_events=False)
    dispatcher.subscribe(third)
    await dispatcher.emit(applied())
    await dispatcher.emit(FoldStalled(**COMMON, detail="x"))
    assert seen == [
        ("first", "fold"),
        ("second", "fold"),
        ("third", "fold"),
        ("first", "fold_stalled"),
        ("second", "fold_stalled"),
        ("third", "fold_stalled"),
    ]


async def test_failing_subscriber_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subscriber that raises is logged with its traceback; emit returns and later subscribers run."""
    later: list[CompactionEvent] = []

    async def broken(event: CompactionEvent) -> None:
        raise RuntimeError("exporter down")

    dispatcher = EventDispatcher([broken, later.append], log_events=False)
    event = applied()
    with caplog.at_level(logging.ERROR, logger="contextfold.events"):
        await dispatcher.emit(event)
    assert later == [event]
    [record] = [r for r in caplog.records if r.name == "contextfold.events"]
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    assert "broken" in record.getMessage() and "'t-1'" in record.getMessage()


async def test_cancellation_in_a_subscriber_propagates() -> None:
    """A BaseException such as a cancellation is not swallowed by the dispatcher."""

    class Stop(BaseException):
        pass

    def cancel(event: CompactionEvent) -> None:
        raise Stop

    later: list[CompactionEvent] = []
    dispatcher = EventDispatcher([cancel, later.append], log_events=False)
    with pytest.raises(Stop):
        await dispatcher.emit(applied())
    assert later == []


async def test_unsubscribe_stops_delivery_even_during_an_emit() -> None:
    """A subscriber may unsubscribe itself while an event is delivered; the others still get that event."""
    seen: list[str] = []

    def once(event: CompactionEvent) -> None:
        seen.append("once")
        remove()

    dispatcher = EventDispatcher(log_events=False)
    remove = dispatcher.subscribe(once)
    dispatcher.subscribe(lambda event: seen.append("always"))
    await dispatcher.emit(applied())
    await dispatcher.emit(applied())
    assert seen == ["once", "always", "always"]
    remove()  # a second removal is harmless
    assert len(dispatcher.subscribers) == 1


def test_subscribing_a_non_callable_names_the_fix() -> None:
    """Subscribing something that cannot be called fails at once with a ConfigError on ``subscriber``."""
    with pytest.raises(ConfigError) as caught:
        EventDispatcher(["print"], log_events=False)  # type: ignore[list-item]
    assert caught.value.key == "subscriber"
    assert "'print'" in str(caught.value) and "callable" in str(caught.value)


class Observer(Hook):
    """A step-loop hook that also watches compactions."""

    optional = True

    def __init__(self) -> None:
        self.events: list[CompactionEvent] = []

    async def on_compaction_event(self, event: CompactionEvent) -> None:
        self.events.append(event)


async def test_a_step_loop_hook_receives_events_through_the_adapter() -> None:
    """``hook_subscriber`` hands each event to the hook's ``on_compaction_event``, in order."""
    hook = Observer()
    assert isinstance(hook, CompactionEventHook)
    dispatcher = EventDispatcher([hook_subscriber(hook)], log_events=False)
    events = one_of_each()
    for event in events:
        await dispatcher.emit(event)
    assert hook.events == events


def test_log_line_keys_are_stable() -> None:
    """The fold line's keys are the documented ones, in the documented order."""
    assert LOG_KEYS["fold"] == (
        "thread",
        "reason",
        "tokens_before",
        "tokens_after",
        "messages_folded",
        "summarizer_model",
        "input_tokens",
        "output_tokens",
        "duration_s",
        "degraded",
        "masked_messages",
        "truncated_messages",
        "checkpoint_seq",
        "through_seq",
    )
    assert LOG_KEYS["fold_stalled"][-2:] == ("detail", "skipped_checks")
    assert set(LOG_KEYS) == {event.name for event in one_of_each()}


def test_log_line_is_name_then_json_values_in_key_order() -> None:
    """Every event renders as its name and one ``key=<JSON literal>`` per documented key."""
    for event in one_of_each():
        name, values = parse_line(event_line(event))
        assert name == event.name
        assert tuple(values) == LOG_KEYS[event.name]
        assert values["thread"] == "t-1" and values["tokens_before"] == 900
    line = event_line(applied())
    assert line.startswith('fold thread="t-1" reason="token_count" tokens_before=900 tokens_after=250 ')
    assert " input_tokens=700 output_tokens=80 duration_s=0.250 degraded=false " in line


def test_log_line_stays_one_line_whatever_the_thread_id_holds() -> None:
    """Quotes, spaces and newlines in a value are escaped, so an event is always exactly one line."""
    thread = 'user "7"\nsession = 2'
    line = event_line(FoldStalled(**{**COMMON, "thread": thread}, detail="raise the budget\nor not"))
    assert "\n" not in line
    assert parse_line(line)[1]["thread"] == thread


async def test_default_dispatcher_logs_each_event_exactly_once(caplog: pytest.LogCaptureFixture) -> None:
    """With the default subscriber every event becomes one record on ``contextfold.compactor``."""
    dispatcher = EventDispatcher()
    events = one_of_each()
    with caplog.at_level(logging.DEBUG, logger="contextfold"):
        for event in events:
            await dispatcher.emit(event)
    records = [r for r in caplog.records if r.name.startswith("contextfold")]
    assert [r.name for r in records] == ["contextfold.compactor"] * len(events)
    assert [r.getMessage() for r in records] == [event_line(e) for e in events]
    assert [r.contextfold_event for r in records] == events  # type: ignore[attr-defined]


def test_log_levels_follow_what_needs_attention(caplog: pytest.LogCaptureFixture) -> None:
    """Stalls, degraded summaries and a failed background summary are warnings; a conflict is not."""
    events: list[CompactionEvent] = [
        *one_of_each(),
        BackgroundSummaryDiscarded(**COMMON, cause="summarizer_failed", error="timeout"),
    ]
    with caplog.at_level(logging.DEBUG, logger="contextfold.compactor"):
        for event in events:
            log_event(event)
    levels = {re.sub(r" .*", "", r.getMessage()) + f"/{r.levelname}" for r in caplog.records}
    assert levels == {
        "background_started/DEBUG",
        "summary_degraded/WARNING",
        "fold/INFO",
        "background_applied/INFO",
        "fold_stalled/WARNING",
        "fold_conflict/INFO",
        "background_discarded/INFO",
        "background_discarded/WARNING",
    }


async def test_without_the_log_subscriber_nothing_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """``log_events=False`` leaves logging to the caller: no record is written."""
    with caplog.at_level(logging.DEBUG, logger="contextfold"):
        await EventDispatcher(log_events=False).emit(applied())
    assert [r for r in caplog.records if r.name.startswith("contextfold")] == []


# The compactor's side: what a real Compactor emits.

THREAD = "t-1"


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    async with MemoryStore() as backend:
        yield backend


def fold_options(budget: int = 400, on_summarizer_error: Any = "fallback") -> RunOptions:
    compaction = SummarizeOptions(
        trigger_token_budget=budget,
        max_summary_tokens=min(60, budget // 4),
        min_recent_messages=2,
        on_summarizer_error=on_summarizer_error,
    )
    return RunOptions(max_history_tokens=budget * 2, compaction=compaction)


def counting_summarizer(model: str = "recorder") -> FunctionSummarizer:
    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> Summary:
        return Summary(text=f"{len(messages)} messages", model=f"{model}-1", usage=Usage(input_tokens=99))

    return FunctionSummarizer(summarize, model=model)


def wired_compactor(store: Any, seen: list[CompactionEvent], **overrides: Any) -> Compactor:
    settings: dict[str, Any] = {
        "options": fold_options(),
        "summarizer": counting_summarizer(),
        "counter": ApproximateCounter(),
        "subscribers": [seen.append],
        "telemetry": Telemetry.disabled(),
        **overrides,
    }
    return Compactor(store, **settings)


async def fill(compactor: Compactor, count: int = 8) -> None:
    for n in range(count):
        await compactor.append(THREAD, [Message.user(f"task {n}: " + "word " * 40)])


async def test_a_fold_emits_one_event_matching_the_context_it_left(store: MemoryStore) -> None:
    """``maybe_compact`` emits one FoldApplied with the figures of the stored context and checkpoint."""
    seen: list[CompactionEvent] = []
    compactor = wired_compactor(store, seen)
    await fill(compactor)
    before = await store.stats(THREAD)
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    [event] = seen
    assert type(event) is FoldApplied
    after = await store.stats(THREAD)
    assert (event.tokens_before, event.tokens_after) == (before.total_tokens, after.total_tokens)
    assert event.messages_folded == before.message_count - after.message_count + 1
    assert (event.summarizer_model, event.usage) == ("recorder-1", Usage(input_tokens=99))
    checkpoints = [r async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)]
    assert [c.seq for c in checkpoints] == [event.checkpoint_seq]
    assert (await compactor.context(THREAD))[0].text.endswith(f"{event.messages_folded} messages")


async def test_a_stall_is_one_event_and_one_log_line(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A fold with nothing to fold emits one FoldStalled, and the stall is logged exactly once."""
    seen: list[CompactionEvent] = []
    compactor = wired_compactor(store, seen, options=fold_options(budget=40, on_summarizer_error="raise"))
    await fill(compactor, count=1)
    with caplog.at_level(logging.DEBUG, logger="contextfold"):
        result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled
    [event] = seen
    assert isinstance(event, FoldStalled) and event.detail == result.detail
    assert event.tokens_after == event.tokens_before == (await store.stats(THREAD)).total_tokens
    mentions = [r for r in caplog.records if "nothing can be folded" in r.getMessage()]
    assert [r.getMessage() for r in mentions] == [event_line(event)]


async def test_a_failing_summarizer_emits_degraded_then_the_fold(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """With the fallback, a summarizer error is a SummaryDegraded naming the error, then a degraded fold."""

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise TimeoutError("provider timed out")

    seen: list[CompactionEvent] = []
    compactor = wired_compactor(store, seen, summarizer=FunctionSummarizer(broken, model="gpt-x"))
    await fill(compactor)
    with caplog.at_level(logging.DEBUG, logger="contextfold"):
        result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.degraded
    mentions = [r.getMessage() for r in caplog.records if "provider timed out" in r.getMessage()]
    assert mentions == [event_line(seen[0])]
    degraded, fold = seen
    assert isinstance(degraded, SummaryDegraded) and isinstance(fold, FoldApplied)
    assert (degraded.summarizer_model, degraded.error_type) == ("gpt-x", "TimeoutError")
    assert degraded.error == "provider timed out"
    assert degraded.fallback_model == fold.summarizer_model == result.summarizer_model
    assert fold.degraded and fold.tokens_after == (await store.stats(THREAD)).total_tokens


async def test_a_skipped_summary_is_one_stall_naming_the_error(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``on_summarizer_error="skip"`` a summarizer error is one FoldStalled, logged once, naming it."""

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise TimeoutError("provider timed out")

    options = fold_options()
    assert options.compaction is not None
    options = options.model_copy(
        update={"compaction": options.compaction.model_copy(update={"on_summarizer_error": "skip"})}
    )
    seen: list[CompactionEvent] = []
    compactor = wired_compactor(store, seen, options=options, summarizer=FunctionSummarizer(broken))
    await fill(compactor)
    before = await store.stats(THREAD)
    with caplog.at_level(logging.DEBUG, logger="contextfold"):
        result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled
    [event] = seen
    assert isinstance(event, FoldStalled) and "TimeoutError: provider timed out" in event.detail
    assert await store.stats(THREAD) == before
    mentions = [r for r in caplog.records if "provider timed out" in r.getMessage()]
    assert [r.getMessage() for r in mentions] == [event_line(event)]


async def test_a_conflicting_fold_is_one_discard_and_writes_nothing(store: MemoryStore) -> None:
    """A fold whose thread changed underneath is reported discarded with its cost, and nothing is folded."""

    async def interfering(messages: Sequence[Message], previous: str | None, limit: int) -> Summary:
        # Another worker rewrites the thread while this summary is computed.
        window = await store.load(THREAD)
        first = window.messages[0]
        await store.replace_prefix(
            THREAD,
            through_seq=first.seq,
            expected_version=window.version,
            replacement=[first.message],
            tokens=[first.tokens],
        )
        return Summary(text="lost", model="recorder-1", usage=Usage(input_tokens=77))

    seen: list[CompactionEvent] = []
    compactor = wired_compactor(store, seen, summarizer=FunctionSummarizer(interfering))
    await fill(compactor)
    before = await store.stats(THREAD)
    assert await compactor.maybe_compact(THREAD) is None
    [conflict] = seen
    assert isinstance(conflict, FoldConflict) and conflict.cause == "conflict"
    assert conflict.tokens_after == conflict.tokens_before == before.total_tokens
    assert conflict.messages_folded > 0 and conflict.usage == Usage(input_tokens=77)
    after = await store.stats(THREAD)
    assert (after.message_count, after.total_tokens) == (before.message_count, before.total_tokens)
    assert [r async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)] == []


async def test_a_step_loop_hook_receives_the_compactors_events(store: MemoryStore) -> None:
    """A StepLoop hook with ``on_compaction_event`` is given the fold its step triggered."""
    hook = Observer()
    compactor = wired_compactor(store, [])
    loop = StepLoop(compactor, hooks=[hook])
    await fill(compactor)
    async with loop.step(THREAD) as step:
        assert step.compaction is not None and step.compaction.compacted
    [event] = hook.events
    assert isinstance(event, FoldApplied) and event.tokens_after == step.compaction.tokens_after


async def test_a_hook_shared_by_two_loops_receives_each_event_once(store: MemoryStore) -> None:
    """Two loops sharing one compactor and one hook: each fold reaches the hook once, not once per loop."""
    hook, other = Observer(), Observer()
    compactor = wired_compactor(store, [])
    first = StepLoop(compactor, hooks=[hook])
    second = StepLoop(compactor, hooks=[hook, other])
    await fill(compactor)
    async with first.step(THREAD) as step:
        assert step.compaction is not None and step.compaction.compacted
    [event] = hook.events
    assert isinstance(event, FoldApplied) and event.tokens_after == step.compaction.tokens_after
    assert other.events == [event]
    assert second.hooks[1:] == (hook, other)


async def test_a_loop_that_is_gone_leaves_no_hook_behind_on_a_long_lived_compactor(
    store: MemoryStore,
) -> None:
    """A loop built per request: the earlier requests' hooks no longer receive the compactor's events."""
    compactor = wired_compactor(store, [])
    earlier = Observer()
    StepLoop(compactor, hooks=[earlier])  # a request that ended: nothing refers to its loop
    gc.collect()
    current = Observer()
    loop = StepLoop(compactor, hooks=[current])
    await fill(compactor)
    async with loop.step(THREAD) as step:
        assert step.compaction is not None and step.compaction.compacted
    assert len(current.events) == 1
    assert earlier.events == []


def test_the_cli_says_a_stall_once(tmp_path: Path) -> None:
    """``contextfold compact`` on a thread with nothing to fold says so once, not again as a warning."""

    async def seed() -> None:
        async with SQLiteStore(tmp_path / "cf.db") as backend:
            await Compactor(backend, options=fold_options()).append(THREAD, [Message.user("hello " * 50)])

    anyio.run(seed)
    cli = "from contextfold.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", cli, "compact", str(tmp_path / "cf.db"), THREAD],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout  # a stall is a failure the exit status reports
    output = " ".join((done.stdout + done.stderr).split())
    assert output.count("nothing to fold") == 1  # the CLI's own line, and no log warning besides
    assert "nothing can be folded" not in output and "WARNING" not in output


def background_options(**overrides: Any) -> RunOptions:
    chosen: dict[str, Any] = {"max_summary_tokens": 100, "min_recent_messages": 2, "background_at": 0.6}
    compaction = SummarizeOptions(trigger_token_budget=2_000, **{**chosen, **overrides})
    return RunOptions(max_history_tokens=8_000, compaction=compaction)


def gated_summarizer(gate: anyio.Event, started: anyio.Event) -> FunctionSummarizer:
    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> Summary:
        started.set()
        await gate.wait()
        return Summary(text=f"{len(messages)} messages", model="recorder-1", usage=Usage(input_tokens=5))

    return FunctionSummarizer(summarize, model="recorder")


async def start_background_summary(
    compactor: Compactor, seen: list[CompactionEvent], started: anyio.Event
) -> None:
    """Step until a step starts the background summary, then wait until it reaches the summarizer.

    No step is taken after that one: while the summary's task makes its way to
    the gated summarizer (it takes turns with the steps in a crowded loop), a
    few more steps could reach the hard trigger, and that step would wait for
    a summary held at a gate the test opens only afterwards.
    """
    await cross_background_at(compactor, 0.6)
    with anyio.fail_after(10):
        await started.wait()
    assert [type(e) for e in seen] == [BackgroundSummaryStarted]  # emitted as the summary began


async def cross_background_at(compactor: Compactor, background_at: float) -> None:
    """Append and check until the context is past ``background_at``: the check that crosses it starts it."""
    while (await compactor.context_tokens(THREAD))[1] <= background_at * 2_000:
        await compactor.append(THREAD, [Message.user("word " * 150)])
        assert await compactor.maybe_compact(THREAD) is None


async def test_a_background_summary_is_started_then_applied_as_a_fold(store: MemoryStore) -> None:
    """Crossing background_at emits BackgroundSummaryStarted; the fold that applies it is one FoldApplied."""
    gate, started = anyio.Event(), anyio.Event()
    seen: list[CompactionEvent] = []
    settings = {"options": background_options(), "summarizer": gated_summarizer(gate, started)}
    async with wired_compactor(store, seen, **settings) as compactor:
        await start_background_summary(compactor, seen, started)
        [begun] = seen
        assert isinstance(begun, BackgroundSummaryStarted) and begun.thread == THREAD
        gate.set()
        result = None
        while result is None:  # applied as soon as it is ready, or waited for at the hard trigger
            await compactor.append(THREAD, [Message.user("word " * 150)])
            result = await compactor.maybe_compact(THREAD)
    event, *later = seen[1:]
    assert type(event) is BackgroundSummaryApplied
    if later:  # the appends kept the context past background_at: the step that took it began the next
        begun_next, *ended = later
        assert type(begun_next) is BackgroundSummaryStarted and len(ended) <= 1
        assert all(type(e) in (BackgroundSummaryApplied, BackgroundSummaryDiscarded) for e in ended)
    assert isinstance(event, FoldApplied) and result.background
    assert event.tokens_after == result.tokens_after and event.checkpoint_seq == result.checkpoint_seq
    assert (await compactor.context(THREAD))[0].text.endswith(f"{event.messages_folded} messages")


async def test_a_background_summary_unapplied_at_close_is_discarded(store: MemoryStore) -> None:
    """Closing the compactor while its background summary runs emits a BackgroundSummaryDiscarded, closed."""
    gate, started = anyio.Event(), anyio.Event()
    seen: list[CompactionEvent] = []
    settings = {"options": background_options(), "summarizer": gated_summarizer(gate, started)}
    async with wired_compactor(store, seen, **settings) as compactor:
        await start_background_summary(compactor, seen, started)
    begun, discarded = seen
    assert isinstance(begun, BackgroundSummaryStarted)
    assert isinstance(discarded, BackgroundSummaryDiscarded) and discarded.cause == "closed"
    assert [r async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)] == []


@pytest.mark.parametrize("on_error", ["raise", "skip"])
async def test_a_failed_background_summary_is_discarded_naming_the_error(
    store: MemoryStore, on_error: str
) -> None:
    """A failed background summary is one BackgroundSummaryDiscarded, summarizer_failed, with its error.

    Before, the events stopped at BackgroundSummaryStarted.
    """

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> Summary:
        raise SummarizerError("provider down")

    seen: list[CompactionEvent] = []
    settings = {
        "options": background_options(on_summarizer_error=on_error),
        "summarizer": FunctionSummarizer(broken, model="flaky"),
    }
    async with wired_compactor(store, seen, **settings) as compactor:
        await cross_background_at(compactor, 0.6)
        await anyio.wait_all_tasks_blocked()  # the background summary failed by now
        if on_error == "raise":
            with pytest.raises(SummarizerError, match="provider down"):
                await compactor.maybe_compact(THREAD)
        else:
            result = await compactor.maybe_compact(THREAD)
            assert result is not None and result.stalled and "provider down" in result.detail
    stalled = [FoldStalled] if on_error == "skip" else []
    assert [type(e) for e in seen] == [BackgroundSummaryStarted, BackgroundSummaryDiscarded, *stalled]
    begun, discarded, *_ = seen
    assert isinstance(begun, BackgroundSummaryStarted) and begun.summarizer_model == "flaky"
    assert isinstance(discarded, BackgroundSummaryDiscarded)
    assert (discarded.cause, discarded.error) == ("summarizer_failed", "provider down")
    assert discarded.through_seq == begun.through_seq is not None
    assert discarded.messages_folded == begun.messages_folded > 0
    assert discarded.tokens_saved == 0
    assert [r async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)] == []


async def test_a_step_that_stopped_waiting_stops_counting_in_waited_s(store: MemoryStore) -> None:
    """A step cancelled 0.1 s into its wait, and the summary done 0.6 s later: ``waited_s`` is the 0.1 s.

    The wait's start was kept when the step gave up, so the fold reported
    every second until it was applied as time a step had waited.
    """
    gate, started = anyio.Event(), anyio.Event()
    seen: list[CompactionEvent] = []
    options = background_options(background_at=0.9)
    settings = {"options": options, "summarizer": gated_summarizer(gate, started)}
    async with wired_compactor(store, seen, **settings) as compactor:
        await cross_background_at(compactor, 0.9)
        with anyio.fail_after(10):
            await started.wait()
        while (await compactor.context_tokens(THREAD))[1] <= 2_000:  # past the hard trigger
            await compactor.append(THREAD, [Message.user("word " * 150)])
        began = time.perf_counter()
        with anyio.move_on_after(0.1):  # the step waits at the hard trigger, then is cancelled
            await compactor.maybe_compact(THREAD)
        gave_up = time.perf_counter() - began
        await anyio.sleep(0.6)  # no step waits meanwhile
        gate.set()
        with anyio.fail_after(10):
            while not any(isinstance(e, BackgroundSummaryApplied) for e in seen):
                await anyio.sleep(0.01)
    [applied] = [e for e in seen if isinstance(e, BackgroundSummaryApplied)]
    assert 0.09 <= applied.waited_s <= gave_up


async def test_a_background_fold_reports_its_prefix_the_wait_and_what_it_removed(store: MemoryStore) -> None:
    """Started names the prefix the fold replaces; Applied, the step's wait and the context around the fold.

    Before, Started.through_seq was None, waited_s was 0.0 after a step had waited, and tokens_before was
    the context when the summary began while tokens_after counted the appends made since.
    """
    gate, started = anyio.Event(), anyio.Event()
    seen: list[CompactionEvent] = []
    # Past 0.9 of the budget, one fold brings the context back under it, appends included.
    options = background_options(background_at=0.9)
    settings = {"options": options, "summarizer": gated_summarizer(gate, started)}
    results: list[CompactionResult | None] = []
    async with wired_compactor(store, seen, **settings) as compactor:
        await cross_background_at(compactor, 0.9)
        with anyio.fail_after(10):
            await started.wait()
        while (await compactor.context_tokens(THREAD))[1] <= 2_000:  # the agent goes on meanwhile
            await compactor.append(THREAD, [Message.user("word " * 150)])
        before = (await store.stats(THREAD)).total_tokens

        async def step() -> None:
            results.append(await compactor.maybe_compact(THREAD))

        began = time.perf_counter()
        async with anyio.create_task_group() as group:
            group.start_soon(step)
            await anyio.wait_all_tasks_blocked()  # the step waits for the summary held at the gate
            gate.set()
        waited = time.perf_counter() - began
        after = (await store.stats(THREAD)).total_tokens
    [checkpoint] = [r.episode async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)]
    begun, applied = seen
    assert isinstance(begun, BackgroundSummaryStarted) and isinstance(applied, BackgroundSummaryApplied)
    assert begun.through_seq == applied.through_seq == checkpoint.through_seq
    assert begun.messages_folded == applied.messages_folded == checkpoint.dropped_messages
    assert 0 < applied.waited_s <= waited
    assert (applied.tokens_before, applied.tokens_after) == (before, after)
    assert applied.tokens_saved == checkpoint.tokens_before - checkpoint.tokens_after
    [result] = results
    assert result is not None and result.background
    assert (result.tokens_before, result.tokens_after) == (before, after)
