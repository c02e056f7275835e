"""Compaction events: what each fold did, as typed values, and their delivery.

The compactor emits one event per thing that happened to a thread's context::

    FoldApplied                 a fold replaced a prefix with a summary
    └── BackgroundSummaryApplied    ... with a summary computed in the background
    FoldStalled                 a trigger fired but nothing could be folded
    SummaryDegraded             a fold used the fallback's summary: the summarizer failed
    FoldConflict                a fold was discarded: the thread changed underneath it
    BackgroundSummaryStarted    a background summary of the prefix to fold began
    BackgroundSummaryDiscarded  a background summary was thrown away unapplied

``isinstance(event, FoldApplied)`` is true for every applied fold, foreground or
background, so a subscriber that counts folds sees each exactly once. Every
``BackgroundSummaryStarted`` is followed by exactly one
``BackgroundSummaryApplied`` or ``BackgroundSummaryDiscarded`` for that thread.

Subscribers are plain callables, sync or async, run by an
:class:`EventDispatcher` in registration order. Events are observations, not
hooks: a subscriber that raises is logged with its traceback and the others
still run. The default subscriber, :func:`log_event`, writes each event as one
line on the ``contextfold.compactor`` logger::

    fold thread="t-1" reason="token_count" tokens_before=9120 tokens_after=2210 ...

The line starts with the event's ``name``; then come ``key=value`` pairs in a
fixed order (the event's fields, see :data:`LOG_KEYS`), each value a JSON
literal: strings in double quotes, numbers, ``true``/``false``, ``null``.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

from ._episodes import Usage
from ._errors import ConfigError
from ._policy import Reason

__all__ = [
    "LOG_KEYS",
    "BackgroundSummaryApplied",
    "BackgroundSummaryDiscarded",
    "BackgroundSummaryStarted",
    "CompactionEvent",
    "CompactionEventHook",
    "DiscardCause",
    "EventDispatcher",
    "FoldApplied",
    "FoldConflict",
    "FoldStalled",
    "Subscriber",
    "SummaryDegraded",
    "deliver",
    "event_line",
    "hook_subscriber",
    "log_event",
]

events_logger = logging.getLogger("contextfold.compactor")
_dispatch_logger = logging.getLogger("contextfold.events")

DiscardCause: TypeAlias = Literal["conflict", "prefix_changed", "summarizer_failed", "closed", "error"]
"""Why a computed summary was thrown away.

``conflict``: another worker folded the thread, or its guarded part changed,
between the read and the write. ``prefix_changed``: the prefix a background
summary covers is no longer the context's prefix. ``summarizer_failed``: the
background summarizer raised, or returned an empty summary, and
``on_summarizer_error`` did not fall back (``"raise"`` raises the error in the
next step, ``"skip"`` reports a ``FoldStalled`` there). ``closed``: the summary's
owner closed first. ``error``: another error ended the background fold after its
summary began (a store error in its write, say); it is raised in the next step.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class _EventFields:
    """Fields every compaction event carries."""

    name: ClassVar[str]
    _level: ClassVar[int]

    thread: str
    reason: Reason | str
    """The trigger that fired: a :class:`Reason` (``token_count``, ``context_pressure``, ``manual``, ...)
    for every built-in trigger, a custom trigger's own name otherwise."""
    tokens_before: int
    """Tokens of the working context when the fold read it, plus what the compactor saw appended
    while its summary ran (a background summary runs while the agent works): the context the fold
    was applied to."""
    tokens_after: int
    """Tokens of the working context after the fold, those appends included; equal to
    ``tokens_before`` when nothing was applied, so ``tokens_saved`` is what the fold removed."""
    messages_folded: int = 0
    """Original messages replaced by the summary (or dropped, in drop mode)."""
    summarizer_model: str | None = None
    usage: Usage = field(default_factory=Usage)
    """What the summarizer calls behind this event consumed."""
    duration_s: float = 0.0
    """Wall time of what the event reports: the fold, or the background summary."""

    @property
    def level(self) -> int:
        """The logging level of this event's line."""
        return self._level

    @property
    def tokens_saved(self) -> int:
        return max(0, self.tokens_before - self.tokens_after)


