"""Background folding: the summary starts early, the step does not wait, nothing is lost or sent twice."""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold import (
    CompactionResult,
    Compactor,
    ConfigError,
    Message,
    RunOptions,
    SummarizeOptions,
    ToolCall,
    conversation,
)
from contextfold.episodes import SummaryCheckpoint
from contextfold.events import (
    BackgroundSummaryApplied,
    BackgroundSummaryDiscarded,
    BackgroundSummaryStarted,
    CompactionEvent,
    FoldApplied,
)
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import ApproximateCounter

THREAD = "bg"


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """Every backend: background folding works on each of them."""
    if request.param == "postgres":
        import psycopg

        from contextfold.stores import PostgresStore

        url = request.getfixturevalue("postgres_url")
        schema = f"cf_bg_{uuid.uuid4().hex[:12]}"
        async with PostgresStore(url, schema=schema) as backend:
            yield backend
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        return
    backend = MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "cf.db")
    async with backend:
        yield backend


def options(background_at: float | None = 0.6) -> RunOptions:
    return RunOptions(
        max_history_tokens=8_000,
        compaction=SummarizeOptions(
            trigger_token_budget=2_000,
            max_summary_tokens=100,
            min_recent_messages=2,
            background_at=background_at,
        ),
    )


class SlowSummarizer(FunctionSummarizer):
    """Takes ``delay`` seconds, records every message it was sent, and can be told to wait for a gate."""

    def __init__(self, delay: float) -> None:
        self.sent: list[Any] = []
        self.gate = anyio.Event()
        self.gate.set()
        self.started = anyio.Event()

        async def fn(messages: Sequence[Message], previous: str | None, limit: int) -> str:
            self.started.set()
            await self.gate.wait()
            await anyio.sleep(delay)
            self.sent.extend(m.metadata.get("n") for m in messages)
            return f"{(previous or '')[:100]} covered {len(messages)}"

        super().__init__(fn)


def turn(n: int) -> list[Message]:
    call = ToolCall(id=f"c{n}", name="read_file", arguments=json.dumps({"path": f"src/f{n}.py"}))
    return [
        Message.user(f"step {n} " + "word " * 40, metadata={"n": f"u{n}"}),
        Message.assistant(None, tool_calls=[call], metadata={"n": f"a{n}"}),
        Message.tool(call.id, "line " * 80, metadata={"n": f"r{n}"}),
    ]


BACKGROUND_TOKENS = 0.6 * 2_000
"""Where ``options()`` starts a background summary: background_at of the trigger budget."""


async def grow_until_started(
    compactor: Compactor, started: anyio.Event, *, check_within: float | None = None
) -> int:
    """Append turns, checking after each, until the background summary starts; return the turns added.

    The appends stop once the context is past ``background_at``: on a loaded
    machine more of them could reach the hard trigger before the summary's
    task first ran, and that step would wait for the summary.
    """
    n = 0
    tokens = 0
    while tokens < BACKGROUND_TOKENS:
        await compactor.append(THREAD, turn(n))
        n += 1
        with anyio.fail_after(check_within):  # when given: the check never waits for the summarizer
            assert await compactor.maybe_compact(THREAD) is None
        tokens = (await compactor.context_tokens(THREAD))[1]
    with anyio.fail_after(10):
        await started.wait()
    return n


async def step_until_applied(compactor: Compactor, *, within: float = 0.5) -> CompactionResult:
    """Check until a step returns the background fold; no check may wait for it.

    The fold can be in the store a moment before its task has handed the
    result over (on PostgreSQL the lease is released in between), and a step
    never waits for that.
    """
    with anyio.fail_after(10):
        while True:
            with anyio.fail_after(within):
                result = await compactor.maybe_compact(THREAD)
            if result is not None:
                return result
            await anyio.sleep(0.01)


