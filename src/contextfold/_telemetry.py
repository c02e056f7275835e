"""OpenTelemetry spans and metrics for folds, when ``contextfold[otel]`` is installed.

Traces: one ``contextfold.fold`` span per fold attempt, and inside it one span
per summarizer call named ``summarize {model}`` after the OpenTelemetry GenAI
semantic conventions (``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` / ``output_tokens``,
``error.type``). The fold span carries contextfold's own attributes, see
``ATTR_*``.

Every event the compactor emits while a fold span is open (a stall, a
degraded summary, a conflict, a background start or discard, the applied
fold) is recorded on that span by :meth:`Telemetry.record_event`, the same
subscriber that counts the metrics.

Metrics (see ``METRIC_*``): folds, stalls, degraded and discarded summaries,
tokens saved and fold duration come from the events (:meth:`Telemetry.record_event`
is a subscriber); summarizer latency and token usage use the GenAI metrics
``gen_ai.client.operation.duration`` and ``gen_ai.client.token.usage``.
Metric attributes stay low-cardinality: the reason and the model, never the thread.

Without ``opentelemetry-api`` every object here is a no-op and nothing is
imported: ``import contextfold`` never imports opentelemetry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from ._episodes import Usage
from ._events import (
    BackgroundSummaryApplied,
    BackgroundSummaryDiscarded,
    BackgroundSummaryStarted,
    CompactionEvent,
    FoldApplied,
    FoldConflict,
    FoldStalled,
    SummaryDegraded,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = [
    "ATTR_BACKGROUND",
    "ATTR_CAUSE",
    "ATTR_DEGRADED",
    "ATTR_MESSAGES_FOLDED",
    "ATTR_REASON",
    "ATTR_STALLED",
    "ATTR_THREAD",
    "ATTR_TOKENS_AFTER",
    "ATTR_TOKENS_BEFORE",
    "FOLD_SPAN_NAME",
    "METRIC_DEGRADED",
    "METRIC_DISCARDED",
    "METRIC_FOLDS",
    "METRIC_FOLD_DURATION",
    "METRIC_STALLS",
    "METRIC_SUMMARIZER_DURATION",
    "METRIC_SUMMARIZER_TOKENS",
    "METRIC_TOKENS_SAVED",
    "SUMMARIZE_OPERATION",
    "FoldSpan",
    "SummarizerCall",
    "Telemetry",
    "error_type",
]

INSTRUMENTATION_NAME: Final = "contextfold"
FOLD_SPAN_NAME: Final = "contextfold.fold"
SUMMARIZE_OPERATION: Final = "summarize"

ATTR_THREAD: Final = "contextfold.thread"
ATTR_REASON: Final = "contextfold.reason"
ATTR_TOKENS_BEFORE: Final = "contextfold.tokens_before"
ATTR_TOKENS_AFTER: Final = "contextfold.tokens_after"
ATTR_MESSAGES_FOLDED: Final = "contextfold.messages_folded"
ATTR_DEGRADED: Final = "contextfold.degraded"
ATTR_STALLED: Final = "contextfold.stalled"
ATTR_BACKGROUND: Final = "contextfold.background"
ATTR_CAUSE: Final = "contextfold.discard_cause"
ATTR_CANCELLED: Final = "contextfold.cancelled"

GEN_AI_OPERATION: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"
ERROR_TYPE: Final = "error.type"

METRIC_FOLDS: Final = "contextfold.folds"
METRIC_STALLS: Final = "contextfold.stalls"
METRIC_DEGRADED: Final = "contextfold.degraded_summaries"
METRIC_DISCARDED: Final = "contextfold.discarded_summaries"
METRIC_TOKENS_SAVED: Final = "contextfold.tokens_saved"
METRIC_FOLD_DURATION: Final = "contextfold.fold.duration"
METRIC_SUMMARIZER_DURATION: Final = "gen_ai.client.operation.duration"
METRIC_SUMMARIZER_TOKENS: Final = "gen_ai.client.token.usage"

_open_fold: ContextVar[tuple[Telemetry, FoldSpan] | None] = ContextVar("contextfold_fold_span", default=None)
"""The fold span open in this task, and the telemetry that opened it: where its events are recorded."""

# The bucket boundaries the GenAI semantic conventions recommend for these two histograms.
_DURATION_BUCKETS: Final = tuple(round(0.01 * 2**n, 2) for n in range(14))
_TOKEN_BUCKETS: Final = tuple(float(4**n) for n in range(14))


def error_type(exc: BaseException) -> str:
    """The ``error.type`` of an exception: its fully qualified class name, public names for contextfold's."""
    cls = type(exc)
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    if module.startswith("contextfold."):
        module = "contextfold"
    return f"{module}.{cls.__qualname__}"


