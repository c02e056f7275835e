"""OpenTelemetry spans and metrics, read back through the SDK's in-memory exporter and reader."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from contextfold._compactor import Compactor
from contextfold._config import RunOptions, SummarizeOptions
from contextfold._episodes import Usage
from contextfold._errors import SummarizerError
from contextfold._events import (
    BackgroundSummaryApplied,
    BackgroundSummaryDiscarded,
    CompactionEvent,
    EventDispatcher,
    FoldApplied,
    FoldConflict,
    FoldStalled,
    SummaryDegraded,
)
from contextfold._messages import Message
from contextfold._telemetry import (
    ATTR_CAUSE,
    METRIC_DEGRADED,
    METRIC_DISCARDED,
    METRIC_FOLD_DURATION,
    METRIC_FOLDS,
    METRIC_STALLS,
    METRIC_SUMMARIZER_DURATION,
    METRIC_SUMMARIZER_TOKENS,
    METRIC_TOKENS_SAVED,
    Telemetry,
    error_type,
)
from contextfold._tokens import ApproximateCounter
from contextfold.stores import MemoryStore
from contextfold.summarizers import FunctionSummarizer, Summary

THREAD = "t-1"
COMMON = {"thread": THREAD, "reason": "token_count", "tokens_before": 900, "tokens_after": 250}


class Otel:
    """Explicit SDK providers with in-memory export, so nothing global leaks between tests."""

    def __init__(self) -> None:
        self.spans_exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans_exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.telemetry = Telemetry.create(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def spans(self) -> dict[str, ReadableSpan]:
        return {span.name: span for span in self.spans_exporter.get_finished_spans()}

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def otel() -> Iterator[Otel]:
    providers = Otel()
    yield providers
    providers.shutdown()


def applied(**overrides: Any) -> FoldApplied:
    return FoldApplied(
        **{
            **COMMON,
            "messages_folded": 12,
            "summarizer_model": "recorder",
            "usage": Usage(input_tokens=700, output_tokens=80),
            "duration_s": 0.25,
            **overrides,
        }
    )


def test_fold_span_carries_the_folds_figures(otel: Otel) -> None:
    """A recorded fold sets thread, reason, tokens before/after, messages folded and degraded on its span."""
    with otel.telemetry.fold_span(THREAD, "token_count") as span:
        span.record(applied(degraded=True))
    fold = otel.spans()["contextfold.fold"]
    assert fold.kind is SpanKind.INTERNAL
    assert dict(fold.attributes or {}) == {
        "contextfold.thread": THREAD,
        "contextfold.reason": "token_count",
        "contextfold.background": False,
        "contextfold.tokens_before": 900,
        "contextfold.tokens_after": 250,
        "contextfold.messages_folded": 12,
        "contextfold.degraded": True,
        "contextfold.stalled": False,
    }
    [event] = fold.events
    assert event.name == "fold"
    assert dict(event.attributes or {})["gen_ai.request.model"] == "recorder"


async def test_summarizer_span_follows_the_genai_conventions(otel: Otel) -> None:
    """A summarizer call is a CLIENT span ``summarize {model}`` in the fold span, with GenAI attributes."""
    with otel.telemetry.fold_span(THREAD, "token_count"):
        with otel.telemetry.summarizer_span("gpt-4o-mini", max_tokens=256, provider="openai") as call:
            await anyio.sleep(0)
            call.record(Usage(input_tokens=1200, output_tokens=90), response_model="gpt-4o-mini-2024-07-18")
    spans = otel.spans()
    summarize, fold = spans["summarize gpt-4o-mini"], spans["contextfold.fold"]
    assert summarize.kind is SpanKind.CLIENT
    assert summarize.parent is not None and summarize.parent.span_id == fold.context.span_id
    assert dict(summarize.attributes or {}) == {
        "gen_ai.operation.name": "summarize",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.request.max_tokens": 256,
        "gen_ai.response.model": "gpt-4o-mini-2024-07-18",
        "gen_ai.usage.input_tokens": 1200,
        "gen_ai.usage.output_tokens": 90,
    }
    assert summarize.status.status_code is StatusCode.UNSET


async def test_summarizer_latency_and_tokens_are_genai_histograms(otel: Otel) -> None:
    """The call's wall time lands in seconds in the duration histogram, and its tokens by type."""
    with otel.telemetry.summarizer_span("m") as call:
        await anyio.sleep(0.05)
        call.record(Usage(input_tokens=500, output_tokens=40), response_model="m-1")
    [duration] = otel.points(METRIC_SUMMARIZER_DURATION)
    assert duration.count == 1 and 0.05 <= duration.sum < 5
    assert dict(duration.attributes) == {
        "gen_ai.operation.name": "summarize",
        "gen_ai.request.model": "m",
        "gen_ai.response.model": "m-1",
    }
    assert duration.explicit_bounds[:3] == (0.01, 0.02, 0.04)
    tokens = {p.attributes["gen_ai.token.type"]: p.sum for p in otel.points(METRIC_SUMMARIZER_TOKENS)}
    assert tokens == {"input": 500, "output": 40}