async def test_the_step_does_not_wait_for_a_background_summary(store: Any) -> None:
    """Crossing background_at starts the summary in the background; a later step applies it at once."""
    summarizer = SlowSummarizer(1.0)
    async with Compactor(
        store, options=options(), summarizer=summarizer, counter=ApproximateCounter()
    ) as compactor:
        n = await grow_until_started(compactor, summarizer.started, check_within=0.5)
        with anyio.fail_after(10):
            while await store.latest_checkpoint(THREAD) is None:
                await anyio.sleep(0.01)
        await compactor.append(THREAD, turn(n))
        applied = await step_until_applied(compactor)
        assert applied is not None and applied.compacted and applied.background
        context = await compactor.context(THREAD)
        assert context[0].is_summary
        assert context[-1].metadata["n"] == f"r{n}"  # appended after the summary started, kept on top
    log = [r async for r in store.replay(THREAD)]
    assert len([r for r in log if isinstance(r.episode, SummaryCheckpoint)]) == 1
    assert len(conversation(log)) == 3 * (n + 1)


async def test_the_background_task_writes_the_fold_and_the_step_only_returns_it(store: Any) -> None:
    """The finished summary is folded in by the background task; the step that reports it writes nothing."""
    summarizer = SlowSummarizer(0.05)
    async with Compactor(
        store, options=options(), summarizer=summarizer, counter=ApproximateCounter()
    ) as compactor:
        await grow_until_started(compactor, summarizer.started)
        with anyio.fail_after(5):
            while await store.latest_checkpoint(THREAD) is None:
                await anyio.sleep(0.01)
        checkpoint = await store.latest_checkpoint(THREAD)
        context = await store.load(THREAD)
        assert context.messages[0].message.is_summary  # folded before any step asked for it
        writes: list[str] = []
        real_fold = store.fold

        async def fold(*args: Any, **kwargs: Any) -> Any:
            writes.append("fold")
            return await real_fold(*args, **kwargs)

        store.fold = fold
        try:
            result = await step_until_applied(compactor)
        finally:
            del store.fold
        assert writes == []
        assert result is not None and result.background and result.compacted
        assert result.checkpoint_seq == checkpoint.seq
        assert await compactor.context(THREAD) == [row.message for row in context.messages]
        assert await compactor.maybe_compact(THREAD) is None  # reported once


async def test_the_hard_trigger_waits_for_the_same_background_summary(store: Any) -> None:
    """Reaching the budget while the background summary runs waits for it, never starting a second one."""
    summarizer = SlowSummarizer(0.05)
    summarizer.gate = anyio.Event()
    async with Compactor(
        store, options=options(), summarizer=summarizer, counter=ApproximateCounter()
    ) as compactor:
        n = await grow_until_started(compactor, summarizer.started)
        for _ in range(6):  # well past the budget while the summarizer is held at its gate
            await compactor.append(THREAD, turn(n))
            n += 1
        with anyio.move_on_after(0.2) as waited:
            await compactor.maybe_compact(THREAD)
        assert waited.cancelled_caught  # the step waits for the summary under way
        summarizer.gate.set()
        result = await compactor.maybe_compact(THREAD)
        assert result is not None and result.compacted
    assert len(summarizer.calls) == 1 or len(summarizer.sent) == len(set(summarizer.sent))
    assert len(summarizer.sent) == len(set(summarizer.sent)), "a message was summarized twice"


async def test_leaving_the_compactor_cancels_the_background_summary_and_writes_nothing(store: Any) -> None:
    """Exiting 'async with Compactor' cancels a running summary, and nothing is written for it afterwards."""
    summarizer = SlowSummarizer(0)
    summarizer.gate = anyio.Event()  # never opened
    async with Compactor(
        store, options=options(), summarizer=summarizer, counter=ApproximateCounter()
    ) as compactor:
        await grow_until_started(compactor, summarizer.started)
        before = [r async for r in store.replay(THREAD)]
    await anyio.sleep(0.05)
    assert [r async for r in store.replay(THREAD)] == before
    assert await store.latest_checkpoint(THREAD) is None
    # The lease went with the cancelled task: another compactor folds the thread at once.
    other = Compactor(store, options=options(None), counter=ApproximateCounter())
    result = await other.compact_now(THREAD)
    assert result is not None and result.compacted


