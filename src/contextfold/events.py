"""Compaction events and their delivery, and OpenTelemetry for folds and summarizer calls.

Subscribe with ``Compactor(..., subscribers=[fn])`` or ``compactor.subscribe(fn)``;
a ``StepLoop`` hook receives them through ``Hook.on_compaction_event``.
"""

from ._events import (
    LOG_KEYS,
    BackgroundSummaryApplied,
    BackgroundSummaryDiscarded,
    BackgroundSummaryStarted,
    CompactionEvent,
    DiscardCause,
    EventDispatcher,
    FoldApplied,
    FoldConflict,
    FoldStalled,
    Subscriber,
    SummaryDegraded,
    event_line,
    log_event,
)
from ._telemetry import Telemetry

__all__ = [
    "LOG_KEYS",
    "BackgroundSummaryApplied",
    "BackgroundSummaryDiscarded",
    "BackgroundSummaryStarted",
    "CompactionEvent",
    "DiscardCause",
    "EventDispatcher",
    "FoldApplied",
    "FoldConflict",
    "FoldStalled",
    "Subscriber",
    "SummaryDegraded",
    "Telemetry",
    "event_line",
    "log_event",
]