@dataclass(frozen=True, slots=True, kw_only=True)
class FoldApplied(_EventFields):
    """A fold replaced a prefix of the working context with a summary."""

    name: ClassVar[str] = "fold"
    _level: ClassVar[int] = logging.INFO

    degraded: bool = False
    """The summary came from the fallback because the configured summarizer failed."""
    masked_messages: int = 0
    truncated_messages: int = 0
    checkpoint_seq: int | None = None
    """Episodic seq of the recorded ``SummaryCheckpoint``."""
    through_seq: int | None = None
    """Last short-term seq the fold replaced."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackgroundSummaryApplied(FoldApplied):
    """A fold was applied with a summary computed in the background; it is also a ``FoldApplied``.

    ``duration_s`` is the background summary's own wall time, from its start
    to its application. When what was appended meanwhile keeps the context
    over the trigger, the step that takes it folds again, with its own
    ``FoldApplied``.
    """

    name: ClassVar[str] = "background_applied"

    waited_s: float = 0.0
    """How long the step had waited for the summary when the fold was applied (0 when no step waited:
    the step reached the hard trigger after it was ready, or not at all)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FoldStalled(_EventFields):
    """A trigger fired but nothing could be folded; the next checks are skipped for a while."""

    name: ClassVar[str] = "fold_stalled"
    _level: ClassVar[int] = logging.WARNING

    detail: str
    """Why nothing could be folded, and what to change."""
    skipped_checks: int = 0
    """How many following checks of this thread are skipped (the back-off)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryDegraded(_EventFields):
    """The summarizer failed and the fallback's summary was used; emitted just before its ``FoldApplied``.

    ``summarizer_model`` names the summarizer that failed, ``fallback_model``
    the one whose summary was folded in, and ``usage`` is the fallback's.
    """

    name: ClassVar[str] = "summary_degraded"
    _level: ClassVar[int] = logging.WARNING

    fallback_model: str | None = None
    error_type: str = ""
    """The summarizer's exception class, e.g. ``contextfold.SummarizerError``."""
    error: str = ""
    """The summarizer's error message."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FoldConflict(_EventFields):
    """A computed fold was discarded because the thread changed underneath it.

    Another worker's fold of the same prefix stands; nothing was written and
    the same messages are not summarized again. ``usage`` is what the
    discarded summary cost.
    """

    name: ClassVar[str] = "fold_conflict"
    _level: ClassVar[int] = logging.INFO

    cause: DiscardCause = "conflict"


@dataclass(frozen=True, slots=True, kw_only=True)
class BackgroundSummaryStarted(_EventFields):
    """A summary of the prefix that would be folded began in the background.

    Emitted once the background fold holds the thread's lease and has planned
    its prefix, as its summarizer is called; ``messages_folded`` is how many
    messages that summary covers. A background fold that finds another
    worker's lease, or nothing to fold, begins nothing and emits nothing.
    """

    name: ClassVar[str] = "background_started"
    _level: ClassVar[int] = logging.DEBUG

    through_seq: int | None = None
    """Last short-term seq of the prefix being summarized."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackgroundSummaryDiscarded(_EventFields):
    """A background summary was thrown away without being applied."""

    name: ClassVar[str] = "background_discarded"
    _level: ClassVar[int] = logging.INFO

    cause: DiscardCause
    through_seq: int | None = None
    """Last short-term seq of the prefix the summary covered."""
    error: str = ""
    """The error's message, when ``cause`` is ``summarizer_failed`` or ``error``."""

    @property
    def level(self) -> int:
        return logging.WARNING if self.cause in ("summarizer_failed", "error") else logging.INFO


CompactionEvent: TypeAlias = (
    FoldApplied
    | BackgroundSummaryApplied
    | FoldStalled
    | SummaryDegraded
    | FoldConflict
    | BackgroundSummaryStarted
    | BackgroundSummaryDiscarded
)
"""Every event a compactor emits."""

Subscriber: TypeAlias = Callable[[CompactionEvent], Awaitable[None] | None]
"""Receives each event; may be a plain function or an ``async def``."""