class SlowFold(MemoryStore):
    """A store whose fold takes a while: the owner closes while the fold is being written."""

    def __init__(self) -> None:
        super().__init__()
        self.folding = anyio.Event()

    async def fold(self, thread: str, **fields: Any) -> Any:
        self.folding.set()
        await anyio.sleep(0.2)
        return await super().fold(thread, **fields)


async def test_closing_while_a_background_fold_is_written_tells_every_subscriber_it_was_applied() -> None:
    """The fold is written whole, and its BackgroundSummaryApplied reaches every subscriber once, an async
    one that awaits included, and the fold counter of OpenTelemetry, which subscribes last.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from contextfold.events import Telemetry

    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    heard: list[str] = []
    awaited: list[str] = []

    async def forwards(event: CompactionEvent) -> None:  # hands events on, say to a queue
        await anyio.lowlevel.checkpoint()
        awaited.append(event.name)

    summarizer = SlowSummarizer(0)
    summarizer.gate = anyio.Event()
    async with SlowFold() as store:
        compactor = Compactor(
            store, options=options(), summarizer=summarizer, counter=ApproximateCounter(),
            subscribers=[forwards, lambda event: heard.append(event.name)],
            telemetry=Telemetry.create(meter_provider=meters),
        )  # fmt: skip
        async with compactor:
            await grow_until_started(compactor, summarizer.started)
            summarizer.gate.set()
            with anyio.fail_after(10):
                await store.folding.wait()  # closed while the fold is being written
        assert (await store.load(THREAD)).plain[0].is_summary
        assert [r.episode.kind async for r in store.replay(THREAD)].count("summary_checkpoint") == 1
        result = await compactor.maybe_compact(THREAD)
        assert result is not None and result.background and result.compacted
    names = [BackgroundSummaryStarted.name, BackgroundSummaryApplied.name]
    assert awaited == names and heard == names
    folds = [
        point.value
        for metrics in reader.get_metrics_data().resource_metrics
        for scope in metrics.scope_metrics
        for metric in scope.metrics
        if metric.name == "contextfold.folds"
        for point in metric.data.data_points
    ]
    meters.shutdown()
    assert sum(folds) == 1


async def test_closing_while_a_subscriber_hears_the_start_still_pairs_it_with_its_end_for_everyone() -> None:
    """Closed while an async subscriber is handed BackgroundSummaryStarted: every subscriber hears the
    start, then the discard; none hears an end without its start.
    """
    hearing = anyio.Event()
    heard: list[str] = []

    async def slow(event: CompactionEvent) -> None:
        if isinstance(event, BackgroundSummaryStarted):
            hearing.set()
            await anyio.sleep(0.1)

    summarizer = SlowSummarizer(0)
    summarizer.gate = anyio.Event()  # never opened: closing ends the summary
    async with MemoryStore() as store:
        compactor = Compactor(
            store, options=options(), summarizer=summarizer, counter=ApproximateCounter(),
            subscribers=[slow, lambda event: heard.append(event.name)],
        )  # fmt: skip
        async with compactor:
            with anyio.fail_after(10):
                n = 0
                while not hearing.is_set():
                    await compactor.append(THREAD, turn(n))
                    n += 1
                    await compactor.maybe_compact(THREAD)
                    await anyio.lowlevel.checkpoint()
        assert await store.latest_checkpoint(THREAD) is None
    assert heard == [BackgroundSummaryStarted.name, BackgroundSummaryDiscarded.name]


async def test_background_at_without_entering_the_compactor_folds_in_the_step(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A compactor that was never entered warns once and folds at the hard trigger as usual."""
    compactor = Compactor(store, options=options(), counter=ApproximateCounter())
    results = []
    for n in range(24):
        await compactor.append(THREAD, turn(n))
        results.append(await compactor.maybe_compact(THREAD))
    assert any(r is not None and r.compacted and not r.background for r in results)
    assert sum("not entered" in r.message for r in caplog.records) == 1