async def test_a_failing_summarizer_call_is_an_error_span_and_an_error_duration(otel: Otel) -> None:
    """A raised error sets ``error.type`` and ERROR status on both spans and tags the duration with it."""
    with pytest.raises(SummarizerError):
        with otel.telemetry.fold_span(THREAD, "token_count"):
            with otel.telemetry.summarizer_span("m"):
                raise SummarizerError("upstream failed", status=503)
    spans = otel.spans()
    for name in ("summarize m", "contextfold.fold"):
        assert spans[name].status.status_code is StatusCode.ERROR
        assert dict(spans[name].attributes or {})["error.type"] == "contextfold.SummarizerError"
    assert [e.name for e in spans["summarize m"].events] == ["exception"]
    [duration] = otel.points(METRIC_SUMMARIZER_DURATION)
    assert dict(duration.attributes)["error.type"] == "contextfold.SummarizerError"


async def test_a_cancelled_summarizer_call_is_marked_not_failed(otel: Otel) -> None:
    """Cancellation marks the spans cancelled without an error status and records no latency."""
    with anyio.CancelScope() as scope:
        with otel.telemetry.fold_span(THREAD, background=True):
            with otel.telemetry.summarizer_span("m"):
                scope.cancel()
                await anyio.sleep(5)
    spans = otel.spans()
    for name in ("summarize m", "contextfold.fold"):
        attributes = dict(spans[name].attributes or {})
        assert attributes["contextfold.cancelled"] is True
        assert "error.type" not in attributes
        assert spans[name].status.status_code is StatusCode.UNSET
    assert dict(spans["contextfold.fold"].attributes or {})["contextfold.background"] is True
    assert otel.points(METRIC_SUMMARIZER_DURATION) == []