_EVENT_TYPES: tuple[type[_EventFields], ...] = (
    FoldApplied,
    BackgroundSummaryApplied,
    FoldStalled,
    SummaryDegraded,
    FoldConflict,
    BackgroundSummaryStarted,
    BackgroundSummaryDiscarded,
)


def _log_keys(cls: type[_EventFields]) -> tuple[str, ...]:
    # ``usage`` is spread into its two counts, so every value on the line is a scalar.
    keys: list[str] = []
    for f in fields(cls):
        keys.extend(("input_tokens", "output_tokens") if f.name == "usage" else (f.name,))
    return tuple(keys)


LOG_KEYS: dict[str, tuple[str, ...]] = {cls.name: _log_keys(cls) for cls in _EVENT_TYPES}
"""For each event name, the keys of its log line, in order. They change only by additions at the end."""


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return json.dumps(value, ensure_ascii=False)


def event_line(event: CompactionEvent) -> str:
    """The event as one log line: its name, then ``key=value`` pairs in the order of ``LOG_KEYS``."""
    parts = [event.name]
    for f in fields(event):
        value = getattr(event, f.name)
        if isinstance(value, Usage):
            parts.append(f"input_tokens={value.input_tokens}")
            parts.append(f"output_tokens={value.output_tokens}")
        else:
            parts.append(f"{f.name}={_value(value)}")
    return " ".join(parts)


def log_event(event: CompactionEvent) -> None:
    """The default subscriber: one line per event on the ``contextfold.compactor`` logger.

    The record carries the event itself as ``record.contextfold_event`` for
    handlers that want the fields rather than the text.
    """
    if events_logger.isEnabledFor(event.level):
        events_logger.log(event.level, "%s", event_line(event), extra={"contextfold_event": event})


@runtime_checkable
class CompactionEventHook(Protocol):
    """A step-loop hook that wants compaction events."""

    async def on_compaction_event(self, event: CompactionEvent) -> None: ...


def hook_subscriber(hook: CompactionEventHook) -> Subscriber:
    """A subscriber that hands each event to ``hook.on_compaction_event``."""

    async def deliver(event: CompactionEvent) -> None:
        await hook.on_compaction_event(event)

    deliver.__qualname__ = f"hook_subscriber({hook!r})"
    return deliver


async def deliver(subscriber: Subscriber, event: CompactionEvent) -> None:
    """Hand ``event`` to one subscriber (sync or async); its failure is logged, not raised.

    Events are observations, not hooks: by the time one is emitted its fold is
    already durable (or already discarded), so raising here would report a
    failure that did not happen and starve the subscribers after this one.
    Cancellation and other BaseExceptions still propagate.
    """
    try:
        result = subscriber(event)
        if inspect.isawaitable(result):
            await result
    except Exception:
        _dispatch_logger.exception(
            "event subscriber %r failed on %s for thread %r; the others still run",
            subscriber,
            event.name,
            event.thread,
        )


class EventDispatcher:
    """Delivers each event to its subscribers, in the order they were registered.

    With ``log_events`` (the default) :func:`log_event` is the first
    subscriber, so every event is logged once, by this one path. Subscribers
    run inline, one after the other, inside the fold: keep them cheap, and hand
    slow work (a network export) to a queue or a task of your own. Events of a
    background summary are delivered from the task that computes it.
    """

    def __init__(self, subscribers: Iterable[Subscriber] = (), *, log_events: bool = True) -> None:
        self._subscribers: list[Subscriber] = [log_event] if log_events else []
        for subscriber in subscribers:
            self.subscribe(subscriber)

    @property
    def subscribers(self) -> tuple[Subscriber, ...]:
        return tuple(self._subscribers)

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Add ``subscriber`` after the others; returns a function that removes it again."""
        if not callable(subscriber):
            raise ConfigError(
                "subscriber",
                "must be a callable taking one event, e.g. a function or an async def",
                value=subscriber,
            )
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    async def emit(self, event: CompactionEvent) -> None:
        """Deliver ``event`` to every subscriber, awaiting the async ones in turn."""
        # A copy: a subscriber may unsubscribe itself (or another) while this runs.
        for subscriber in tuple(self._subscribers):
            await deliver(subscriber, event)