def test_background_at_must_be_a_fraction() -> None:
    """background_at outside (0, 1) is a ConfigError naming the key."""
    from contextfold import ConfigError

    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=1_000, background_at=1.5)
    assert info.value.key == "compaction.background_at"


def test_background_at_at_or_below_the_target_is_rejected() -> None:
    """A background_at that starts at or below the fold's target would refold at once, so it is refused."""
    from contextfold import ConfigError

    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=1_000, background_at=0.5)
    assert info.value.key == "compaction.background_at"
    assert "above 0.5" in info.value.reason


def test_the_latency_benchmark_runs_and_loses_nothing() -> None:
    """bench_background runs both sessions against a loopback HTTP summarizer and checks nothing was lost."""
    import importlib.util
    import sys

    path = Path(__file__).parent.parent / "benchmarks" / "bench_background.py"
    spec = importlib.util.spec_from_file_location("bench_background", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_background"] = module
    spec.loader.exec_module(module)
    args = ["--steps", "40", "--budget", "2000", "--summary-seconds", "0.05", "--agent-seconds", "0.01"]
    library = logging.getLogger("contextfold")
    level = library.level
    assert module.main(args) == 0
    # It quiets the library's warnings while it runs; the tests after it read them.
    assert library.level == level


@pytest.mark.parametrize("yields", [0, 1, 3, 10])
async def test_closing_at_any_point_of_a_background_summary_leaves_the_thread_whole(
    store: Any, yields: int
) -> None:
    """Leaving the compactor 0..10 awaits into a background summary writes nothing and frees the thread."""
    entered = anyio.Event()

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        entered.set()
        for _ in range(yields):
            await anyio.lowlevel.checkpoint()
        await anyio.sleep(30)
        return "never"

    async with Compactor(
        store, options=options(), summarizer=FunctionSummarizer(summarize), counter=ApproximateCounter()
    ) as compactor:
        n = 0
        started = False
        with anyio.fail_after(20):
            while not entered.is_set():
                if started:
                    # No more appends once the background summary is on its way: on a loaded
                    # machine they would reach the hard trigger, whose step waits for it.
                    await anyio.lowlevel.checkpoint()
                else:
                    await compactor.append(THREAD, turn(n))
                    n += 1
                    await compactor.maybe_compact(THREAD)
                    started = (await compactor.context_tokens(THREAD))[1] >= BACKGROUND_TOKENS
                for _ in range(yields):
                    await anyio.lowlevel.checkpoint()
        before = await store.load(THREAD)
    assert await store.load(THREAD) == before
    assert await store.latest_checkpoint(THREAD) is None
    again = await Compactor(store, options=options(None), counter=ApproximateCounter()).compact_now(THREAD)
    assert again is not None and again.compacted


KILLED_WORKER = """
import sys, anyio
from contextfold import Compactor, Message, RunOptions, SummarizeOptions
from contextfold.stores import SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import ApproximateCounter

async def summarize(messages, previous, limit):
    open(sys.argv[2], "w").close()  # the summary is under way: kill me now
    await anyio.sleep(600)
    return "never"

async def main():
    options = RunOptions(max_history_tokens=8_000, compaction=SummarizeOptions(
        trigger_token_budget=2_000, max_summary_tokens=100, min_recent_messages=2, background_at=0.6))
    async with SQLiteStore(sys.argv[1], lease_seconds=4) as store:
        async with Compactor(store, options=options, summarizer=FunctionSummarizer(summarize),
                             counter=ApproximateCounter()) as compactor:
            for n in range(40):
                await compactor.append("bg", [Message.user(f"step {n} " + "word " * 120)])
                await compactor.maybe_compact("bg")
                await anyio.sleep(0.05)

anyio.run(main)
"""


def test_a_process_killed_mid_summary_leaves_no_fold_and_its_lease_expires(tmp_path: Path) -> None:
    """SIGKILL mid background summary: nothing folded, log and context agree, another worker folds later."""
    import signal
    import subprocess
    import sys
    import time

    db, started = tmp_path / "cf.db", tmp_path / "started"
    worker = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, str(db), str(started)])
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert worker.poll() is None, "the worker ended before its summary began"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        worker.send_signal(signal.SIGKILL)
    finally:
        worker.wait(timeout=30)

    async def check() -> None:
        async with SQLiteStore(db, lease_seconds=1) as store:
            context = await store.load(THREAD)
            log = [r async for r in store.replay(THREAD)]
            assert not [r for r in log if isinstance(r.episode, SummaryCheckpoint)]
            assert [m.message for m in context.messages] == conversation(log)
            compactor = Compactor(store, options=options(None), counter=ApproximateCounter())
            async with store.compaction_lock(THREAD) as free:
                assert not free  # the killed worker's lease still stands
            await anyio.sleep(4.2)
            result = await compactor.compact_now(THREAD)
            assert result is not None and result.compacted

    anyio.run(check)