async def test_fold_events_become_metrics(otel: Otel) -> None:
    """The subscriber counts folds, stalls, degraded and discarded summaries, tokens saved and fold time."""
    dispatcher = EventDispatcher([otel.telemetry.record_event], log_events=False)
    events: list[CompactionEvent] = [
        applied(),
        SummaryDegraded(**COMMON, summarizer_model="gpt-x", error_type="contextfold.SummarizerError"),
        applied(degraded=True, tokens_before=1000, tokens_after=400),
        BackgroundSummaryApplied(**COMMON, duration_s=1.5),
        FoldStalled(**{**COMMON, "tokens_after": 900}, detail="x"),
        FoldConflict(**{**COMMON, "tokens_after": 900}),
        BackgroundSummaryDiscarded(**{**COMMON, "tokens_after": 900}, cause="prefix_changed"),
    ]
    for event in events:
        await dispatcher.emit(event)
    data = otel.reader.get_metrics_data()
    assert data is not None
    metrics = {
        m.name: m.data.data_points for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics
    }

    def by(name: str, *keys: str) -> dict[tuple[Any, ...], Any]:
        return {tuple(p.attributes.get(k) for k in keys): p for p in metrics[name]}

    folds = by(METRIC_FOLDS, "contextfold.degraded", "contextfold.background")
    assert {key: p.value for key, p in folds.items()} == {
        (False, False): 1,
        (True, False): 1,
        (False, True): 1,
    }
    [saved] = metrics[METRIC_TOKENS_SAVED]
    assert saved.value == 650 + 600 + 650
    assert dict(saved.attributes) == {"contextfold.reason": "token_count"}
    [stalls] = metrics[METRIC_STALLS]
    assert stalls.value == 1
    [degraded] = metrics[METRIC_DEGRADED]
    assert dict(degraded.attributes) == {
        "contextfold.reason": "token_count",
        "gen_ai.request.model": "gpt-x",
        "error.type": "contextfold.SummarizerError",
    }
    discarded = by(METRIC_DISCARDED, "contextfold.discard_cause")
    assert {key: p.value for key, p in discarded.items()} == {("conflict",): 1, ("prefix_changed",): 1}
    durations = by(METRIC_FOLD_DURATION, "contextfold.background")
    assert durations[(False,)].count == 2 and durations[(False,)].sum == pytest.approx(0.5)
    assert durations[(True,)].sum == pytest.approx(1.5)
    assert all("contextfold.thread" not in p.attributes for points in metrics.values() for p in points)


async def test_disabled_telemetry_records_nothing() -> None:
    """``Telemetry.disabled()`` hands out working no-op spans and ignores events."""
    telemetry = Telemetry.disabled()
    assert not telemetry.enabled
    with telemetry.fold_span(THREAD, "token_count") as span:
        with telemetry.summarizer_span("m") as call:
            call.record(Usage(input_tokens=1))
        span.record(applied())
    telemetry.record_event(applied())


def test_error_type_is_the_qualified_class_name() -> None:
    """``error.type`` is the class's qualified name, with contextfold's errors under their public path."""
    assert error_type(ValueError()) == "ValueError"
    assert error_type(SummarizerError("x")) == "contextfold.SummarizerError"
    assert error_type(json.JSONDecodeError("x", "", 0)) == "json.decoder.JSONDecodeError"