def _version() -> str:
    # The package's own constant: reading the installed metadata would touch the disk on the loop.
    from . import __version__

    return __version__


class _Metrics:
    """The instruments, made once per meter."""

    __slots__ = (
        "degraded",
        "discarded",
        "fold_duration",
        "folds",
        "stalls",
        "summarizer_duration",
        "summarizer_tokens",
        "tokens_saved",
    )

    def __init__(self, meter_provider: MeterProvider | None) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter(INSTRUMENTATION_NAME, _version(), meter_provider=meter_provider)
        self.folds: Counter = meter.create_counter(METRIC_FOLDS, "{fold}", "Folds applied")
        self.stalls: Counter = meter.create_counter(
            METRIC_STALLS, "{stall}", "Triggers that fired with nothing to fold"
        )
        self.degraded: Counter = meter.create_counter(
            METRIC_DEGRADED, "{summary}", "Summaries made by the fallback because the summarizer failed"
        )
        self.discarded: Counter = meter.create_counter(
            METRIC_DISCARDED, "{summary}", "Computed summaries thrown away unapplied"
        )
        self.tokens_saved: Counter = meter.create_counter(
            METRIC_TOKENS_SAVED, "{token}", "Tokens removed from working contexts by folds"
        )
        self.fold_duration: Histogram = meter.create_histogram(
            METRIC_FOLD_DURATION,
            "s",
            "Wall time of applied folds",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.summarizer_duration: Histogram = meter.create_histogram(
            METRIC_SUMMARIZER_DURATION,
            "s",
            "GenAI operation duration",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self.summarizer_tokens: Histogram = meter.create_histogram(
            METRIC_SUMMARIZER_TOKENS,
            "{token}",
            "Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )


class FoldSpan:
    """The open ``contextfold.fold`` span; a no-op without OpenTelemetry."""

    __slots__ = ("_span",)

    def __init__(self, span: Span | None) -> None:
        self._span = span

    def record(self, event: CompactionEvent) -> None:
        """Note ``event`` on the span: a span event always, and the figures of how the fold ended.

        Each event the fold emits comes here (see :meth:`Telemetry.record_event`).
        The last event that ends a fold (``FoldApplied``, ``FoldStalled``,
        ``FoldConflict`` or ``BackgroundSummaryDiscarded``) sets the span's
        reason, tokens and messages folded; a conflict or a discard also its
        cause, and a ``SummaryDegraded`` marks the span degraded.
        """
        span = self._span
        if span is None or not span.is_recording():
            return
        span.add_event(event.name, _event_attributes(event))
        if isinstance(event, SummaryDegraded):
            span.set_attribute(ATTR_DEGRADED, True)
        if isinstance(event, SummaryDegraded | BackgroundSummaryStarted):
            return  # the fold goes on: its end sets the figures
        attributes: dict[str, str | int | bool] = {
            ATTR_REASON: event.reason,
            ATTR_TOKENS_BEFORE: event.tokens_before,
            ATTR_TOKENS_AFTER: event.tokens_after,
            ATTR_MESSAGES_FOLDED: event.messages_folded,
            ATTR_STALLED: isinstance(event, FoldStalled),
        }
        if isinstance(event, FoldApplied | FoldStalled):
            attributes[ATTR_DEGRADED] = isinstance(event, FoldApplied) and event.degraded
        else:
            attributes[ATTR_CAUSE] = event.cause
        span.set_attributes(attributes)
        if isinstance(event, BackgroundSummaryApplied):
            span.set_attribute(ATTR_BACKGROUND, True)


class SummarizerCall:
    """The open summarizer span; :meth:`record` the summary's usage before it closes."""

    __slots__ = ("_attributes", "_metrics", "_span")

    def __init__(self, span: Span | None, metrics: _Metrics | None, attributes: dict[str, Any]) -> None:
        self._span = span
        self._metrics = metrics
        self._attributes = attributes

    def record(self, usage: Usage, *, response_model: str | None = None) -> None:
        """The tokens the call consumed and the model that answered."""
        if response_model is not None:
            # Shared with the duration histogram, which is recorded when the span closes.
            self._attributes[GEN_AI_RESPONSE_MODEL] = response_model
        span = self._span
        if span is not None and span.is_recording():
            span.set_attributes(
                {GEN_AI_INPUT_TOKENS: usage.input_tokens, GEN_AI_OUTPUT_TOKENS: usage.output_tokens}
            )
            if response_model is not None:
                span.set_attribute(GEN_AI_RESPONSE_MODEL, response_model)
        if self._metrics is not None:
            tokens = self._metrics.summarizer_tokens
            tokens.record(usage.input_tokens, {**self._attributes, GEN_AI_TOKEN_TYPE: "input"})
            tokens.record(usage.output_tokens, {**self._attributes, GEN_AI_TOKEN_TYPE: "output"})


def _event_attributes(event: CompactionEvent) -> dict[str, str | int | float | bool]:
    attributes: dict[str, str | int | float | bool] = {
        ATTR_REASON: event.reason,
        ATTR_TOKENS_BEFORE: event.tokens_before,
        ATTR_TOKENS_AFTER: event.tokens_after,
        ATTR_MESSAGES_FOLDED: event.messages_folded,
    }
    if event.summarizer_model is not None:
        attributes[GEN_AI_REQUEST_MODEL] = event.summarizer_model
    if isinstance(event, FoldConflict | BackgroundSummaryDiscarded):
        attributes[ATTR_CAUSE] = event.cause
    if isinstance(event, SummaryDegraded) and event.error_type:
        attributes[ERROR_TYPE] = event.error_type
    return attributes


@contextmanager
def _marked(span: Span) -> Iterator[None]:
    """Mark how the block ended: ``error.type`` for an error, a flag for a cancellation."""
    try:
        yield
    except Exception as exc:
        span.set_attribute(ERROR_TYPE, error_type(exc))
        raise
    except BaseException:
        # Cancellation is how a task group stops work, not a failure of the fold.
        span.set_attribute(ATTR_CANCELLED, True)
        raise


class Telemetry:
    """Spans and metrics for one compactor; every method is a no-op when OpenTelemetry is absent.

    Build it with :meth:`create` (the global providers unless given) or
    :meth:`disabled`.
    """

    __slots__ = ("_metrics", "_tracer")

    def __init__(self, tracer: Tracer | None = None, metrics: _Metrics | None = None) -> None:
        self._tracer = tracer
        self._metrics = metrics

    @classmethod
    def create(
        cls,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> Telemetry:
        """Telemetry on these providers (the global ones by default); disabled without OpenTelemetry."""
        try:
            from opentelemetry import trace
        except ImportError:
            return cls.disabled()
        tracer = trace.get_tracer(INSTRUMENTATION_NAME, _version(), tracer_provider=tracer_provider)
        return cls(tracer, _Metrics(meter_provider))

    @classmethod
    def disabled(cls) -> Telemetry:
        """Telemetry that records nothing and costs next to nothing."""
        return cls()

    @property
    def enabled(self) -> bool:
        """OpenTelemetry is installed; whether anything is exported is up to its providers."""
        return self._tracer is not None

    def _recording_tracer(self) -> Tracer | None:
        """The tracer, or ``None`` while it is OpenTelemetry's API with no SDK behind it.

        Such a tracer's spans record nothing and only pass the caller's span on,
        yet opening two of them costs more than the rest of a fold's bookkeeping.
        Asked at every fold, since an SDK may be set up after the compactor.
        """
        tracer = self._tracer
        if tracer is None:
            return None
        from opentelemetry import trace

        if isinstance(tracer, trace.NoOpTracer):
            return None
        if isinstance(tracer, trace.ProxyTracer) and isinstance(
            trace.get_tracer_provider(), trace.ProxyTracerProvider
        ):
            return None
        return tracer

    @contextmanager
    def fold_span(
        self, thread: str, reason: str | None = None, *, background: bool = False
    ) -> Iterator[FoldSpan]:
        """Open the ``contextfold.fold`` span for one fold attempt; it becomes the current span."""
        tracer = self._recording_tracer()
        if tracer is None:
            yield FoldSpan(None)
            return
        from opentelemetry.trace import SpanKind

        attributes: dict[str, str | bool] = {ATTR_THREAD: thread, ATTR_BACKGROUND: background}
        if reason is not None:
            attributes[ATTR_REASON] = reason
        with (
            tracer.start_as_current_span(
                FOLD_SPAN_NAME, kind=SpanKind.INTERNAL, attributes=attributes
            ) as span,
            _marked(span),
        ):
            fold = FoldSpan(span)
            opened = _open_fold.set((self, fold))
            try:
                yield fold
            finally:
                _open_fold.reset(opened)

    @contextmanager
    def summarizer_span(
        self, model: str | None, *, max_tokens: int | None = None, provider: str | None = None
    ) -> Iterator[SummarizerCall]:
        """Open a GenAI ``summarize {model}`` span around one summarizer call, and time it.

        The duration lands in ``gen_ai.client.operation.duration`` (with
        ``error.type`` when the call raised); a cancelled call is marked on the
        span and left out of the histogram, since it measured no latency.
        """
        attributes: dict[str, Any] = {GEN_AI_OPERATION: SUMMARIZE_OPERATION}
        if model is not None:
            attributes[GEN_AI_REQUEST_MODEL] = model
        if provider is not None:
            attributes[GEN_AI_PROVIDER] = provider
        metrics = self._metrics
        if metrics is None:
            yield SummarizerCall(None, None, attributes)
            return
        tracer = self._recording_tracer()
        # Timed with or without a span: the metrics may have an SDK that the traces lack.
        scope = nullcontext() if tracer is None else self._client_span(tracer, model, max_tokens, attributes)
        started = time.perf_counter()
        with scope as span:
            try:
                yield SummarizerCall(span, metrics, attributes)
            except Exception as exc:
                duration = time.perf_counter() - started
                metrics.summarizer_duration.record(duration, {**attributes, ERROR_TYPE: error_type(exc)})
                raise
            metrics.summarizer_duration.record(time.perf_counter() - started, attributes)

    @staticmethod
    @contextmanager
    def _client_span(
        tracer: Tracer, model: str | None, max_tokens: int | None, attributes: dict[str, Any]
    ) -> Iterator[Span]:
        """The current ``summarize {model}`` span, marked with how the call ended."""
        from opentelemetry.trace import SpanKind

        name = f"{SUMMARIZE_OPERATION} {model}" if model else SUMMARIZE_OPERATION
        span_attributes = dict(attributes)
        if max_tokens is not None:
            span_attributes[GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        with (
            tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=span_attributes) as span,
            _marked(span),
        ):
            yield span

    def record_event(self, event: CompactionEvent) -> None:
        """A subscriber: note the event on the fold span open in this task, and count it in the metrics.

        Events are emitted by the task that runs the fold, inside its span, so
        every event of a fold reaches that span, whichever step of it emits it.
        """
        open_fold = _open_fold.get()
        if open_fold is not None and open_fold[0] is self:
            open_fold[1].record(event)
        metrics = self._metrics
        if metrics is None:
            return
        attributes: dict[str, str | bool] = {ATTR_REASON: event.reason}
        if isinstance(event, FoldApplied):
            background = isinstance(event, BackgroundSummaryApplied)
            metrics.folds.add(1, {**attributes, ATTR_DEGRADED: event.degraded, ATTR_BACKGROUND: background})
            metrics.tokens_saved.add(event.tokens_saved, attributes)
            metrics.fold_duration.record(event.duration_s, {**attributes, ATTR_BACKGROUND: background})
        elif isinstance(event, FoldStalled):
            metrics.stalls.add(1, attributes)
        elif isinstance(event, SummaryDegraded):
            if event.summarizer_model is not None:
                attributes[GEN_AI_REQUEST_MODEL] = event.summarizer_model
            if event.error_type:
                attributes[ERROR_TYPE] = event.error_type
            metrics.degraded.add(1, attributes)
        elif isinstance(event, FoldConflict | BackgroundSummaryDiscarded):
            metrics.discarded.add(1, {**attributes, ATTR_CAUSE: event.cause})