async def test_a_step_on_another_threads_event_loop_folds_in_the_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A framework's synchronous call runs its own event loop in a worker thread: its steps fold in the step.

    Before, the background fold was started in the entered compactor's task group from that other loop;
    it died with that loop, and the task group's cancellation reached the host as a bare CancelledError.
    """
    async with (
        MemoryStore() as store,
        Compactor(store, options=options(), counter=ApproximateCounter()) as compactor,
    ):

        async def step(n: int) -> CompactionResult | None:
            await compactor.append(THREAD, turn(n))
            return await compactor.maybe_compact(THREAD)

        results = [await anyio.to_thread.run_sync(anyio.run, step, n) for n in range(24)]
        await anyio.sleep(0.05)  # a task started in the group from the other loop would fail by now
        records = [r async for r in store.replay(THREAD)]
    folded = [r for r in results if r is not None and r.compacted]
    assert folded and not any(r.background for r in folded)
    assert sum(isinstance(r.episode, SummaryCheckpoint) for r in records) == len(folded)
    warnings = [r.message for r in caplog.records if "another event loop" in r.message]
    assert len(warnings) == 1 and repr(THREAD) in warnings[0]


async def test_the_hard_trigger_on_another_threads_loop_waits_for_the_background_summary() -> None:
    """A step on another thread's event loop that reaches the budget waits for the summary under way.

    Before, it waited on the summary's anyio event, which the entered loop set without ever waking it.
    """
    summarizer = SlowSummarizer(0.05)
    summarizer.gate = anyio.Event()
    async with (
        MemoryStore() as store,
        Compactor(store, options=options(), summarizer=summarizer, counter=ApproximateCounter()) as compactor,
    ):
        n = await grow_until_started(compactor, summarizer.started)

        async def step() -> CompactionResult | None:
            for k in range(6):  # well past the budget while the summarizer is held at its gate
                await compactor.append(THREAD, turn(n + k))
            return await compactor.maybe_compact(THREAD)

        results: list[CompactionResult | None] = []

        async def in_another_thread() -> None:
            results.append(await anyio.to_thread.run_sync(anyio.run, step, abandon_on_cancel=True))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(in_another_thread)
                await anyio.sleep(0.2)
                assert not results  # it waits for the summary
                summarizer.gate.set()
    assert results and results[0] is not None and results[0].compacted and results[0].background


async def test_a_step_appending_while_the_background_fold_reads_the_context_is_not_cached_twice(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's reply lands while the background task reads the thread under its lease: sent once.

    Both bring the one cached context up to date: the step's ``append`` adds
    its rows, and the background read (begun before them) may return them too.
    Before, the background read the rows after its cache, and the step's reply
    reached ``context()`` twice and stayed so. Whichever read the background
    makes first under the lease (stats or tail) is held until the step appended.
    """
    lock, tail, stats = store.compaction_lock, store.tail, store.stats
    may_fold, reading, read = anyio.Event(), anyio.Event(), anyio.Event()
    armed = False

    @asynccontextmanager
    async def gated_lock(thread: str) -> AsyncIterator[Any]:
        nonlocal armed
        await may_fold.wait()  # the background task begins once the step has read its context
        async with lock(thread) as held:
            armed = True
            yield held

    async def held_back() -> None:
        nonlocal armed
        if armed:  # the background task's first read under the lease takes a while
            armed = False
            reading.set()
            await read.wait()

    async def slow_tail(thread: str, *, after_seq: int) -> Any:
        await held_back()
        return await tail(thread, after_seq=after_seq)

    async def slow_stats(thread: str) -> Any:
        await held_back()
        return await stats(thread)

    monkeypatch.setattr(store, "compaction_lock", gated_lock)
    monkeypatch.setattr(store, "tail", slow_tail)
    monkeypatch.setattr(store, "stats", slow_stats)
    summarizer = SlowSummarizer(0.0)
    async with Compactor(
        store, options=options(), summarizer=summarizer, counter=ApproximateCounter()
    ) as compactor:
        await compactor.append(THREAD, [Message.system("sys")])
        n = 0
        while (await compactor.context_tokens(THREAD))[1] <= BACKGROUND_TOKENS:
            await compactor.append(THREAD, [Message.user(f"m{n} " + "word " * 40)])
            n += 1
        assert await compactor.maybe_compact(THREAD) is None  # starts the background summary
        await compactor.context(THREAD)  # the step's request
        may_fold.set()
        with anyio.fail_after(10):
            await reading.wait()
        reply = Message.assistant("the reply")
        await compactor.append(THREAD, [reply])  # lands while the background read is out
        read.set()
        result = await step_until_applied(compactor, within=10)
        assert result.compacted
        context = await compactor.context(THREAD)
        assert context == (await store.load(THREAD)).plain
        assert context.count(reply) == 1
        assert context[-1] == reply