def _python(code: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_import_contextfold_never_imports_opentelemetry() -> None:
    """Importing contextfold, its events and its telemetry module loads no opentelemetry module."""
    loaded = _python(
        "import json, sys, contextfold, contextfold._events, contextfold._telemetry, contextfold._compactor\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))"
    )
    assert loaded == []


def test_without_opentelemetry_create_gives_disabled_telemetry() -> None:
    """With opentelemetry not importable, ``Telemetry.create()`` returns a no-op that still runs a fold."""
    outcome = _python(
        "import json, sys\n"
        "sys.modules['opentelemetry'] = None\n"
        "from contextfold._telemetry import Telemetry\n"
        "from contextfold._episodes import Usage\n"
        "t = Telemetry.create()\n"
        "with t.fold_span('t') as span:\n"
        "    with t.summarizer_span('m') as call:\n"
        "        call.record(Usage(input_tokens=3))\n"
        "print(json.dumps({'enabled': t.enabled}))"
    )
    assert outcome == {"enabled": False}


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    async with MemoryStore() as backend:
        yield backend


async def test_create_without_providers_uses_the_global_ones() -> None:
    """With no providers given, spans go to the global (here unconfigured, non-recording) provider."""
    telemetry = Telemetry.create()
    assert telemetry.enabled
    with telemetry.fold_span(THREAD, "token_count") as span:
        with telemetry.summarizer_span("m") as call:
            call.record(Usage(input_tokens=1))
        span.record(applied())
    telemetry.record_event(applied())


@pytest.mark.skipif(not hasattr(Compactor, "subscribe"), reason="the Compactor emits no events yet")
async def test_a_compactor_traces_its_folds_and_summarizer_calls(otel: Otel, store: MemoryStore) -> None:
    """A Compactor given telemetry opens a fold span with its summarizer span inside and counts the fold."""

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> Summary:
        return Summary(text="s", model="recorder-1", usage=Usage(input_tokens=321, output_tokens=7))

    options = RunOptions(
        max_history_tokens=800,
        compaction=SummarizeOptions(trigger_token_budget=400, max_summary_tokens=60, min_recent_messages=2),
    )
    compactor = Compactor(  # type: ignore[call-arg]
        store,
        options=options,
        summarizer=FunctionSummarizer(summarize, model="recorder"),
        counter=ApproximateCounter(),
        telemetry=otel.telemetry,
    )
    for n in range(8):
        await compactor.append(THREAD, [Message.user(f"task {n}: " + "word " * 40)])
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.compacted
    stats = await store.stats(THREAD)
    spans = otel.spans()
    fold, summarize_span = spans["contextfold.fold"], spans["summarize recorder"]
    assert summarize_span.parent is not None and summarize_span.parent.span_id == fold.context.span_id
    attributes = dict(fold.attributes or {})
    assert attributes["contextfold.thread"] == THREAD
    assert attributes["contextfold.tokens_after"] == stats.total_tokens
    assert attributes["contextfold.stalled"] is False
    assert dict(summarize_span.attributes or {})["gen_ai.usage.output_tokens"] == 7
    assert dict(summarize_span.attributes or {})["gen_ai.response.model"] == "recorder-1"
    assert attributes["contextfold.messages_folded"] == result.dropped_messages
    assert [e.name for e in fold.events] == ["fold"]
    [folds] = otel.points(METRIC_FOLDS)
    assert folds.value == 1
    [saved] = otel.points(METRIC_TOKENS_SAVED)
    assert saved.value == result.tokens_before - stats.total_tokens


def traced_compactor(otel: Otel, store: MemoryStore, **overrides: Any) -> Compactor:
    settings: dict[str, Any] = {
        "options": RunOptions(
            max_history_tokens=800,
            compaction=SummarizeOptions(
                trigger_token_budget=400, max_summary_tokens=60, min_recent_messages=2
            ),
        ),
        "counter": ApproximateCounter(),
        "telemetry": otel.telemetry,
        "log_events": False,
        **overrides,
    }
    return Compactor(store, **settings)


def fold_span(otel: Otel) -> tuple[dict[str, Any], list[str]]:
    """The one ``contextfold.fold`` span's attributes and the names of its events."""
    [span] = [s for s in otel.spans_exporter.get_finished_spans() if s.name == "contextfold.fold"]
    return dict(span.attributes or {}), [e.name for e in span.events]


async def test_a_real_stall_marks_its_fold_span_stalled_with_its_tokens(
    otel: Otel, store: MemoryStore
) -> None:
    """A trigger that fires with nothing to fold leaves a fold span marked stalled, with the context's tokens.

    Before, the stall's span had neither the stall event nor contextfold.stalled nor any tokens.
    """
    compactor = traced_compactor(otel, store)
    await compactor.append(THREAD, [Message.user("word " * 600)])  # one protected turn, alone over budget
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.stalled
    total = (await store.stats(THREAD)).total_tokens
    attributes, events = fold_span(otel)
    assert events == ["fold_stalled"]
    assert attributes["contextfold.stalled"] is True
    assert attributes["contextfold.tokens_before"] == attributes["contextfold.tokens_after"] == total
    assert attributes["contextfold.messages_folded"] == 0
    [stalls] = otel.points(METRIC_STALLS)
    assert stalls.value == 1


async def test_a_real_conflict_is_on_its_fold_span_with_its_cause(otel: Otel, store: MemoryStore) -> None:
    """A fold whose prefix another writer replaced leaves its conflict, figures and cause on its span.

    Before, the conflicting fold's span carried no event and no figures.
    """

    async def meddling(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        stats = await store.stats(THREAD)
        first = (await store.load(THREAD)).messages[0]
        await store.replace_prefix(
            THREAD,
            through_seq=first.seq,
            expected_version=stats.version,
            replacement=[Message.user("edited by an operator")],
            tokens=[5],
        )
        return "summary"

    compactor = traced_compactor(otel, store, summarizer=FunctionSummarizer(meddling))
    for n in range(8):
        await compactor.append(THREAD, [Message.user(f"task {n}: " + "word " * 40)])
    read = (await store.stats(THREAD)).total_tokens
    assert await compactor.maybe_compact(THREAD) is None  # discarded: nothing written
    attributes, events = fold_span(otel)
    assert events == ["fold_conflict"]
    assert attributes[ATTR_CAUSE] == "conflict" and attributes["contextfold.stalled"] is False
    assert attributes["contextfold.tokens_before"] == attributes["contextfold.tokens_after"] == read
    assert attributes["contextfold.messages_folded"] > 0
    [discarded] = otel.points(METRIC_DISCARDED)
    assert discarded.value == 1


async def test_a_degraded_fold_has_the_degraded_event_on_its_span(otel: Otel, store: MemoryStore) -> None:
    """A fold made with the fallback's summary records the summary_degraded event before the fold on its span.

    Before, only the applied fold reached the span.
    """

    async def broken(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        raise SummarizerError("provider down")

    compactor = traced_compactor(otel, store, summarizer=FunctionSummarizer(broken, model="flaky"))
    for n in range(8):
        await compactor.append(THREAD, [Message.user(f"task {n}: " + "word " * 40)])
    result = await compactor.maybe_compact(THREAD)
    assert result is not None and result.degraded
    attributes, events = fold_span(otel)
    assert events == ["summary_degraded", "fold"]
    assert attributes["contextfold.degraded"] is True
    assert attributes["contextfold.tokens_after"] == (await store.stats(THREAD)).total_tokens


async def test_a_background_fold_span_records_its_start_and_its_application(
    otel: Otel, store: MemoryStore
) -> None:
    """A background fold's span holds background_started then background_applied, and the figures of the fold.

    Before, the start was emitted outside the span, before the background fold held the lease.
    """
    options = RunOptions(
        max_history_tokens=8_000,
        compaction=SummarizeOptions(
            trigger_token_budget=2_000, max_summary_tokens=100, min_recent_messages=2, background_at=0.6
        ),
    )

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        return "summary"  # on the event loop: the offline summarizer's worker thread is not a blocked task

    summarizer = FunctionSummarizer(summarize)
    async with traced_compactor(otel, store, options=options, summarizer=summarizer) as compactor:
        while (await compactor.context_tokens(THREAD))[1] <= 0.6 * 2_000:
            await compactor.append(THREAD, [Message.user("word " * 150)])
        assert await compactor.maybe_compact(THREAD) is None  # starts the background fold
        # Checked until a step returns it: the fold's task may still wait on a worker thread
        # (which counts as blocked) when every task is first blocked.
        with anyio.fail_after(10):
            while (result := await compactor.maybe_compact(THREAD)) is None:
                await anyio.sleep(0.01)
    assert result.background
    attributes, events = fold_span(otel)
    assert events == ["background_started", "background_applied"]
    assert attributes["contextfold.background"] is True and attributes["contextfold.stalled"] is False
    assert attributes["contextfold.tokens_after"] == (await store.stats(THREAD)).total_tokens
    [saved] = otel.points(METRIC_TOKENS_SAVED)
    assert saved.value == result.tokens_before - result.tokens_after > 0