async def checkpoints(store: Any) -> list[SummaryCheckpoint]:
    return [r.episode async for r in store.replay(THREAD) if isinstance(r.episode, SummaryCheckpoint)]


def observed(store: Any, summarizer: SlowSummarizer, seen: list[CompactionEvent]) -> Compactor:
    """A background-folding compactor whose events land in ``seen``."""
    return Compactor(
        store,
        options=options(),
        summarizer=summarizer,
        counter=ApproximateCounter(),
        subscribers=[seen.append],
        log_events=False,
    )


async def grow_while_held(compactor: Compactor, n: int, tokens: float) -> int:
    """Append turns with no check (past the budget it would wait) until the context holds ``tokens``."""
    while (await compactor.context_tokens(THREAD))[1] <= tokens:
        await compactor.append(THREAD, turn(n))
        n += 1
    return n


async def test_a_background_fold_that_leaves_the_context_over_the_trigger_is_followed_by_a_fold(
    store: Any,
) -> None:
    """Appends made while the background summary ran keep the context over the budget: the step folds too.

    Before, the step returned the background fold and sent 1.5x the budget.
    """
    summarizer = SlowSummarizer(0)
    summarizer.gate = anyio.Event()
    seen: list[CompactionEvent] = []
    async with observed(store, summarizer, seen) as compactor:
        n = await grow_until_started(compactor, summarizer.started)
        await grow_while_held(compactor, n, 2.5 * 2_000)
        summarizer.gate.set()
        with anyio.fail_after(10):  # ready by now, or waited for at the hard trigger: the same outcome
            result = await compactor.maybe_compact(THREAD)
        _, sent = await compactor.context_tokens(THREAD)
    assert result is not None and result.compacted and not result.background
    assert sent <= 1_000  # the target: what a step's fold leaves
    begun, applied, folded = seen
    assert isinstance(begun, BackgroundSummaryStarted)
    assert isinstance(applied, BackgroundSummaryApplied) and applied.tokens_after > 2_000
    assert type(folded) is FoldApplied and folded.tokens_before == applied.tokens_after
    assert folded.tokens_after == result.tokens_after == sent
    assert len(await checkpoints(store)) == 2
    assert len(summarizer.calls) == 2
    assert len(summarizer.sent) == len(set(summarizer.sent)), "a message was summarized twice"


async def test_a_background_fold_that_found_the_lease_taken_leaves_the_fold_to_the_step(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background fold that finds another worker's lease begins nothing; past the budget, the step folds.

    Before, it emitted BackgroundSummaryStarted and nothing after, and the first check over the
    budget returned its empty result: nothing was folded.
    """
    lock = store.compaction_lock
    refused = anyio.Event()

    @asynccontextmanager
    async def spied_lock(thread: str) -> AsyncIterator[bool]:
        async with lock(thread) as held:
            if not held:
                refused.set()
            yield held

    monkeypatch.setattr(store, "compaction_lock", spied_lock)
    summarizer = SlowSummarizer(0)
    seen: list[CompactionEvent] = []
    async with observed(store, summarizer, seen) as compactor:
        async with lock(THREAD) as held:  # another worker is compacting the thread
            assert held
            n = 0
            while (await compactor.context_tokens(THREAD))[1] <= BACKGROUND_TOKENS:
                await compactor.append(THREAD, turn(n))
                n += 1
            assert await compactor.maybe_compact(THREAD) is None  # the background fold starts
            with anyio.fail_after(10):
                await refused.wait()
        await grow_while_held(compactor, n, 2_000)
        with anyio.fail_after(10):
            result = await compactor.maybe_compact(THREAD)
        _, sent = await compactor.context_tokens(THREAD)
    assert result is not None and result.compacted and not result.background
    assert sent <= 1_000
    assert [type(e) for e in seen] == [FoldApplied]
    assert len(await checkpoints(store)) == 1 and len(summarizer.calls) == 1


async def test_background_folding_keeps_the_hold_back_between_folds() -> None:
    """With large protected turns, a background fold waits out budget - target new tokens, as a step's does.

    Before, a background summary started at every check past background_at while the fold before it
    still held the next one back: 10 folds and 11 summarizer calls where the step makes 4.
    """
    budget, target = 1_000, 500

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "summary of stuff"

    for background_at in (None, 0.8):
        seen: list[CompactionEvent] = []
        summarizer = FunctionSummarizer(summarize)

        compaction = SummarizeOptions(
            trigger_token_budget=budget,
            min_recent_messages=0,
            min_recent_turns=8,  # about 800 tokens: every fold leaves the context over the target
            background_at=background_at,
        )
        async with (
            MemoryStore() as store,
            Compactor(
                store,
                options=compaction,
                summarizer=summarizer,
                counter=ApproximateCounter(),
                subscribers=[seen.append],
                log_events=False,
            ) as compactor,
        ):
            for n in range(30):
                await compactor.maybe_compact(THREAD)
                await compactor.append(THREAD, [Message.user("word " * 75 + str(n))])
                await anyio.wait_all_tasks_blocked()  # a background fold under way is written by now
        folds = [e for e in seen if isinstance(e, FoldApplied)]
        assert 3 <= len(folds) <= 5 and len(summarizer.calls) == len(folds), background_at
        for earlier, later in itertools.pairwise(folds):
            assert later.tokens_before - earlier.tokens_after > budget - target, background_at


async def test_a_compactor_entered_again_folds_in_the_background(caplog: pytest.LogCaptureFixture) -> None:
    """A compactor whose 'async with' ended can be entered again, and folds in the background there.

    Before, the second entry was accepted but every later check warned "the Compactor is not entered"
    and folded in the step.
    """
    async with MemoryStore() as store:
        compactor = Compactor(
            store, options=options(), summarizer=SlowSummarizer(0), counter=ApproximateCounter()
        )
        async with compactor:
            pass
        async with compactor:
            with pytest.raises(ConfigError, match="already entered"):
                await compactor.__aenter__()
            result = None
            n = 0
            while result is None:
                await compactor.append(THREAD, turn(n))
                n += 1
                result = await compactor.maybe_compact(THREAD)
                await anyio.wait_all_tasks_blocked()  # a background fold under way is written by now
        assert result.compacted and result.background
        assert len(await checkpoints(store)) == 1
    assert "not entered" not in caplog.text
