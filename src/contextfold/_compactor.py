"""The ``Compactor``: recording, the per-step check, and the orchestration of one fold.

The per-step check is the hot path. It reads the store's maintained stats
(token total, version, newest seq; with the episodic policy the log's
counters too: one query on a ``Store`` either way) and returns ``None`` when
no trigger fires, without loading or tokenizing anything. The
context a step sends is cached per thread and extended with the rows it has
not seen, so a step decodes only new messages.

Only a firing trigger plans a fold: it takes the thread's lease (one
compactor per thread across processes), plans the cut from the cached
context, summarizes the newly dropped turns, and applies the fold — the
``SummaryCheckpoint`` and the prefix swap — as one store operation guarded
by the version it read. A fold that meets another worker's fold is
discarded: nothing is written and nothing is summarized again.

With ``background_at``, the summary of the prefix that would be folded starts
early, in a task of the compactor's task group (``async with Compactor(...)``),
and is applied at a later step if its prefix is unchanged.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple, Self, cast

import anyio
from anyio.abc import TaskGroup

from ._callables import closing
from ._config import RunOptions, Settings, SummarizeOptions, resolve_settings
from ._episodes import (
    Episode,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    ToolCallEpisode,
    Usage,
    episode_for,
)
from ._errors import ConfigError, ConflictError, SummarizerError
from ._events import (
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
)
from ._messages import SUMMARY_METADATA_KEY, Message, Role, ToolCall
from ._pacing import Pacer
from ._policy import TOKEN_REASONS, EpisodicCompactionPressure, Reason, Trigger, unchecked_pressure
from ._strategies import CompactionPlan, SlidingWindow, Strategy, _bounds, split_head, unanswered_calls
from ._telemetry import Telemetry, error_type
from ._tokens import TiktokenCounter, TokenCounter, check_counter
from ._trusted import trusted
from .stores._base import (
    ContextWindow,
    EpisodicStore,
    ShortTermStore,
    Store,
    StoredMessage,
    ThreadStats,
    implements,
)
from .stores._rows import (
    FIRST_SEQ,
    PREPARE_ON_LOOP_CHARS,
    Recording,
    encode_recording,
    fold_links,
    heavy_batch,
    not_a_sequence,
    off_loop_if_heavy,
    record_messages,
    summary_index,
    utc,
    writes_to,
)
from .summarizers._base import Summarizer, Summary
from .summarizers._checks import check_summarizers

__all__ = [
    "ABANDONED_METADATA_KEY",
    "SUMMARY_PREFIX",
    "TRUNCATED_METADATA_KEY",
    "CompactionResult",
    "Compactor",
]

logger = logging.getLogger("contextfold")

_TOOL = Role.TOOL
"""Looked up once: a member looked up on its enum class costs ten times a global."""

SUMMARY_PREFIX = "[compacted summary of earlier turns]\n"
"""Text that opens every summary message, so a person skimming a context can tell it apart."""

TRUNCATED_METADATA_KEY = "contextfold.truncated"
"""Metadata key on a tool result whose oversized output was cut to fit the hard limit."""

ABANDONED_METADATA_KEY = "contextfold.abandoned"
"""Metadata key on the error result contextfold writes for a tool call whose result never came."""

LATE_RESULT_METADATA_KEY = "contextfold.late_result"
"""Metadata key on the note that carries a tool result arriving after its call was closed."""

_MAX_BACKOFF_SKIPS = 32
_CACHED_THREADS = 1024

_SEEN_STANDS_FOR = 0.01
"""Seconds a read of a thread's stats stands for its state, while no store object of the process wrote it.

"Wrote" counts every write of the thread begun in the process by a bundled
store, and any such write under way at the read (it may commit after it):
see ``stores._rows.writes_to``. A custom store's writes reach no count, so
with one the check always reads.

The read is a check's, or the one a bundled store's step write makes of the
threads row it updates (returned with the rows): each is as fresh as a read
right after the commit. It serves the next check, ``context()``, and the
look a tool result takes at the store before its write (another worker may
have closed its call). A step's write, check, context and results come
microseconds apart; a ``before_request`` hook that waits on I/O, or a model
call, between them makes the next of them read the store again rather than
miss what another worker has since appended or folded. A write by another
process within that time is seen at the next read, as one landing right
after the read would be.
"""


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What one compaction did, or why it could not make progress."""

    thread: str
    reason: Reason | str
    """A :class:`Reason` for every built-in trigger; a custom trigger's own name otherwise."""
    dropped_messages: int
    dropped_turns: int
    tokens_before: int
    tokens_after: int
    usage: Usage = field(default_factory=Usage)
    duration_s: float = 0.0
    masked_messages: int = 0
    truncated_messages: int = 0
    summarizer_model: str | None = None
    degraded: bool = False
    checkpoint_seq: int | None = None
    """Episodic seq of the recorded ``SummaryCheckpoint``."""
    through_seq: int | None = None
    """Last short-term seq the fold replaced."""
    stalled: bool = False
    """True when the trigger fired but nothing could be folded."""
    detail: str = ""
    background: bool = False
    """True when the summary was computed ahead of time, off the step's path."""

    @property
    def compacted(self) -> bool:
        return not self.stalled


_NO_CALLS: tuple[ToolCall, ...] = ()
"""``append``'s default ``started``: known good, so the common step skips checking it."""


class _LlmCall(NamedTuple):
    """The request behind the assistant replies ``append`` records (see ``episode_for``)."""

    model: str | None
    usage: Usage | None
    request_messages: int
    request_tokens: int


@dataclass(slots=True)
class _Backoff:
    """Per-thread memory of fruitless attempts, so a stuck thread is not re-planned every step."""

    failures: int = 0
    skips_left: int = 0


@dataclass(frozen=True, slots=True)
class _Rows:
    """The rows a fold plans over, as parallel lists: each row's message, tokens, seq and episode seq."""

    messages: list[Message]
    tokens: list[int]
    seqs: list[int]
    links: list[int | None]
    open_calls: tuple[ToolCall, ...] | None = None
    """The calls no result answers, in the order they were made, when known without reading the rows."""

    @classmethod
    def of(cls, rows: Sequence[StoredMessage]) -> _Rows:
        return cls(
            [row.message for row in rows],
            [row.tokens for row in rows],
            [row.seq for row in rows],
            [row.episode_seq for row in rows],
        )

    def unanswered(self) -> list[tuple[int, ToolCall]]:
        """``unanswered_calls(self.messages)``, found from ``open_calls`` when there is at most one.

        Several open calls made by one message are ordered as ``unanswered_calls``
        orders them only by reading every row, so they are read.
        """
        calls = self.open_calls
        if calls is None or len(calls) > 1:
            return unanswered_calls(self.messages)
        if not calls:
            return []
        (call,) = calls
        # No call after it reuses its id (open_calls would be None), so it is the newest made.
        index = next(
            index
            for index in range(len(self.messages) - 1, -1, -1)
            if any(made is call for made in self.messages[index].tool_calls)
        )
        return [(index, call)]


@dataclass(slots=True)
class _Cache:
    """A thread's working context as this process last saw it, valid at ``version``.

    Each row is kept as its message beside plain lists of its seq, tokens and
    episode seq, not as a ``StoredMessage``: numbers in a list are nothing the
    garbage collector walks, so a thousand cached threads cost a full collection
    their messages and no more. A fold plans over a ``snapshot()`` of the lists.
    """

    version: int
    last_seq: int = 0
    plain: list[Message] = field(default_factory=list)
    """The rows' messages, in seq order: a step's context is one copy of this list."""
    seqs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    links: list[int | None] = field(default_factory=list)
    total_tokens: int = 0
    turns: int = 0
    """Messages other than tool results, which belong to their call's turn: kept as rows arrive."""
    open_calls: dict[str, ToolCall] = field(default_factory=dict)
    """Tool calls in the context that no result answers yet, by id."""
    reused_open_id: bool = False
    """Some call was made while another with its id was open: ``open_calls`` kept only the newer one."""

    @classmethod
    def of(cls, window: ContextWindow) -> _Cache:
        cache = cls(window.version, last_seq=FIRST_SEQ - 1)  # a longer edit's rows go below seq 1
        cache.extend(window.messages)
        cache.last_seq = max(cache.last_seq, window.last_seq)
        return cache

    def extend(self, rows: Sequence[StoredMessage]) -> None:
        """Add the rows newer than the cache's, in seq order; those it holds already are skipped.

        Two tasks can bring one cache up to date at once (a step's ``append`` and
        a background fold's read of the rows after ``last_seq``): whichever comes
        second finds some of its rows here already.
        """
        if rows and rows[0].seq <= self.last_seq:
            last = self.last_seq
            rows = [row for row in rows if row.seq > last]
        plain, seqs, tokens, links = self.plain, self.seqs, self.tokens, self.links
        start = len(plain)
        added = 0
        for row in rows:
            plain.append(row.message)
            seqs.append(row.seq)
            tokens.append(row.tokens)
            links.append(row.episode_seq)
            added += row.tokens
        if len(plain) > start:
            self.total_tokens += added
            self.last_seq = max(self.last_seq, seqs[-1])
            self._track(plain[start:])

    def _track(self, messages: Iterable[Message]) -> None:
        """Count the messages' turns and note the calls they make or answer, in order."""
        open_calls = self.open_calls
        tool = Role.TOOL  # a member looked up on its enum class costs more than the rest of the loop
        turns = 0
        for message in messages:
            for call in message.tool_calls:
                if call.id in open_calls:
                    self.reused_open_id = True
                open_calls[call.id] = call
            if message.role is not tool:
                turns += 1
            elif message.tool_call_id is not None:
                open_calls.pop(message.tool_call_id, None)
        self.turns += turns

    def folded(
        self,
        version: int,
        through_seq: int,
        replacement: list[Message],
        tokens: list[int],
        *,
        checkpoint: SummaryCheckpoint | None = None,
        checkpoint_seq: int | None = None,
    ) -> _Cache:
        """This cache once a fold replaced its rows through ``through_seq``: what ``extend`` would build.

        The rows after the cut are the same rows, so their lists are slices of
        these; only their turns and calls are gone over again, since the calls
        the folded rows made are gone. With ``checkpoint_seq`` (one ``Store``'s
        fold, with its ``checkpoint``) the replacement rows link as
        ``Store.fold`` links them; without it (``replace_prefix``) they link
        nothing.
        """
        start = bisect.bisect_right(self.seqs, through_seq)
        size = len(replacement)
        replaced: list[int | None] = [None] * size
        if checkpoint is not None and checkpoint_seq is not None:
            ends = min(size, start)
            seqs, links = self.seqs, self.links
            replaced = fold_links(
                checkpoint,
                checkpoint_seq,
                size=size,
                summary_at=summary_index(replacement, checkpoint),
                count=start,
                first=list(zip(seqs[:ends], links[:ends], strict=True)),
                last=list(zip(seqs[start - ends : start], links[start - ends : start], strict=True)),
            )
        folded = _Cache(
            version,
            # through_seq is one of these rows' seqs, so neither it nor any kept seq is newer.
            last_seq=self.last_seq,
            plain=replacement + self.plain[start:],
            seqs=[*range(through_seq - len(replacement) + 1, through_seq + 1), *self.seqs[start:]],
            tokens=tokens + self.tokens[start:],
            links=replaced + self.links[start:],
        )
        folded.total_tokens = sum(folded.tokens)
        folded._track(folded.plain)
        return folded

    def snapshot(self) -> _Rows:
        """The rows as they are now, in lists of their own (a step may extend the cache meanwhile)."""
        open_calls = None if self.reused_open_id else tuple(self.open_calls.values())
        return _Rows(self.plain.copy(), self.tokens.copy(), self.seqs.copy(), self.links.copy(), open_calls)

    @property
    def messages(self) -> list[Message]:
        return self.plain.copy()


@dataclass(slots=True)
class _Prepared:
    """A fold computed and ready to apply: the plan, the summary and the guarded write."""

    thread: str
    reason: str
    version: int
    through_seq: int
    replacement: list[Message]
    tokens: list[int]
    checkpoint: SummaryCheckpoint
    plan: CompactionPlan
    truncated: int
    removed_tokens: int
    tokens_before: int
    summary: Summary | None
    started: float
    writes: int | None
    """``writes_to(thread)`` before the rows were read: a write since (while summarizing) is not in them."""


@dataclass(slots=True)
class _Background:
    """A fold being summarized, and written, ahead of the hard trigger for one thread."""

    done: anyio.Event = field(default_factory=anyio.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    """Set with ``done``, for a step on another thread's event loop (see ``_background_done``)."""
    result: CompactionResult | None = None
    error: Exception | None = None
    begun: BackgroundSummaryStarted | None = None
    """The event that said its summary began: what a discard reports, if it comes to that."""
    begun_at: float = 0.0
    settled: bool = False
    """An applied or discarded event was emitted for it."""
    waiting_since: float | None = None
    """When a step at the hard trigger began to wait for it, while one waits."""
    waited_before: float = 0.0
    """How long steps waited for it before they were cancelled (their waits ended without it)."""


_running_job: ContextVar[_Background | None] = ContextVar("contextfold_background_job", default=None)
"""The background fold the current task computes (``None`` in a step): its summary is reported as one."""


def _placed(rows: _Rows, sent: Sequence[Message], answering: list[int]) -> dict[int, list[int]] | None:
    """Where the batch's results at ``answering`` go: the row after which each goes -> their indexes.

    Right after its call and the results there. ``None`` when one answers no
    open call of ``rows``.
    """
    calls_at = _answered_at(rows.unanswered(), [sent[index] for index in answering])
    return None if calls_at is None else _after_calls(rows.messages, calls_at, answering)


def _after_calls(context: list[Message], calls_at: list[int], indexes: list[int]) -> dict[int, list[int]]:
    """Where each result goes, right after its call and the results there: that row -> ``indexes``."""
    after: dict[int, list[int]] = {}
    for index, call_at in zip(indexes, calls_at, strict=True):
        end = call_at + 1
        while end < len(context) and context[end].role is _TOOL:
            end += 1
        after.setdefault(end, []).append(index)
    return after


def _plan_indexes(plan: dict[int, list[int]]) -> list[int]:
    """The batch indexes a placement puts in the context, in batch order."""
    return sorted(index for indexes in plan.values() for index in indexes)


def _replacement(
    rows: _Rows,
    plan: dict[int, list[int]],
    sent: Sequence[Message],
    counts: list[int],
    owners: Sequence[int | None],
) -> tuple[list[Message], list[int], list[int | None], list[int | None], dict[int, int]]:
    """The context with the batch placed: messages, tokens, episode links, ``stands_for``, batch rows."""
    replacement: list[Message] = []
    tokens: list[int] = []
    links: list[int | None] = []
    stands_for: list[int | None] = []
    batch_rows: dict[int, int] = {}  # batch index -> its row in the replacement

    def new_row(index: int) -> None:
        batch_rows[index] = len(replacement)
        replacement.append(sent[index])
        tokens.append(counts[index])
        links.append(owners[index])
        stands_for.append(None)

    old = rows.messages
    for position in range(len(old) + 1):
        for index in plan.get(position, ()):
            new_row(index)
        if position < len(old):
            replacement.append(old[position])
            tokens.append(rows.tokens[position])
            links.append(None)
            stands_for.append(rows.seqs[position])
    placed = set(_plan_indexes(plan))
    for index in range(len(sent)):
        if index not in placed:
            new_row(index)
    return replacement, tokens, links, stands_for, batch_rows


def _answered_at(unanswered: list[tuple[int, ToolCall]], results: Sequence[Message]) -> list[int] | None:
    """The row of the call each result answers, or ``None`` when one answers no open call.

    As ``unanswered_calls`` pairs them: a result answers the newest open call
    with its id, so results for an id a later reply reused while it was open
    answer the newer call first, then the older.
    """
    open_by_id: dict[str, list[int]] = {}
    for index, call in unanswered:  # in row order: the newest of an id is last
        open_by_id.setdefault(call.id, []).append(index)
    rows: list[int] = []
    for result in results:
        waiting = open_by_id.get(result.tool_call_id or "")
        if not waiting:
            return None
        rows.append(waiting.pop())
    return rows


def _context_results(messages: Sequence[Message]) -> list[int]:
    """The indexes of the tool results no call made earlier in the batch answers (see ``_answer``)."""
    made: dict[str, int] = {}
    found: list[int] = []
    for index, message in enumerate(messages):
        for made_call in message.tool_calls:
            made[made_call.id] = made.get(made_call.id, 0) + 1
        if message.role is _TOOL and not _answer(made, message):
            found.append(index)
    return found


def _results_after_their_calls(context: list[Message], results: list[int]) -> list[int] | None:
    """The context's order with each of ``results`` right after its call's results; ``None`` if none moves.

    A result moves when a message other than a tool result lies between it and
    the newest call before it with its id.
    """
    calls_at: list[int] = []
    moved: list[int] = []
    for index in sorted(results):
        id_ = context[index].tool_call_id
        at = next(
            (i for i in range(index - 1, -1, -1) if any(c.id == id_ for c in context[i].tool_calls)), None
        )
        if at is not None and not all(m.role is _TOOL for m in context[at + 1 : index]):
            calls_at.append(at)
            moved.append(index)
    if not moved:
        return None
    moving = _after_calls(context, calls_at, moved)  # (a message lies before each one: it stops there)
    gone = set(moved)
    order: list[int] = []
    for position in range(len(context)):
        order += moving.get(position, [])
        if position not in gone:
            order.append(position)
    return order


def _newest_reply(context: list[Message]) -> int:
    """The row just after the newest message that is not a tool result (0 if there is none)."""
    end = len(context)
    while end and context[end - 1].role is _TOOL:
        end -= 1
    return end


_TOKEN_AIMED = TOKEN_REASONS | {Reason.MANUAL, Reason.MANUAL_RECOVERY}
"""Reasons whose fold aims at the token target (a manual fold does too, whatever the triggers say)."""


def _may_be_abandoned(cache: _Cache, settings: Settings) -> bool:
    """Whether a call open in the cached context may be abandoned by now (read without copying it)."""
    if cache.reused_open_id:  # its open_calls may miss one
        return True
    if not cache.open_calls:
        return False
    # The newest reply's calls have no turn after them: none of those is abandoned by turns yet.
    return settings.abandon_after_seconds is not None or not _all_made_by_the_newest_reply(
        cache.plain, cache.open_calls
    )


def _all_made_by_the_newest_reply(context: list[Message], calls: Mapping[str, ToolCall]) -> bool:
    """Whether every one of the open ``calls`` was made by the newest reply, with only results after it."""
    end = _newest_reply(context)
    made = context[end - 1].tool_calls if end else ()
    if len(made) == 1:  # the common step: one call, made by the reply just recorded
        return len(calls) == 1 and made[0].id in calls
    ids = {call.id for call in made}
    return all(id_ in ids for id_ in calls)


def _away_from_the_newest_reply(context: list[Message], results: Sequence[Message]) -> bool:
    """Whether a result answers a call other than an open one of the newest reply (only results follow it)."""
    end = _newest_reply(context)
    if not end:
        return True
    waiting: dict[str, int] = {}
    for made in context[end - 1].tool_calls:
        waiting[made.id] = waiting.get(made.id, 0) + 1
    for answered in (*context[end:], *results):  # its results so far, then the batch's
        if not _answer(waiting, answered):
            return True
    return False


def _checked(summary: Summary, summarizer: Summarizer) -> Summary:
    """``summary``, once known to hold text a store can keep; else the summarizer's ``SummarizerError``."""
    if not summary.text.strip():
        raise SummarizerError(f"summarizer {summarizer!r} returned an empty summary")
    _check_storable(summary.text, summarizer)
    return summary


def _check_storable(text: str, summarizer: Summarizer) -> None:
    """Raise ``SummarizerError`` for a summary no store can hold: a lone surrogate, which JSON may carry.

    As the summarizer's failure, it meets ``on_summarizer_error``; as the
    summary message's own ``InvalidMessageError`` it stopped every fold of the
    thread, with no fallback.
    """
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise SummarizerError(
            f"summarizer {summarizer!r} returned a summary no store can hold: {exc.reason} "
            f"{text[exc.start]!r} at character {exc.start}"
        ) from None


def _summary_body(message: Message) -> str:
    return message.text.removeprefix(SUMMARY_PREFIX)


class Compactor:
    """Records threads and folds their older part, by a preset or by triggers and strategies.

    ``options`` is a :class:`SummarizeOptions` preset (or :class:`RunOptions`
    holding one plus the hard history limit); ``trigger`` and ``strategy``
    (one strategy or a pipeline) replace the preset's, or stand alone.
    ``store`` is one object implementing both store protocols (every bundled
    backend does), which makes recording and folding single transactions;
    pass ``short_term`` and ``episodic`` to use two objects, and then each is
    two writes: a crash between them can leave a fold applied without its
    checkpoint, or a message recorded but not in the context.

    The summarizer defaults to the offline :class:`ExtractiveSummarizer`,
    which is also the fallback when ``on_summarizer_error="fallback"``. Use
    ``async with Compactor(...)`` for background folding: its task group owns
    the background summaries and cancels them on exit.
    """

    def __init__(
        self,
        store: Store | None = None,
        *,
        options: RunOptions | SummarizeOptions | None = None,
        trigger: Trigger | None = None,
        strategy: Strategy | Sequence[Strategy] | None = None,
        summarizer: Summarizer | None = None,
        counter: TokenCounter | None = None,
        short_term: ShortTermStore | None = None,
        episodic: EpisodicStore | None = None,
        fallback: Summarizer | None = None,
        subscribers: Sequence[Subscriber] = (),
        log_events: bool = True,
        telemetry: Telemetry | None = None,
    ) -> None:
        from ._config import check_summary_room
        from .summarizers import ExtractiveSummarizer

        short = short_term if short_term is not None else store
        log = episodic if episodic is not None else store
        if not implements(short, ShortTermStore):
            raise ConfigError(
                "short_term" if short_term is not None else "store",
                "must implement ShortTermStore; pass a MemoryStore, SQLiteStore or PostgresStore",
                value=short,
            )
        if not implements(log, EpisodicStore):
            raise ConfigError(
                "episodic" if episodic is not None else "store",
                "must implement EpisodicStore; pass a MemoryStore, SQLiteStore or PostgresStore",
                value=log,
            )
        self.short_term: ShortTermStore = cast(ShortTermStore, short)
        self.episodic: EpisodicStore = cast(EpisodicStore, log)
        bundled = short is log and implements(short, Store)  # type: ignore[comparison-overlap]
        self._store: Store | None = cast(Store, short) if bundled else None
        self.options = options
        self.settings: Settings | None = resolve_settings(options, trigger, strategy)
        if counter is not None:
            check_counter(counter)
        self.counter: TokenCounter = counter if counter is not None else TiktokenCounter()
        self.fallback: Summarizer = (
            fallback if fallback is not None else ExtractiveSummarizer(counter=self.counter)
        )
        check_summarizers(summarizer=summarizer, fallback=fallback)
        if self.settings is not None:  # a chat model knows its window, the extractive one its headings
            check_summary_room(
                self.settings, options, summarizer=summarizer, fallback=fallback, default=self.fallback
            )
        self.summarizer: Summarizer = summarizer if summarizer is not None else self.fallback
        if callable(subscribers) or not_a_sequence(subscribers):
            raise ConfigError(
                "subscribers", "must be a list of callables, e.g. subscribers=[on_event]", value=subscribers
            )
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise ConfigError(
                "telemetry",
                "must be a contextfold.Telemetry: Telemetry.create() (OpenTelemetry's global providers, "
                "the default) or Telemetry.disabled()",
                value=telemetry,
            )
        self.events = EventDispatcher(subscribers, log_events=log_events)
        self.telemetry = telemetry if telemetry is not None else Telemetry.create()
        if self.telemetry.enabled:
            self.events.subscribe(self.telemetry.record_event)
        self._backoff: dict[str, _Backoff] = {}
        self._cache: OrderedDict[str, _Cache] = OrderedDict()
        self._seen: dict[str, tuple[ThreadStats, float, int | None]] = {}
        """Per thread: the stats last read, when, and ``writes_to(thread)`` before the read.

        Read by a check, a fold, a tool result's look at the store, or the
        step's own write (then the count includes that write); see
        ``_SEEN_STANDS_FOR``. As many threads as the cache holds.
        """
        self._overhead: dict[str, int] = {}
        self._next_fold_at: dict[str, tuple[int, int]] = {}
        """Per thread, the version a fold left and the tokens the next token fold waits for on it.

        Void once the thread's version moves: another worker folded it, or it
        was forgotten and started over, and the wait was for a context gone.
        """
        self._pending_since: dict[tuple[str, str], float] = {}
        self._unanswered: dict[str, Counter[str]] = {}
        """With two stores (no cached context): per thread, the calls this compactor appended unanswered."""
        self._reckoned: OrderedDict[str, None] = OrderedDict()
        """With two stores: the threads whose unanswered calls were read once in this process."""
        self._passed: dict[str, set[str]] = {}
        """Those of them some other message followed: their results go in place (see ``_place_results``)."""
        self._background: dict[str, _Background] = {}
        self._task_group: TaskGroup | None = None
        self._counter_ready: TokenCounter | None = None
        """The counter whose ``aload`` has been awaited (``counter`` may be swapped)."""
        self._writer = _recording_writer(self._store)
        """The bundled stores' write of a recording encoded here (see ``append``)."""
        self._encode_steps = not getattr(self._store, "_KEEPS_EPISODES", False)
        """Whether that write needs the step's JSON (a ``MemoryStore`` keeps the checked copies)."""
        self._turn = _crowded_turn(short)
        """The bundled store's ``Pacer.turn``, taken before a step is counted; ``None`` for other stores."""
        self._warned_background = False
        self._group_thread = 0
        """The OS thread whose event loop entered this compactor: its background folds run there."""

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Deliver every compaction event to ``subscriber`` (sync or async); returns its unsubscribe."""
        return self.events.subscribe(subscriber)

    async def _emit(self, event: CompactionEvent) -> None:
        await self.events.emit(event)

    # Lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Open the task group that runs background folds until the block ends.

        A compactor can be entered again once its block has ended (its caches
        and hold-backs are worth keeping between runs), but not while it is
        entered: one task group owns its background folds at a time.
        """
        if self._task_group is not None:
            raise ConfigError(
                "Compactor",
                "is already entered; use one 'async with' per compactor at a time (enter it once "
                "around every StepLoop that shares it)",
            )
        group = anyio.create_task_group()
        await group.__aenter__()
        self._task_group = group
        self._group_thread = threading.get_ident()
        self._warned_background = False
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel background summaries and wait for them; the stores stay open (they are yours).

        A background fold already being written is finished first, and its
        events reach every subscriber: a subscriber that never returns keeps
        this waiting (subscribers are to be cheap, see ``EventDispatcher``).
        Until it is entered again, the compactor folds in the step.
        """
        group, self._task_group = self._task_group, None
        if group is None:
            return
        group.cancel_scope.cancel()
        await group.__aexit__(None, None, None)

    # Recording ---------------------------------------------------------------

    async def append(
        self,
        thread: str,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        usage: Usage | None = None,
        request_messages: int = 0,
        request_tokens: int = 0,
        extra_episodes: Sequence[Episode] = (),
        started: Sequence[ToolCall] = _NO_CALLS,
    ) -> list[StoredMessage]:
        """Record messages in the episodic log and append them to the working context.

        On a ``Store`` both happen in one transaction; with two stores the log
        is written first, so no message reaches the context unrecorded. The
        LLM-call fields describe the request that produced an assistant reply;
        its ``usage`` teaches the check what the provider counts beyond the
        messages (tool schemas, instructions): ``usage.input_tokens`` less
        ``request_tokens``, the sent messages' tokens as this compactor counts
        them (``Step.request_tokens``, without that overhead). ``started`` names tool calls
        that ran: each is recorded as a ``ToolCallEpisode`` right before the
        result that answers it, in the same transaction (so
        ``append(thread, [reply, *results], started=reply.tool_calls)`` records
        a whole step at once). A tool result whose call is no longer open in
        the context (it was closed as abandoned) is recorded as it came, and
        reaches the context as a plain note instead of an orphaned tool message.
        """
        if not_a_sequence(messages, Message):
            raise ConfigError("messages", "must be a sequence of Message objects", value=messages)
        messages = list(messages)
        for message in messages:
            if not isinstance(message, Message):
                raise ConfigError("messages", "must hold Message objects only", value=message)
        if model is not None or usage is not None or request_messages or request_tokens:
            _check_llm_call(model, usage, request_messages, request_tokens)
        if started is not _NO_CALLS:
            if not_a_sequence(started, ToolCall):
                raise ConfigError("started", "must be a sequence of ToolCall objects", value=started)
            for ran in started:
                if not isinstance(ran, ToolCall):
                    raise ConfigError(
                        "started", "must hold ToolCall objects only, e.g. reply.tool_calls", value=ran
                    )
        sent = messages
        answering: list[int] = []  # the batch's results that answer calls of the context
        for message in messages:
            if message.role is _TOOL:  # only a tool result can be late
                sent = await self._sent(thread, messages)
                answering = _context_results(sent)
                break
        if self._counter_ready is not self.counter:  # checked here: a step pays no extra await
            await self._ready_counter()
        call = _LlmCall(model, usage, request_messages, request_tokens)
        if answering and self._may_place(thread, sent, answering):
            placed = await self._append_in_place(
                thread, messages, sent, answering, extra_episodes, call, started
            )
            if placed is not None:
                if usage is not None and usage.input_tokens and request_tokens:
                    self._learn_overhead(thread, usage.input_tokens, request_tokens)
                return placed
        if self._turn is not None:  # in a crowded loop, the count below and the write are a turn each
            await self._turn()
        writer = self._bundled_writer()
        # Counting a large batch, or a large tool result, would stall the loop: a worker thread does it.
        heavy = heavy_batch(messages)
        if writer is not None and sent is messages and not extra_episodes and not started:
            # The common step: each message checked, counted and encoded once, here, and the
            # store writes what this encoded.
            if heavy:
                recording = await anyio.to_thread.run_sync(self._recording, messages, call)
            else:
                recording = self._recording(messages, call)
            stored = await self._written(writer, thread, recording)
        else:
            episodes, owners = _step_episodes(extra_episodes, messages, call, started)
            if heavy:
                tokens = await anyio.to_thread.run_sync(self._counts, sent)
            else:
                tokens = self._counts(sent)
            if writer is not None:  # the bundled store's record_and_append, returning the stats too
                encoded = await off_loop_if_heavy(sent, encode_recording, episodes, sent, tokens, owners)
                stored = await self._written(writer, thread, encoded)
            elif self._store is not None:
                stored = await self._store.record_and_append(
                    thread, episodes, sent, tokens, message_episodes=owners
                )
            else:
                with anyio.CancelScope(shield=True):  # the log written, the context takes the batch too
                    for episode in episodes:
                        await self.episodic.record(thread, episode)
                    stored = await self.short_term.append(thread, sent, tokens)
                self._track_unanswered(thread, sent)
        cache = self._cache.get(thread)
        if cache is not None and stored and stored[0].seq == cache.last_seq + 1:
            cache.extend(stored)
        elif stored:
            self._forget_cache(thread)
            if answering and cache is not None and self._store is not None:
                # Another writer's rows came between the context this read and the write: a result
                # may now follow someone's message instead of its call.
                stored = await self._results_back_in_place(thread, stored, [stored[i] for i in answering])
        if usage is not None and usage.input_tokens and request_tokens:
            self._learn_overhead(thread, usage.input_tokens, request_tokens)
        return stored

    def _learn_overhead(self, thread: str, input_tokens: int, request_tokens: int) -> None:
        """What the provider billed beyond the messages sent (tool schemas, instructions) stands as overhead.

        ``request_tokens``: the messages of that request as this compactor counts them.
        """
        self._overhead[thread] = max(0, input_tokens - request_tokens)

    async def _written(self, writer: _Writer, thread: str, recording: Recording) -> list[StoredMessage]:
        """``writer``'s write of ``recording``; the thread's stats it read back stand for the next read."""
        writes, at = writes_to(thread), time.monotonic()
        stored, written = await writer(thread, recording)
        if written is not None and writes is not None:  # one more write: the step's own
            self._note_seen(thread, (written, at, writes + 1))
        return stored

    async def sync(
        self,
        thread: str,
        messages: Sequence[Message],
        *,
        ids: Sequence[str | None] | None = None,
        compact: bool = True,
    ) -> list[Message] | None:
        """Take a framework's whole message list: record what is new, compact, return the changed context.

        Messages already recorded (known by ``ids``, by the key contextfold put in
        their metadata, or by their content) are not recorded again, also after a
        restart: what was recorded is read from the log. Returns the working
        context when it differs from ``messages``, ``None`` when it does not.
        Every adapter in ``contextfold.integrations`` is built on this.
        """
        from ._sync import sync

        return await sync(self, thread, messages, ids=ids, compact=compact)

    async def count_beside(self, thread: str, messages: Sequence[Message]) -> None:
        """Count ``messages``, sent beside ``thread``'s context in each request, as a pinned head is counted.

        For an adapter whose framework sends an agent's instructions (its
        system prompt) outside the history it syncs: an agent's ``instructions``
        in the Agents SDK and pydantic-ai. Their tokens stand as the thread's
        provider overhead, so they count toward the trigger and the target as a
        pinned head does: a fold leaves room for them, and one they alone keep
        at the target stalls instead of calling the summarizer. A reply's
        ``usage`` (see ``append``) holds them already: whichever of the two
        came last stands, so they are never counted twice. Say it before each
        request; ``[]`` when nothing is sent beside the context.
        """
        if not_a_sequence(messages, Message) or not all(isinstance(m, Message) for m in messages):
            raise ConfigError(
                "messages",
                "must be a list of Message objects, e.g. [Message.system(instructions)], or [] for none",
                value=messages,
            )
        if self._counter_ready is not self.counter:
            await self._ready_counter()
        counts = await off_loop_if_heavy(messages, self._counts, list(messages))
        self._overhead[thread] = sum(counts)

    async def record_tool_call(self, thread: str, call: ToolCall) -> None:
        """Note in the audit trail that a tool the reply asked for started running."""
        await self.episodic.record(thread, ToolCallEpisode(call=call))

    async def complete_run(self, thread: str, *, clean: bool = True) -> None:
        """Record the end of a run; a clean end resets the unfinished-turns count."""
        await self.episodic.record(thread, RunCompletedEpisode(clean=clean))

    async def context(self, thread: str) -> list[Message]:
        """The working context the next request is built from (only rows not seen before are read).

        Right after a ``maybe_compact``, or a step's ``append`` on a bundled
        store (within ``_SEEN_STANDS_FOR``, 10 ms, and with no write to the
        thread by any store object of the process since), that read stands
        for it and nothing is read; else the rows appended since are read, or
        the whole context if it was folded.
        """
        cache = await self._fresh_cache(thread)
        if cache is not None:
            return cache.messages
        return (await self.short_term.load(thread)).plain

    async def context_tokens(self, thread: str) -> tuple[list[Message], int]:
        """The working context and its tokens as the trigger sees them (provider overhead included)."""
        messages, tokens = await self._counted_context(thread)
        return messages, tokens + self._overhead.get(thread, 0)

    async def _counted_context(self, thread: str) -> tuple[list[Message], int]:
        """The working context and its messages' own tokens: what a step's ``request_tokens`` is.

        Without the provider overhead: ``append`` learns that overhead as the
        reply's ``usage.input_tokens`` minus ``request_tokens``, so a request
        size that held the overhead already would cancel it out every other step.
        """
        cache = await self._fresh_cache(thread)
        if cache is not None:
            return cache.messages, cache.total_tokens
        window = await self.short_term.load(thread)
        return window.plain, window.total_tokens

    # The per-step check ----------------------------------------------------------

    async def maybe_compact(self, thread: str, *, now: datetime | None = None) -> CompactionResult | None:
        """Compact ``thread`` if a trigger fires; ``None`` when it does not (the cheap path).

        A background fold that finished is returned by the next check, unless the
        context is still over the trigger once it is applied (the agent appended
        while it was summarized, or it folded nothing): then the check folds in
        the step too, and returns that fold.
        """
        settings = self.settings
        if settings is None:
            return None
        taken: CompactionResult | None = None
        running = self._background.get(thread)
        if running is not None and running.done.is_set():
            taken = self._take_background(thread, running)
            running = None
        stats, episodic = await self._observe(thread, now, settings)
        tokens = stats.total_tokens + self._overhead.get(thread, 0)
        cache = self._cache.get(thread)
        if cache is not None and (cache.version != stats.version or cache.last_seq != stats.last_seq):
            cache = None  # behind the store: its turns and open calls may be stale
        turns = cache.turns if cache is not None else stats.message_count
        reason = settings.config.trigger.reason(
            unchecked_pressure(turns, tokens, stats.message_count, episodic)
        )
        if (
            reason is not None
            and turns
            and settings.config.trigger.reason(unchecked_pressure(0, tokens, stats.message_count, episodic))
            is None
        ):  # the turns made it fire: the plan's own count of them decides
            reason = await self._turns_confirmed(thread, settings, stats, tokens, episodic)
        if reason is None:
            # A call still unanswered: abandoned yet? (With no fold to make, no fold would close it.)
            if self._store is not None:
                if cache is None and thread not in self._reckoned:
                    # Never read in this process (a loop that builds its requests itself): read it
                    # once, as context() would; the step's appends keep it current from then on.
                    cache = await self._fresh_cache(thread)
                    self._note_reckoned(thread)
                if cache is not None and _may_be_abandoned(cache, settings):
                    await self._close_abandoned(thread, cache.snapshot(), cache.version, settings)
            elif self._unanswered.get(thread) or thread not in self._reckoned:
                await self._close_abandoned_loaded(thread, settings)
            if (
                settings.background_at is not None
                and running is None
                and self._background_due(thread, settings, tokens, stats.version)
            ):
                self._start_background(thread, settings)
                # The summary starts now, not at the stores' next paced yield: a loop that only
                # records and checks would otherwise reach the hard trigger before it began.
                await anyio.lowlevel.checkpoint()
            return taken
        if reason in TOKEN_REASONS and self._held_back(thread, stats.version, tokens):
            return taken
        if self._backing_off(thread):
            return taken
        if running is not None:
            # The hard trigger fired while the summary is on its way: wait for that one, then check
            # again, since what was appended meanwhile may keep the context over the trigger.
            waited = await self._wait_background(thread, running)
            again = await self.maybe_compact(thread, now=now)
            return again if again is not None else waited
        folded = await self._compact(thread, settings, reason, episodic=episodic)
        return folded if folded is not None else taken

    async def _turns_confirmed(
        self,
        thread: str,
        settings: Settings,
        stats: ThreadStats,
        tokens: int,
        episodic: EpisodicCompactionPressure | None,
    ) -> str | None:
        """The trigger's reason with the turns the plan counts: the body's units, not the head's.

        The check's count is a bound (every message but tool results, or every
        message before the context is cached), which counts the system prompt
        and the summary too. Where it makes a turn trigger fire, the context's
        own units decide, so a check never takes the lease for a plan that
        declines. Only a check that the turns alone make fire pays for this:
        a turn trigger near its limit (a context of about that many turns).
        """
        cache = await self._fresh_cache(thread)
        messages = cache.messages if cache is not None else (await self.short_term.load(thread)).plain
        pinned, previous = split_head(messages, settings.config.keep_first)
        turns = len(_bounds(messages[pinned + (previous is not None) :]).starts)
        return settings.config.trigger.reason(
            unchecked_pressure(turns, tokens, stats.message_count, episodic)
        )

    async def compact_now(self, thread: str, *, summarize: bool = True) -> CompactionResult | None:
        """Compact ``thread`` now toward the token target, whatever the triggers say."""
        settings = self._manual_settings(summarize)
        return await self._compact(thread, settings, Reason.MANUAL, episodic=None, forced=True)

    async def manual_recovery(self, thread: str, *, summarize: bool = True) -> CompactionResult | None:
        """Write an operator's clean-slate boundary: fold every turn but a still-running tool step.

        The turns are summarized (or dropped, with ``summarize=False``) and a
        ``ManualRecoveryBoundary`` is recorded after the checkpoint. Never
        chosen automatically.
        """
        settings = self._manual_settings(summarize)
        result = await self._compact(
            thread, settings, Reason.MANUAL_RECOVERY, episodic=None, forced=True, recovery=True
        )
        if result is not None and not result.stalled:
            boundary = ManualRecoveryBoundary(reason=Reason.MANUAL_RECOVERY, through_seq=result.through_seq)
            await self.episodic.record(thread, boundary)
        return result

    def _manual_settings(self, summarize: bool) -> Settings:
        settings = self.settings
        if settings is None:
            budget = self.options.max_history_tokens if isinstance(self.options, RunOptions) else 128_000
            settings = resolve_settings(
                RunOptions(
                    max_history_tokens=budget, compaction=SummarizeOptions(trigger_token_budget=budget)
                ),
                None,
                None,
            )
            assert settings is not None
        if not summarize and settings.summarize:
            settings = replace(settings, summarize=False, config=replace(settings.config, summary_tokens=0))
        return settings

    # Observing the store ---------------------------------------------------------

    async def _observe(
        self, thread: str, now: datetime | None, settings: Settings
    ) -> tuple[ThreadStats, EpisodicCompactionPressure | None]:
        episodic: EpisodicCompactionPressure | None
        if now is not None:
            utc(now, "now")  # refused whether or not a read takes it
        if not settings.episodic:
            seen = self._seen_stats(thread)
            if seen is not None:
                return seen, None  # read by the step's own write, or by a check, a moment ago
        writes = writes_to(thread)
        if self._store is not None and settings.episodic:  # both in one read
            state = await self._store.state(thread, now=now)
            stats, episodic = state.stats, state.pressure
        else:
            stats = await self.short_term.stats(thread)
            episodic = (
                await self.episodic.pressure(thread, now=now, estimated_context_tokens=stats.total_tokens)
                if settings.episodic
                else None
            )
        self._note_seen(thread, (stats, time.monotonic(), writes))
        return stats, episodic if settings.episodic else None

    def _note_seen(self, thread: str, seen: tuple[ThreadStats, float, int | None]) -> None:
        """Keep ``seen`` as the thread's last read, for as many threads as the cache holds."""
        kept = self._seen
        kept[thread] = seen
        if len(kept) > _CACHED_THREADS:
            del kept[next(iter(kept))]

    def _bundled_writer(self) -> _Writer | None:
        """The bundled store's step write, unless ``record_and_append`` was replaced on the instance since.

        A store whose ``record_and_append`` is replaced (a wrapper, a spy) gets
        every step through it, whenever it was replaced; and what it writes
        may reach no write count, so no read stands for a later one.
        """
        writer = self._writer
        if writer is not None and "record_and_append" in vars(self._store):
            return None
        return writer

    def _forget_seen(self, thread: str) -> None:
        """Drop the stats the last check saw: the caller wrote to the store past this compactor."""
        self._seen.pop(thread, None)

    def _seen_stats(self, thread: str) -> ThreadStats | None:
        """The thread's stats as last read, while the read stands for its state (``_SEEN_STANDS_FOR``).

        Never on a store that is not bundled: its writes reach no count.
        """
        seen = self._seen.get(thread)
        if seen is None or self._bundled_writer() is None:
            return None
        stats, at, writes = seen
        if writes is None or writes != writes_to(thread) or time.monotonic() - at > _SEEN_STANDS_FOR:
            return None  # a write was under way at the read, or one began since, or it is too old
        return stats

    async def _fresh_cache(self, thread: str, just_read: ThreadStats | None = None) -> _Cache | None:
        """The thread's cached context brought up to date; ``None`` without a ``Store``.

        ``just_read``: stats the caller read a moment ago with no write under
        way or begun since, which hold on any store (``_seen_stats`` does not
        hold on a store of the user's own).
        """
        store = self._store
        if store is None:
            return None
        cache = self._cache.get(thread)
        if cache is not None:
            seen = just_read if just_read is not None else self._seen_stats(thread)
            if seen is not None and seen.version == cache.version and seen.last_seq == cache.last_seq:
                self._cache.move_to_end(thread)
                return cache
            window = await store.tail(thread, after_seq=cache.last_seq)
            if window.version == cache.version:
                # The rows after the cache make the context as the read found it, whatever another
                # task did to the cache meanwhile (a step's append may have dropped it).
                cache.extend(window.messages)
                if self._cache.get(thread) is cache:
                    self._cache.move_to_end(thread)
                return cache
        window = await store.tail(thread, after_seq=0)
        cache = _Cache.of(window)
        self._cache[thread] = cache
        self._cache.move_to_end(thread)
        while len(self._cache) > _CACHED_THREADS:
            self._cache.popitem(last=False)
        return cache

    def _counts(self, messages: list[Message]) -> list[int]:
        count = self.counter.count
        return [count(message) for message in messages]

    def _recording(self, messages: list[Message], call: _LlmCall) -> Recording:
        """The step's recording: every message counted, checked and encoded once."""
        count = self.counter.count
        return record_messages(
            messages,
            [count(message) for message in messages],
            model=call.model,
            usage=call.usage,
            request_messages=call.request_messages,
            request_tokens=call.request_tokens,
            encode=self._encode_steps,
        )

    async def _sent(self, thread: str, messages: list[Message]) -> list[Message]:
        """What reaches the context for each message of a batch holding a tool result.

        ``messages`` itself, unless a result is late: one whose call is no longer
        open in the context (it was closed as abandoned) reaches it as a plain
        note instead of an orphaned tool message. A result answers a call the
        batch made before it while one with its id is unanswered there, else a
        call open in the context: only the latter results look at the context.
        """
        # The context is checked against the store before its open calls are trusted: another
        # worker may have closed a call meanwhile. A batch that answers only its own calls reads nothing.
        cache: _Cache | None = None
        current = False
        if len(messages) == 1:  # the common step: one result, whose call is open in the context
            cache, current = await self._current_cache(thread), True
            if cache is not None and not cache.reused_open_id:
                if messages[0].tool_call_id in cache.open_calls:
                    return messages
        made: dict[str, int] = {}  # the batch's own calls not answered yet, by id
        from_context: list[int] = []  # the results no call of the batch answers
        for index, message in enumerate(messages):
            for call in message.tool_calls:
                made[call.id] = made.get(call.id, 0) + 1
            if message.role is _TOOL and not _answer(made, message):
                from_context.append(index)
        if not from_context:
            return messages
        wanted = {messages[index].tool_call_id or "" for index in from_context}
        if not current:
            cache = await self._current_cache(thread)
        open_calls = await self._open_calls(thread, wanted, cache)
        late = [index for index in from_context if not _answer(open_calls, messages[index])]
        if not late:
            return messages
        sent = list(messages)
        for index in late:
            sent[index] = _late_note(messages[index])
            logger.warning(
                "thread %r: the tool result for call %r answers no call open in the context (never made, "
                "or closed as abandoned); the model gets it as a note, and the log keeps it as it came",
                thread,
                messages[index].tool_call_id,
            )
        return sent

    def _may_place(self, thread: str, sent: list[Message], answering: list[int]) -> bool:
        """Whether a result of ``sent`` (at ``answering``) may answer a call other messages followed.

        Asked first, without an await: a step's results answer its own reply's calls.
        """
        if any(message.role is not _TOOL for message in sent[: answering[-1]]):
            return True  # a message of the batch comes before a result: the user wrote while it ran
        results = [sent[index] for index in answering]
        if self._store is None:
            if thread not in self._reckoned:  # calls made before this compactor: read them once
                return True
            passed = self._passed.get(thread)
            return passed is not None and any(result.tool_call_id in passed for result in results)
        cache = self._cache.get(thread)  # brought up to date by _sent
        return cache is not None and _away_from_the_newest_reply(cache.plain, results)

    async def _append_in_place(
        self,
        thread: str,
        messages: list[Message],
        sent: list[Message],
        answering: list[int],
        extra_episodes: Sequence[Episode],
        call: _LlmCall,
        started: Sequence[ToolCall],
    ) -> list[StoredMessage] | None:
        """``append`` with each result that answers a call of the context put right after that call.

        A result appended after the user's next message leaves the call
        followed by it, which OpenAI's and Anthropic's APIs refuse in every
        later request. So the batch's results for calls of the context go right
        after their calls (and the results there), as an abandoned call's error
        result does, and the rest of the batch after everything; the log
        records the batch as it came. On a ``Store`` that is one
        ``record_and_replace``, and a fold by another worker meanwhile starts
        the append over. With two stores the context is read for it, the log
        records the batch first (as ``append`` orders its writes), and a fold
        meanwhile is met by reading the context again, a few times, before the
        batch goes at its end. ``None``, with nothing written, when a result
        answers no open call (the caller appends).
        """
        store = self._store
        if store is not None:
            cache = self._cache.get(thread)  # brought up to date by _sent
        else:
            window = await self.short_term.load(thread)
            self._reckon_unanswered(thread, window.messages)
            cache = _Cache.of(window)
        if cache is None or not cache.seqs:
            return None
        rows = cache.snapshot()
        plan = _placed(rows, sent, answering)
        if plan is None:
            return None
        episodes, owners = _step_episodes(extra_episodes, messages, call, started)
        counts = (
            await anyio.to_thread.run_sync(self._counts, sent) if heavy_batch(sent) else self._counts(sent)
        )
        if store is None:
            return await self._append_in_place_of_two(
                thread, rows, cache.version, plan, sent, counts, episodes
            )
        replacement, tokens, links, stands_for, batch_rows = _replacement(rows, plan, sent, counts, owners)
        through = rows.seqs[-1]
        try:
            await store.record_and_replace(
                thread,
                episodes,
                through_seq=through,
                expected_version=cache.version,
                replacement=replacement,
                tokens=tokens,
                message_episodes=links,
                stands_for=stands_for,
            )
        except ConflictError:  # another worker folded meanwhile: nothing written, start over
            return await self.append(
                thread,
                messages,
                model=call.model,
                usage=call.usage,
                request_messages=call.request_messages,
                request_tokens=call.request_tokens,
                extra_episodes=extra_episodes,
                started=started,
            )
        finally:
            self._forget_cache(thread)
            self._forget_seen(thread)
        first = through - len(replacement) + 1
        return await self._rows_at(thread, [first + batch_rows[index] for index in range(len(sent))])

    async def _append_in_place_of_two(
        self,
        thread: str,
        rows: _Rows,
        version: int,
        plan: dict[int, list[int]],
        sent: list[Message],
        counts: list[int],
        episodes: list[Episode],
    ) -> list[StoredMessage]:
        """``_append_in_place``'s writes with two stores: the log, then the context (both, or neither)."""
        unlinked = [None] * len(sent)
        with anyio.CancelScope(shield=True):  # the log is written: the context must take the batch too
            for episode in episodes:
                await self.episodic.record(thread, episode)
            for _ in range(3):
                replacement, tokens, _, _, batch_rows = _replacement(rows, plan, sent, counts, unlinked)
                try:
                    await self.short_term.replace_prefix(
                        thread,
                        through_seq=rows.seqs[-1],
                        expected_version=version,
                        replacement=replacement,
                        tokens=tokens,
                    )
                except ConflictError:  # another worker folded: read the context again
                    window = await self.short_term.load(thread)
                    rows, version = _Rows.of(window.messages), window.version
                    placed = _placed(rows, sent, list(_plan_indexes(plan))) if rows.seqs else None
                    if placed is None:
                        break
                    plan = placed
                    continue
                self._track_unanswered(thread, sent)
                first = rows.seqs[-1] - len(replacement) + 1
                return await self._rows_at(thread, [first + batch_rows[index] for index in range(len(sent))])
            stored = await self.short_term.append(thread, sent, counts)
        self._track_unanswered(thread, sent)
        return stored

    async def _rows_at(self, thread: str, seqs: list[int]) -> list[StoredMessage]:
        """The stored rows with these seqs, read after a write that renumbered them.

        Shielded: the write is done, and a cancellation here would tell the
        caller it was not (a retry would record the batch twice).
        """
        with anyio.CancelScope(shield=True):
            window = await self.short_term.load(thread)
        found = {row.seq: row for row in window.messages}
        return [found[seq] for seq in seqs if seq in found]

    async def _results_back_in_place(
        self, thread: str, stored: list[StoredMessage], results: list[StoredMessage]
    ) -> list[StoredMessage]:
        """After an append that another writer's rows overtook: each of ``results`` right after its call.

        A fold meanwhile is tried again, a few times; the rows are returned as
        they end up. Shielded as a whole: the batch is written already.
        """
        moved = {row.seq for row in results}
        with anyio.CancelScope(shield=True):
            for _ in range(3):
                window = await self.short_term.load(thread)
                rows = _Rows.of(window.messages)
                order = _results_after_their_calls(
                    rows.messages, [rows.seqs.index(s) for s in moved if s in rows.seqs]
                )
                if order is None:
                    break
                assert self._store is not None
                try:
                    await self._store.record_and_replace(
                        thread,
                        [],
                        through_seq=rows.seqs[-1],
                        expected_version=window.version,
                        replacement=[rows.messages[i] for i in order],
                        tokens=[rows.tokens[i] for i in order],
                        stands_for=[rows.seqs[i] for i in order],
                    )
                except ConflictError:
                    continue
                first = rows.seqs[-1] - len(order) + 1
                renumbered = {rows.seqs[i]: first + n for n, i in enumerate(order)}
                self._forget_cache(thread)
                self._forget_seen(thread)
                return await self._rows_at(thread, [renumbered.get(row.seq, row.seq) for row in stored])
        return stored

    async def _current_cache(self, thread: str) -> _Cache | None:
        """The cached context, brought up to date with the store's stats: one point read, rows only if new.

        A cache that was current at the step's check may not be by the time
        its tool results arrive: another worker may have appended, or folded
        and closed a call as abandoned. ``None`` without a ``Store``.
        """
        if self._store is None:
            return None
        if self._seen_stats(thread) is not None:  # read a moment ago
            return await self._fresh_cache(thread)
        writes = writes_to(thread)
        stats = await self._store.stats(thread)
        self._note_seen(thread, (stats, time.monotonic(), writes))
        held = writes is not None and writes == writes_to(thread)  # nothing under way at the read, or since
        return await self._fresh_cache(thread, stats if held else None)

    async def _open_calls(self, thread: str, wanted: set[str], cache: _Cache | None) -> dict[str, int]:
        """How many calls with each ``wanted`` id are open in the context (``cache``, current or ``None``).

        Counted, not a set: a reply may reuse the id of a call still open, and
        then two results with that id each answer one of them.
        """
        if cache is None:
            context = (await self.short_term.load(thread)).plain
        elif cache.reused_open_id:  # its open_calls kept one call per id: pair them up again
            context = cache.plain
        else:
            return {id_: 1 for id_ in wanted if id_ in cache.open_calls}
        counts: dict[str, int] = {}
        for _, call in unanswered_calls(context):
            if call.id in wanted:
                counts[call.id] = counts.get(call.id, 0) + 1
        return counts

    def _forget_cache(self, thread: str) -> None:
        self._cache.pop(thread, None)

    async def _ready_counter(self) -> None:
        """Load what the counter needs (a tokenizer) in a worker thread, once per counter."""
        counter = self.counter
        if self._counter_ready is counter:
            return
        load = getattr(counter, "aload", None)
        if load is not None:
            await load()
        self._counter_ready = counter

    # The fold itself ---------------------------------------------------------------

    async def _compact(
        self,
        thread: str,
        settings: Settings,
        reason: str,
        *,
        episodic: EpisodicCompactionPressure | None,
        forced: bool = False,
        recovery: bool = False,
    ) -> CompactionResult | None:
        async with self.short_term.compaction_lock(thread) as acquired:
            if not acquired:
                logger.debug("thread %r: another worker is compacting it; skipping", thread)
                return None
            # Every event the fold emits inside the span is recorded on it (Telemetry.record_event).
            with self.telemetry.fold_span(thread, reason):
                prepared = await self._prepare(
                    thread, settings, reason, episodic=episodic, forced=forced, recovery=recovery
                )
                if not isinstance(prepared, _Prepared):
                    return prepared
                return await self._apply(prepared, settings)

    async def _window(self, thread: str, settings: Settings) -> tuple[_Rows, int, int]:
        """The rows a fold plans over, the thread's version and its total tokens."""
        limit = settings.window_tokens
        cache = await self._fresh_cache(thread)
        if cache is not None:
            if limit is not None and cache.total_tokens > limit:
                _warn_over_window(thread, cache.total_tokens, limit)
            return cache.snapshot(), cache.version, cache.total_tokens
        stats = await self.short_term.stats(thread)
        if limit is not None and stats.total_tokens > limit:
            _warn_over_window(thread, stats.total_tokens, limit)
        window = await self.short_term.load(thread)
        return _Rows.of(window.messages), window.version, window.total_tokens

    async def _close_abandoned(self, thread: str, rows: _Rows, version: int, settings: Settings) -> bool:
        """Give every abandoned tool call an error result; return whether the context changed.

        Each result goes right after its call (and the results already there),
        as providers require a call's results to follow it; see ``_answer_in_place``.
        """
        turns_after = settings.abandon_after_turns
        seconds = settings.abandon_after_seconds
        if turns_after is None and seconds is None:
            return False
        unanswered = rows.unanswered()
        messages = rows.messages
        if not unanswered:
            return False
        now = time.monotonic()
        closing: list[tuple[int, Message]] = []
        tool = Role.TOOL
        for index, call in unanswered:
            since = self._pending_since.get((thread, call.id))
            if since is None:
                # Counted from when the call was made, as the log recorded it (another worker or
                # an earlier process may have made it), else from now.
                made = await self._made_at(thread, rows.links[index]) if seconds is not None else None
                since = now - max(0.0, (datetime.now(UTC) - made).total_seconds()) if made else now
                self._pending_since[(thread, call.id)] = since
            later_turns = sum(1 for m in messages[index + 1 :] if m.role is not tool)
            by_turns = turns_after is not None and later_turns >= turns_after
            by_time = seconds is not None and now - since >= seconds
            if not (by_turns or by_time):
                continue
            why = f"{later_turns} turns" if by_turns else f"{seconds:g} s"
            result = Message.tool(
                call.id,
                f"error: no result arrived for tool call {call.id!r} ({call.name}) within {why}; "
                "contextfold closed it so the conversation can go on",
                is_error=True,
                metadata={ABANDONED_METADATA_KEY: True},
            )
            closing.append((index, result))
            self._pending_since.pop((thread, call.id), None)
        if not closing:
            return False
        logger.warning(
            "thread %r: closed %d abandoned tool call(s) with an error result", thread, len(closing)
        )
        try:
            placed = await self._answer_in_place(thread, rows, version, closing)
        except ConflictError:  # another worker folded meanwhile: the next fold closes what is left
            return True
        if not placed:
            await self.append(thread, [result for _, result in closing])
        return True

    async def _close_abandoned_loaded(self, thread: str, settings: Settings) -> None:
        """``_close_abandoned`` on the context read whole: two stores keep no cached one.

        On a thread's first check in this process (calls may have been made
        before it, or by another worker), then only while a call this compactor
        appended may be unanswered (see ``_track_unanswered``); the read says
        which still are.
        """
        window = await self.short_term.load(thread)
        rows = self._reckon_unanswered(thread, window.messages)
        if thread in self._unanswered:
            await self._close_abandoned(thread, rows, window.version, settings)

    def _reckon_unanswered(self, thread: str, stored: Sequence[StoredMessage]) -> _Rows:
        """The context's rows, its unanswered calls noted as ``_track_unanswered`` notes them (two stores)."""
        rows = _Rows.of(stored)
        self._unanswered.pop(thread, None)
        self._passed.pop(thread, None)
        self._note_reckoned(thread)
        messages = rows.messages
        for index, call in rows.unanswered():
            self._unanswered.setdefault(thread, Counter())[call.id] += 1
            if any(m.role is not _TOOL for m in messages[index + 1 :]):
                self._passed.setdefault(thread, set()).add(call.id)
        return rows

    def _note_reckoned(self, thread: str) -> None:
        """Calls made before this process (or by others) are known now: a check read the thread."""
        self._reckoned[thread] = None
        self._reckoned.move_to_end(thread)
        while len(self._reckoned) > _CACHED_THREADS:
            self._reckoned.popitem(last=False)

    def _track_unanswered(self, thread: str, messages: Sequence[Message]) -> None:
        """Note the calls ``messages`` make, the results they give and what follows them (two stores only)."""
        calls = self._unanswered.get(thread)
        for message in messages:
            if message.role is _TOOL:
                id_ = message.tool_call_id or ""
                if calls and calls[id_] > 0:
                    calls[id_] -= 1
                continue
            if calls:  # a message after the calls still open: their results no longer come next
                self._passed.setdefault(thread, set()).update(id_ for id_, n in calls.items() if n > 0)
            if message.tool_calls:
                if calls is None:
                    calls = self._unanswered[thread] = Counter()
                calls.update(call.id for call in message.tool_calls)
        if calls is not None and not +calls:
            del self._unanswered[thread]
            self._passed.pop(thread, None)

    async def _answer_in_place(
        self, thread: str, rows: _Rows, version: int, closing: list[tuple[int, Message]]
    ) -> bool:
        """Record each ``(call's row, result)`` and put it right after its call; ``False`` to append them.

        ``False``, with nothing written, when every result goes at the end
        anyway; ``ConflictError`` when the context moved past ``version``,
        nothing written either.

        An abandoned call has turns after it (that is how it was found): its
        result appended at the end would leave the call's message followed by
        other messages, which OpenAI's and Anthropic's APIs refuse, and would
        make one unit of everything between them. On one ``Store`` the results
        are recorded and the context rewritten with them in place in one
        transaction (``record_and_replace``; every other row keeps its link).
        With two stores the log records them first, then the context is
        rewritten, as ``append`` orders its two writes.
        """
        results = [result for _, result in closing]
        indexes = list(range(len(results)))
        plan = _after_calls(rows.messages, [index for index, _ in closing], indexes)
        if list(plan) == [len(rows.messages)]:
            return False
        replacement, tokens, recorded, stands_for, _ = _replacement(
            rows, plan, results, self._counts(results), indexes
        )
        episodes = [episode_for(result) for result in results]
        store = self._store
        try:
            if store is not None:
                await store.record_and_replace(
                    thread,
                    episodes,
                    through_seq=rows.seqs[-1],
                    expected_version=version,
                    replacement=replacement,
                    tokens=tokens,
                    message_episodes=recorded,
                    stands_for=stands_for,
                )
            else:
                with anyio.CancelScope(shield=True):  # the log written, the context takes the results too
                    for episode in episodes:
                        await self.episodic.record(thread, episode)
                    await self.short_term.replace_prefix(
                        thread,
                        through_seq=rows.seqs[-1],
                        expected_version=version,
                        replacement=replacement,
                        tokens=tokens,
                    )
        finally:
            self._forget_cache(thread)
            self._forget_seen(thread)
        return True

    async def _made_at(self, thread: str, seq: int | None) -> datetime | None:
        """When the log recorded episode ``seq`` of ``thread`` (``None`` without one)."""
        if seq is None:
            return None
        async with closing(self.episodic.replay(thread, from_seq=seq)) as records:
            async for record in records:
                return record.at if record.seq == seq else None
        return None

    async def _prepare(
        self,
        thread: str,
        settings: Settings,
        reason: str,
        *,
        episodic: EpisodicCompactionPressure | None,
        forced: bool = False,
        recovery: bool = False,
        background: bool = False,
    ) -> _Prepared | CompactionResult | None:
        started = time.perf_counter()
        await self._ready_counter()  # the fold counts its summary: not a tokenizer load on the loop
        # The lease is held now. What the check saw came before it, and another worker may have
        # folded meanwhile: the thread's stats are read again (a point read, as the check's), and
        # the cache is read anew only if they moved, so no summary covers a folded prefix. (With
        # two stores the window below is loaded whole anyway.)
        writes = writes_to(thread)  # before the rows are read: a write after it is not in them
        if self._store is not None:
            self._note_seen(thread, (await self.short_term.stats(thread), time.monotonic(), writes))
        rows, version, total = await self._window(thread, settings)
        if not recovery and await self._close_abandoned(thread, rows, version, settings):
            writes = writes_to(thread)
            rows, version, total = await self._window(thread, settings)
        messages, tokens, seqs = rows.messages, rows.tokens, rows.seqs
        overhead = self._overhead.get(thread, 0)
        config = settings.config
        if recovery:  # every turn but a still-running step goes into the summary
            config = replace(config, strategy=SlidingWindow(0), min_recent_turns=0, min_recent_messages=0)
        plan = config.plan(
            messages,
            total + overhead,
            message_tokens=tokens,
            episodic=episodic,
            force_reason=reason if forced or background else None,
            by_tokens=True if background or reason == Reason.MANUAL else None,
            overhead=overhead,
            count=self.counter.count,
        )
        if plan.reason is None:
            return None
        reason = plan.reason
        for orphan in plan.orphans:
            logger.warning(
                "thread %r: tool result for call %r at body index %d has no call in the context",
                thread,
                orphan.tool_call_id,
                orphan.index,
            )
        target = settings.target
        pinned_len = len(plan.pinned)
        body_start = pinned_len + (1 if plan.previous_summary is not None else 0)
        head = f"the pinned head alone holds {plan.pinned_tokens} tokens" + (
            f" (and the provider adds {overhead})" if overhead else ""
        )
        fix = "shorten the system prompt, lower keep_first, or raise the target"
        if target is not None and plan.pinned_tokens + overhead >= target and not recovery:
            return await self._stall(
                thread,
                reason,
                total,
                settings,
                f"{head}, at or over the {target}-token target, so no fold can get under it; {fix}",
            )
        framing = 0
        if settings.summarize and plan.dropped:
            # The summary message's framing (its prefix and role) counts in the context: the
            # summarizer is asked for the text, at most max_summary_tokens of it.
            framing = self.counter.count(self._summary_frame(settings))
            if target is not None and not recovery:
                least = framing + self._least_summary(settings, first_only=True)
                left = target - plan.pinned_tokens - overhead
                if left < least:
                    # No summary the summarizer asked first can write fits beside the head: asking it
                    # for less fails (the extractive summarizer) or is asking for nothing.
                    return await self._stall(
                        thread,
                        reason,
                        total,
                        settings,
                        f"{head}, leaving {left} token{'' if left == 1 else 's'} under the {target}-token "
                        f"target for a summary that needs at least {least} (its {framing}-token framing "
                        f"included), so no fold can get under it; {fix}",
                    )
        kept = list(plan.kept)
        truncated = self._cap_tool_outputs(kept, settings, total)
        kept_start = body_start + len(plan.dropped)
        changed = [i for i, message in enumerate(kept) if message is not messages[kept_start + i]]
        if not plan.dropped and not changed:
            return await self._stall(
                thread, reason, total, settings, self._floor_detail(plan, total, settings, reason)
            )

        kept_tokens = [
            tokens[kept_start + i] if message is messages[kept_start + i] else self.counter.count(message)
            for i, message in enumerate(kept)
        ]
        summary: Summary | None = None
        new_head: list[Message] = list(plan.pinned)
        summary_tokens = 0
        if settings.summarize and plan.dropped:
            room = settings.max_summary_tokens
            if target is not None:
                head_room = target - plan.pinned_tokens - overhead - framing
                beside_tail = head_room - sum(kept_tokens)
                # The summary gives way to end the fold at the target: it takes what the head, the
                # overhead and the kept turns leave, down to a quarter of its own room. A pinned head
                # that leaves less than max_summary_tokens beside the turns squeezes it that way too.
                # Only when the protected turns leave less than that quarter (they are too big) does
                # the head alone squeeze it, the next fold being held back instead (see _after_fold):
                # history is not lost for them.
                whole = settings.max_summary_tokens - framing
                least = min(whole, max(whole // 4, self._least_summary(settings)))
                fit = max(1, beside_tail if beside_tail >= least else head_room)
                if fit < room:
                    room = fit
                    logger.info(
                        "thread %r: the summary is cut to %d tokens (max_summary_tokens %d) to end the "
                        "fold at the %d-token target: the pinned head holds %d tokens%s, the kept turns %d",
                        thread,
                        room,
                        settings.max_summary_tokens,
                        target,
                        plan.pinned_tokens,
                        f" and the provider adds {overhead}" if overhead else "",
                        sum(kept_tokens),
                    )
            try:
                summary = await self._summarize(
                    plan,
                    settings,
                    room,
                    thread=thread,
                    reason=reason,
                    tokens=total,
                    through_seq=seqs[kept_start + max(changed, default=-1)],
                )
            except _Skipped as skipped:  # on_summarizer_error="skip"
                return await self._stall(
                    thread,
                    reason,
                    total,
                    settings,
                    f"the summarizer failed ({skipped.cause}); nothing folded",
                )
            # A summarizer may write far more than asked: counting (and cutting) that is not for the loop.
            if len(summary.text) > PREPARE_ON_LOOP_CHARS:
                message, summary_tokens = await anyio.to_thread.run_sync(
                    self._summary_message, summary, settings, room + framing
                )
            else:
                message, summary_tokens = self._summary_message(summary, settings, room + framing)
            new_head.append(message)
        elif plan.previous_summary is not None:
            new_head.append(plan.previous_summary)
            summary_tokens = tokens[pinned_len]

        # Everything up to the last changed message is rewritten; the rest stays untouched.
        last_changed = max(changed, default=-1)
        through_index = kept_start + last_changed
        replacement = new_head + kept[: last_changed + 1]
        head_tokens = tokens[:pinned_len]
        if len(new_head) > pinned_len:
            head_tokens.append(summary_tokens)
        replacement_tokens = head_tokens + kept_tokens[: last_changed + 1]
        removed_tokens = sum(tokens[: through_index + 1])
        tokens_after = total - removed_tokens + sum(replacement_tokens)
        log_seqs = [link for link in rows.links[body_start:kept_start] if link is not None]
        checkpoint = SummaryCheckpoint(
            trigger=reason,
            from_seq=seqs[body_start] if body_start < len(seqs) else seqs[through_index],
            through_seq=seqs[through_index],
            summary=summary.text if summary is not None else "",
            model=summary.model if summary is not None else None,
            usage=summary.usage if summary is not None else Usage(),
            degraded=summary is not None and summary.degraded,
            dropped_messages=len(plan.dropped),
            tokens_before=total,
            tokens_after=tokens_after,
            log_from_seq=min(log_seqs) if log_seqs else None,
            log_through_seq=max(log_seqs) if log_seqs else None,
        )
        return _Prepared(
            thread=thread,
            reason=reason,
            version=version,
            through_seq=seqs[through_index],
            replacement=replacement,
            tokens=replacement_tokens,
            checkpoint=checkpoint,
            plan=plan,
            truncated=truncated,
            removed_tokens=removed_tokens,
            tokens_before=total,
            summary=summary,
            started=started,
            writes=writes,
        )

    async def _apply(
        self, prepared: _Prepared, settings: Settings, *, background: _Background | None = None
    ) -> CompactionResult | None:
        """Write the fold, then tell the subscribers; ``background`` receives the result once written.

        The summary is paid for: the write is shielded from cancellation, so a
        cancelled caller does not throw it away (the next fold would send the
        same messages again), and the cancellation is raised at the next
        checkpoint. A step's subscribers are not shielded: a slow one cannot
        make its fold impossible to cancel. A background fold's are, as its
        discard on closing is: every ``BackgroundSummaryStarted`` is followed
        by one ``BackgroundSummaryApplied`` or ``BackgroundSummaryDiscarded``
        for every subscriber, also when the owner closes while the fold is
        written.

        The result's tokens are the context just before and just after the
        write, as this compactor knows it: what was appended while the summary
        ran is in both, so their difference is what the fold removed.
        """
        thread = prepared.thread
        appended = self._appended_since(prepared)
        # The fold's own write; any other one since its rows were read (while it summarized, say)
        # voids the step's read, and its context() reads what that write added.
        writes = None if prepared.writes is None else prepared.writes + 1
        try:
            with anyio.CancelScope(shield=True):
                checkpoint_seq = await self._write_fold(prepared)
        except ConflictError:
            # Another worker folded this prefix first: its fold stands, and ours is
            # dropped without summarizing the same messages again.
            self._forget_cache(thread)
            dropped = prepared.summary
            model = dropped.model if dropped is not None else None
            usage = dropped.usage if dropped is not None else Usage()
            elapsed = time.perf_counter() - prepared.started
            lost: CompactionEvent
            if background is not None:
                background.settled = True
                lost = BackgroundSummaryDiscarded(
                    thread=thread,
                    reason=prepared.reason,
                    tokens_before=prepared.tokens_before + appended,
                    tokens_after=prepared.tokens_before + appended,
                    messages_folded=len(prepared.plan.dropped),
                    summarizer_model=model,
                    usage=usage,
                    duration_s=elapsed,
                    cause="prefix_changed",
                    through_seq=prepared.through_seq,
                )
            else:
                lost = FoldConflict(
                    thread=thread,
                    reason=prepared.reason,
                    tokens_before=prepared.tokens_before + appended,
                    tokens_after=prepared.tokens_before + appended,
                    messages_folded=len(prepared.plan.dropped),
                    summarizer_model=model,
                    usage=usage,
                    duration_s=elapsed,
                )
            with anyio.CancelScope(shield=background is not None):
                await self._emit(lost)
            return None
        self._backoff.pop(thread, None)
        linked = checkpoint_seq if self._store is not None else None  # replace_prefix links nothing
        self._after_fold(
            thread,
            prepared,
            settings,
            background=background is not None,
            checkpoint_seq=linked,
            writes=writes,
        )
        summary = prepared.summary
        result = CompactionResult(
            thread=thread,
            reason=prepared.reason,
            dropped_messages=len(prepared.plan.dropped),
            dropped_turns=prepared.plan.dropped_turns,
            tokens_before=prepared.tokens_before + appended,
            tokens_after=prepared.checkpoint.tokens_after + appended,
            usage=summary.usage if summary is not None else Usage(),
            duration_s=time.perf_counter() - prepared.started,
            masked_messages=prepared.plan.masked,
            truncated_messages=prepared.truncated,
            summarizer_model=summary.model if summary is not None else None,
            degraded=summary is not None and summary.degraded,
            checkpoint_seq=checkpoint_seq,
            through_seq=prepared.through_seq,
            background=background is not None,
        )
        figures: dict[str, Any] = {  # one event's fields: a BackgroundSummaryApplied adds waited_s
            "thread": thread,
            "reason": result.reason,
            "tokens_before": result.tokens_before,
            "tokens_after": result.tokens_after,
            "messages_folded": result.dropped_messages,
            "summarizer_model": result.summarizer_model,
            "usage": result.usage,
            "duration_s": result.duration_s,
            "degraded": result.degraded,
            "masked_messages": result.masked_messages,
            "truncated_messages": result.truncated_messages,
            "checkpoint_seq": result.checkpoint_seq,
            "through_seq": result.through_seq,
        }
        event: FoldApplied
        if background is not None:
            background.result = result
            background.settled = True
            waiting = background.waiting_since
            waited = background.waited_before + (
                time.perf_counter() - waiting if waiting is not None else 0.0
            )
            event = BackgroundSummaryApplied(**figures, waited_s=waited)
        else:
            event = FoldApplied(**figures)
        with anyio.CancelScope(shield=background is not None):
            await self._emit(event)
        return result

    def _appended_since(self, prepared: _Prepared) -> int:
        """Tokens appended to the thread since ``prepared`` read it, as far as this compactor saw them.

        A background summary runs while the agent appends, and those rows are
        in the cached context (a step's ``append`` extends it) or in the stats
        its last check read; another process's rows reach neither until read.
        """
        cache = self._cache.get(prepared.thread)
        if cache is not None and cache.version == prepared.version:
            known = cache.total_tokens
        else:
            seen = self._seen.get(prepared.thread)
            stats = seen[0] if seen is not None else None
            known = stats.total_tokens if stats is not None and stats.version == prepared.version else 0
        return max(0, known - prepared.tokens_before)

    async def _write_fold(self, prepared: _Prepared) -> int:
        """Write the prepared fold; the checkpoint's seq. Raises ``ConflictError`` if the prefix changed."""
        thread = prepared.thread
        if self._store is not None:
            record = await self._store.fold(
                thread,
                checkpoint=prepared.checkpoint,
                through_seq=prepared.through_seq,
                expected_version=prepared.version,
                replacement=prepared.replacement,
                tokens=prepared.tokens,
            )
            return record.seq
        # Two stores: swap first, then record, so every checkpoint in the log was applied.
        await self.short_term.replace_prefix(
            thread,
            through_seq=prepared.through_seq,
            expected_version=prepared.version,
            replacement=prepared.replacement,
            tokens=prepared.tokens,
        )
        return (await self.episodic.record(thread, prepared.checkpoint)).seq

    def _after_fold(
        self,
        thread: str,
        prepared: _Prepared,
        settings: Settings,
        *,
        background: bool,
        checkpoint_seq: int | None,
        writes: int | None,
    ) -> None:
        """Bring the cache to the folded state and set when the next token fold may fire."""
        cache = self._cache.get(thread)
        if cache is not None and cache.version == prepared.version:
            rebuilt = cache.folded(
                prepared.version + 1,
                prepared.through_seq,
                prepared.replacement,
                prepared.tokens,
                checkpoint=prepared.checkpoint,
                checkpoint_seq=checkpoint_seq,
            )
            self._cache[thread] = rebuilt
            if not background:
                # The step's state is its check's plus this fold: its context() needs no read,
                # unless a write other than the fold's (``writes``) came meanwhile.
                stats = trusted(
                    ThreadStats,
                    message_count=len(rebuilt.seqs),
                    total_tokens=rebuilt.total_tokens,
                    version=rebuilt.version,
                    last_seq=rebuilt.last_seq,
                )
                self._note_seen(thread, (stats, time.monotonic(), writes))
        else:
            self._forget_cache(thread)
        after = prepared.checkpoint.tokens_after + self._overhead.get(thread, 0)
        budget, target = settings.budget, settings.target
        # Over the target (the protected turns are large), or, for a strategy with no token target (a
        # sliding window of turns), over the trigger itself: every check would fold again. Hold the
        # next token fold back until budget - target new tokens arrived (half the budget without a
        # target, the gap the preset's default target leaves), so folds stay amortized, but never
        # past max_history_tokens while the context is under it: a request must not grow past the
        # limit unfolded.
        aim = budget if target is None else target
        if budget is not None and aim is not None and after > aim:
            gap = budget // 2 if target is None else budget - target
            waits = after + gap
            hard = settings.hard_limit
            if hard is not None and after < hard:
                waits = min(waits, hard)
            self._next_fold_at[thread] = (prepared.version + 1, waits)
            if target is None:
                logger.warning(
                    "thread %r: after the fold the context holds %d tokens, over the %d-token trigger "
                    "(the strategy keeps more than the trigger allows); the next fold waits for %d "
                    "tokens: keep fewer turns or give the strategy a token target, such as "
                    "TokenBudget(%d)",
                    thread,
                    after,
                    budget,
                    waits,
                    gap,
                )
            else:
                # Routine while the kept turns are large (INFO); a warning once they hold more than
                # the trigger budget itself, when the next fold can do no better.
                logger.log(
                    logging.WARNING if after > budget else logging.INFO,
                    "thread %r: after the fold the context holds %d tokens, over the %d-token target "
                    "(the protected recent turns are large); the next fold waits for %d tokens",
                    thread,
                    after,
                    target,
                    waits,
                )
        else:
            self._next_fold_at.pop(thread, None)

    def _floor_detail(self, plan: CompactionPlan, total: int, settings: Settings, reason: str) -> str:
        if not plan.kept_turns:
            return (
                f"nothing left to fold: the context holds only the pinned head and the summary "
                f"({total} tokens)"
            )
        if reason not in _TOKEN_AIMED:  # the turns, messages or age fired it, not the tokens
            return (
                f"nothing can be folded: the {reason} trigger fired, but the context past its pinned "
                f"head and summary is all protected recent turns ({plan.kept_turns} turns, about "
                f"{plan.kept_tokens} tokens of the {total}); lower min_recent_turns / "
                "min_recent_messages, raise that trigger's limit, or wait for a tool result"
            )
        budget = f"the {settings.budget}-token budget" if settings.budget is not None else "the budget"
        return (
            f"nothing can be folded: the protected recent turns ({plan.kept_turns} turns, about "
            f"{plan.kept_tokens} tokens of the {total}) are all that is left over {budget}, or wait for a "
            "tool result; raise the budget, lower min_recent_turns / min_recent_messages, or set "
            "max_tool_output_tokens"
        )

    async def _stall(
        self, thread: str, reason: str, tokens: int, settings: Settings, detail: str
    ) -> CompactionResult:
        backoff = self._backoff.setdefault(thread, _Backoff())
        backoff.failures += 1
        backoff.skips_left = min(2**backoff.failures - 1, _MAX_BACKOFF_SKIPS)
        await self._emit(
            FoldStalled(
                thread=thread,
                reason=reason,
                tokens_before=tokens,
                tokens_after=tokens,
                detail=detail,
                skipped_checks=backoff.skips_left,
            )
        )
        return CompactionResult(
            thread=thread,
            reason=reason,
            dropped_messages=0,
            dropped_turns=0,
            tokens_before=tokens,
            tokens_after=tokens,
            stalled=True,
            detail=detail,
        )

    def _cap_tool_outputs(self, kept: list[Message], settings: Settings, total: int) -> int:
        """Cut oversized tool outputs in place; return how many were cut.

        A tool output is oversized when it alone is over ``max_tool_output_tokens``,
        or, without that option, when the context is over the hard limit and the
        output is more than a quarter of it.

        Only text is cut: an output that holds images or files beside its text
        is measured by its text alone and keeps those parts whole, since a part
        cut short would be no image or file at all.
        """
        cap = settings.max_tool_output_tokens
        if cap is None:
            hard = settings.hard_limit
            if hard is None or total <= hard:
                return 0
            cap = max(1, hard // 4)
        cut = 0
        for index, message in enumerate(kept):
            if message.role is not Role.TOOL or message.metadata.get(TRUNCATED_METADATA_KEY):
                continue
            tokens = self.counter.count(message)
            if tokens <= cap:
                continue
            text = message.text
            content = message.content if isinstance(message.content, list) else []
            whole = [part for part in content if part.get("type") != "text"]
            measured = self.counter.count_text(text) if whole else tokens
            if measured <= cap:
                continue
            keep_chars = max(1, int(len(text) * cap / measured * 0.9))
            head = text[: keep_chars * 2 // 3]
            tail = text[len(text) - keep_chars // 3 :] if keep_chars // 3 else ""
            marker = f"\n[... about {measured - cap} tokens of tool output cut by contextfold ...]\n"
            cut_text = head + marker + tail
            kept[index] = message.model_copy(
                update={
                    "content": [{"type": "text", "text": cut_text}, *whole] if whole else cut_text,
                    "metadata": {**message.metadata, TRUNCATED_METADATA_KEY: tokens},
                }
            )
            cut += 1
        return cut

    async def _call_summarizer(
        self, summarizer: Summarizer, plan: CompactionPlan, previous: str | None, room: int
    ) -> Summary:
        with self.telemetry.summarizer_span(getattr(summarizer, "model", None), max_tokens=room) as call:
            summary = await summarizer.summarize(
                plan.dropped, previous_summary=previous, max_summary_tokens=room
            )
            call.record(summary.usage, response_model=summary.model)
        return summary

    async def _summarize(
        self,
        plan: CompactionPlan,
        settings: Settings,
        room: int,
        *,
        thread: str,
        reason: str,
        tokens: int,
        through_seq: int | None = None,
    ) -> Summary:
        """The summary of ``plan.dropped``; in a background fold, also reported as begun or discarded.

        ``through_seq`` is the last seq the fold will replace.
        """
        job = _running_job.get()
        if job is None or self._background.get(thread) is not job:  # a step's fold, or a subscriber's
            return await self._summary(plan, settings, room, thread=thread, reason=reason, tokens=tokens)
        await self._begin_background(
            job,
            thread=thread,
            reason=reason,
            tokens=tokens,
            messages_folded=len(plan.dropped),
            model=getattr(self.summarizer, "model", None),
            through_seq=through_seq,
        )
        try:
            return await self._summary(plan, settings, room, thread=thread, reason=reason, tokens=tokens)
        except Exception as exc:
            # With on_summarizer_error="skip" the step sees a stall; the summary is discarded either way.
            failure = exc.__cause__ if isinstance(exc, _Skipped) and exc.__cause__ is not None else exc
            await self._discard_background(job, "summarizer_failed", error=str(failure))
            raise

    async def _summary(
        self, plan: CompactionPlan, settings: Settings, room: int, *, thread: str, reason: str, tokens: int
    ) -> Summary:
        previous = _summary_body(plan.previous_summary) if plan.previous_summary is not None else None
        try:
            return _checked(
                await self._call_summarizer(self.summarizer, plan, previous, room), self.summarizer
            )
        except (SummarizerError, TimeoutError) as exc:
            if settings.on_summarizer_error == "raise":
                if isinstance(exc, SummarizerError):
                    raise
                raise SummarizerError(
                    f"summarizer {self.summarizer!r} timed out: {exc or 'TimeoutError'}"
                ) from exc
            if settings.on_summarizer_error == "skip" or self.summarizer is self.fallback:
                raise _Skipped(f"{type(exc).__name__}: {exc}") from exc
            failure = exc
        except Exception:
            logger.exception(
                "summarizer %r raised an unexpected error; it is a bug to fix, not an outage", self.summarizer
            )
            raise
        try:
            summary = _checked(
                await self._call_summarizer(self.fallback, plan, previous, room), self.fallback
            )
        except (SummarizerError, TimeoutError) as exc:  # no summary to fold into: the fold waits
            raise _Skipped(
                f"{type(failure).__name__}: {failure}; the fallback failed too: {type(exc).__name__}: {exc}"
            ) from exc
        await self._emit(
            SummaryDegraded(
                thread=thread,
                reason=reason,
                tokens_before=tokens,
                tokens_after=tokens,
                messages_folded=len(plan.dropped),
                summarizer_model=getattr(self.summarizer, "model", None),
                usage=summary.usage,
                fallback_model=summary.model,
                error_type=error_type(failure),
                error=str(failure),
            )
        )
        return summary.model_copy(update={"degraded": True})

    def _least_summary(self, settings: Settings, *, first_only: bool = False) -> int:
        """The least room a fold gives its summary: what the extractive summarizer needs, if it is asked.

        Its section headings and as much again for lines (at less it fails, or
        writes headings alone); 1 for any other summarizer. ``first_only``: of
        the summarizer asked first, not of the fallback.
        """
        from .summarizers import ExtractiveSummarizer

        asked = (
            [self.summarizer, self.fallback]
            if settings.on_summarizer_error == "fallback" and not first_only
            else [self.summarizer]
        )
        needs = [2 * s.least_summary_tokens() for s in asked if isinstance(s, ExtractiveSummarizer)]
        return max(needs, default=1)

    @staticmethod
    def _summary_frame(settings: Settings, text: str = "", metadata: dict[str, Any] | None = None) -> Message:
        """The message a summary's ``text`` opens the context as."""
        return Message(role=settings.summary_role, content=SUMMARY_PREFIX + text, metadata=metadata or {})

    def _summary_message(self, summary: Summary, settings: Settings, room: int) -> tuple[Message, int]:
        """The summary as the message that opens the context, and its tokens: at most ``room``.

        A summarizer that overshoots is cut to fit, keeping its start and its end.
        """
        metadata: dict[str, Any] = {
            SUMMARY_METADATA_KEY: True,
            "contextfold.summary_model": summary.model,
        }
        if summary.degraded:
            metadata["contextfold.degraded"] = True
        text = summary.text
        message = self._summary_frame(settings, text, metadata)
        tokens = self.counter.count(message)
        keep = len(text)
        marker = "\n[... summary cut to fit the target ...]\n"
        while tokens > room and keep > 0:
            keep = min(keep - 1, int(keep * room / tokens * 0.9))
            if keep <= 0:
                cut = ""
            elif keep > 4 * len(marker):
                cut = text[: keep * 2 // 3] + marker + text[len(text) - keep // 3 :]
            else:
                cut = text[:keep]
            message = self._summary_frame(settings, cut, metadata)
            tokens = self.counter.count(message)
        return message, tokens

    # Background folding -------------------------------------------------------------

    def _held_back(self, thread: str, version: int, tokens: int) -> bool:
        """Whether a fold that left ``thread`` over its target holds a token fold at ``tokens`` back.

        Only on the version that fold left: once another worker folded the
        thread, or it was forgotten, the wait was for a context gone.
        """
        held = self._next_fold_at.get(thread)
        if held is None:
            return False
        if held[0] != version:
            del self._next_fold_at[thread]
            return False
        return tokens <= held[1]

    def _background_due(self, thread: str, settings: Settings, tokens: int, version: int) -> bool:
        """Whether a check under the trigger starts a background fold of ``thread`` now.

        It starts past ``background_at`` of the budget, but not while the fold
        before it holds the next one back (a fold that left the context over
        its target waits for ``budget - target`` new tokens: see ``_after_fold``)
        nor while a stall's back-off skips checks: a background fold is a fold,
        and folds stay amortized whichever path makes them.
        """
        budget, at = settings.budget, settings.background_at
        if budget is None or at is None or tokens <= at * budget:
            return False
        return not self._held_back(thread, version, tokens) and not self._backing_off(thread)

    def _backing_off(self, thread: str) -> bool:
        """Whether a stall's back-off skips this check of ``thread`` (and counts it as skipped)."""
        backoff = self._backoff.get(thread)
        if backoff is None or backoff.skips_left <= 0:
            return False
        backoff.skips_left -= 1
        return True

    def _start_background(self, thread: str, settings: Settings) -> None:
        group = self._task_group
        if group is None:
            self._warn_in_the_step(
                thread,
                "the Compactor is not entered (or its 'async with' has ended)",
                "Use 'async with Compactor(...) as compactor:' or 'async with StepLoop(...) as loop:' "
                "to fold in the background",
            )
            return
        if threading.get_ident() != self._group_thread:
            # Another thread's event loop (a framework's synchronous call runs its own): the task
            # group is not its to start tasks in, and a task started there would die with that loop.
            self._warn_in_the_step(
                thread,
                "this step runs on another event loop than the one that entered the Compactor "
                "(a framework's synchronous call, such as LangChain's invoke, runs its own)",
                "Use the framework's async call (ainvoke) to fold in the background",
            )
            return
        job = _Background()
        self._background[thread] = job
        group.start_soon(self._run_background, thread, settings, job, name=f"contextfold fold {thread}")

    async def _wait_background(self, thread: str, job: _Background) -> CompactionResult | None:
        """Wait for a background fold at the hard trigger, then take its result (its event says how long)."""
        began = time.perf_counter()
        first = job.waiting_since is None
        if first:
            job.waiting_since = began
        try:
            await self._background_done(job)
        finally:
            if first and not job.settled:  # cancelled first: the time it waited counts, no more
                job.waited_before += time.perf_counter() - began
                job.waiting_since = None
        return self._take_background(thread, job)

    async def _background_done(self, running: _Background) -> None:
        """Wait for a background summary to end; in a worker thread from another thread's event loop.

        Its event belongs to the loop that entered the compactor, whose ``set``
        would never wake a task of a loop in another thread (a framework's
        synchronous call runs one).
        """
        if threading.get_ident() == self._group_thread:
            await running.done.wait()
        else:
            await anyio.to_thread.run_sync(running.ended.wait)

    def _warn_in_the_step(self, thread: str, why: str, fix: str) -> None:
        """Warn, once per entry of the compactor, that background folds run in the step: why, what to do."""
        if not self._warned_background:
            self._warned_background = True
            logger.warning(
                "thread %r: background_at is set but %s; folds run in the step. %s", thread, why, fix
            )

    async def _run_background(self, thread: str, settings: Settings, job: _Background) -> None:
        """Summarize and write the fold while the agent works; a later step returns its result.

        The write is the same guarded ``fold`` a step would make: it replaces
        only the prefix the summary covers and fails if another fold changed it,
        so the appends made meanwhile are never in its way. Once the summary is
        in, the write is shielded from cancellation, so closing the owner
        leaves either no fold or the whole fold, never half of one.

        Its events: ``BackgroundSummaryStarted`` once the prefix is planned and
        its summary begins, then one ``BackgroundSummaryApplied`` or
        ``BackgroundSummaryDiscarded``. A fold that finds another worker holding
        the thread's lease, or nothing to fold, begins nothing and emits neither
        (as a step's fold emits nothing then): the step's next check sees the
        thread as it is and folds it there if it is over the trigger.
        """
        _running_job.set(job)  # this task's own context: its summary is reported as a background one
        try:
            async with self.short_term.compaction_lock(thread) as acquired:
                if not acquired:
                    logger.debug("thread %r: another worker is compacting it; no background fold", thread)
                    return
                # Every event the fold emits inside the span is recorded on it (Telemetry.record_event).
                with self.telemetry.fold_span(thread, Reason.TOKEN_COUNT, background=True):
                    try:
                        prepared = await self._prepare(
                            thread, settings, Reason.TOKEN_COUNT, episodic=None, background=True
                        )
                        if isinstance(prepared, _Prepared):
                            if job.begun is None:  # nothing was summarized (drop or mask): begun now
                                await self._begin_background(
                                    job,
                                    thread=thread,
                                    reason=prepared.reason,
                                    tokens=prepared.tokens_before,
                                    messages_folded=len(prepared.plan.dropped),
                                    model=None,
                                    through_seq=prepared.through_seq,
                                )
                            # The lease is held until the fold is written, so no other worker
                            # summarizes the same prefix meanwhile; the write itself is shielded.
                            await self._apply(prepared, settings, background=job)
                        else:
                            job.result = prepared
                    except Exception as exc:  # raised in the next step, where the caller can see it
                        job.error = exc
                        await self._discard_background(job, "error", error=str(exc))
                    except BaseException:
                        # Cancelled before its fold was written: the owner closed.
                        with anyio.CancelScope(shield=True):
                            await self._discard_background(job, "closed")
                        raise
        finally:
            job.ended.set()
            job.done.set()

    async def _begin_background(
        self,
        job: _Background,
        *,
        thread: str,
        reason: str,
        tokens: int,
        messages_folded: int,
        model: str | None,
        through_seq: int | None,
    ) -> None:
        """Say that the background fold's summary began, over the prefix through ``through_seq``."""
        job.begun_at = time.perf_counter()
        job.begun = BackgroundSummaryStarted(
            thread=thread,
            reason=reason,
            tokens_before=tokens,
            tokens_after=tokens,
            messages_folded=messages_folded,
            summarizer_model=model,
            through_seq=through_seq,
        )
        with anyio.CancelScope(shield=True):  # every subscriber that hears the end heard the start
            await self._emit(job.begun)

    async def _discard_background(self, job: _Background, cause: DiscardCause, *, error: str = "") -> None:
        """Say that the background summary that began is thrown away; once, and only if it began."""
        begun = job.begun
        if begun is None or job.settled:
            return
        job.settled = True
        await self._emit(
            BackgroundSummaryDiscarded(
                thread=begun.thread,
                reason=begun.reason,
                tokens_before=begun.tokens_before,
                tokens_after=begun.tokens_before,
                messages_folded=begun.messages_folded,
                summarizer_model=begun.summarizer_model,
                duration_s=time.perf_counter() - job.begun_at,
                cause=cause,
                through_seq=begun.through_seq,
                error=error,
            )
        )

    def _take_background(self, thread: str, job: _Background) -> CompactionResult | None:
        """The finished background fold's result, handed to the step (its error raised there)."""
        if self._background.get(thread) is job:
            del self._background[thread]
        if job.error is not None:
            raise job.error
        return job.result


_Writer = Callable[[str, Recording], Awaitable[tuple[list[StoredMessage], ThreadStats | None]]]
"""A bundled store's ``_write_recording``: the rows written and the thread's stats as the write left them."""


def _recording_writer(store: Store | None) -> _Writer | None:
    """The store's write of a step ``append`` encoded, if its ``record_and_append`` is the one beside it.

    A bundled store writes such a recording as its own ``record_and_append``
    would have, and returns the rows and the thread's stats as the write left
    them (``None`` when it did not read them); a subclass that overrides
    ``record_and_append`` gets every step through it instead, as does an
    instance that replaces it (asked at each step: ``Compactor._bundled_writer``).
    """
    write = getattr(store, "_write_recording", None)
    if write is None:
        return None
    mro = type(store).__mro__
    writes = next((cls for cls in mro if "_write_recording" in vars(cls)), None)
    records = next((cls for cls in mro if "record_and_append" in vars(cls)), None)
    return write if writes is not None and writes is records else None  # (a proxy defines neither)


def _check_llm_call(model: object, usage: object, request_messages: object, request_tokens: object) -> None:
    """``append``'s LLM-call fields, refused before anything is written."""
    if model is not None and not isinstance(model, str):
        raise ConfigError("model", "must be the model's name as a str, or None", value=model)
    if usage is not None and not isinstance(usage, Usage):
        raise ConfigError(
            "usage", "must be a contextfold Usage(input_tokens=..., output_tokens=...), or None", value=usage
        )
    for key, count in (("request_messages", request_messages), ("request_tokens", request_tokens)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(
                key, "must be a whole number >= 0 (the request's size; 0 when unknown)", value=count
            )


def _warn_over_window(thread: str, tokens: int, limit: int) -> None:
    logger.warning(
        "thread %r holds %d tokens, more than the %d-token compaction window; loading it whole",
        thread,
        tokens,
        limit,
    )


def _crowded_turn(store: object) -> Callable[[], Awaitable[None]] | None:
    """The store's pacer's ``turn`` (a bundled store paces its calls), or ``None`` for a store without one."""
    pacer = getattr(store, "_pace", None)
    return pacer.turn if isinstance(pacer, Pacer) else None


def _step_episodes(
    extra: Sequence[Episode], messages: Sequence[Message], call: _LlmCall, started: Sequence[ToolCall]
) -> tuple[list[Episode], list[int]]:
    """The episodes that record ``messages``, and for each message the index of its own.

    ``extra`` come first. Each call in ``started`` is recorded as having run
    right before the first result that answers it, and after everything when
    none does (a step cut short while that tool ran).
    """
    episodes: list[Episode] = list(extra)
    owners: list[int] = []
    waiting = list(started)
    for message in messages:
        if waiting and message.role is Role.TOOL:
            for index, ran in enumerate(waiting):
                if ran.id == message.tool_call_id:
                    episodes.append(ToolCallEpisode(call=waiting.pop(index)))
                    break
        owners.append(len(episodes))
        episodes.append(episode_for(message, **call._asdict()))
    episodes += [ToolCallEpisode(call=ran) for ran in waiting]
    return episodes, owners


def _answer(open_calls: dict[str, int], result: Message) -> bool:
    """Whether one of ``open_calls`` (counts by id) answers ``result``; the call it answers is taken."""
    answers = result.tool_call_id or ""
    if open_calls.get(answers, 0) > 0:
        open_calls[answers] -= 1
        return True
    return False


def _late_note(message: Message) -> Message:
    """A tool result whose call was closed, as a note the model can read without an orphaned tool message."""
    return Message.user(
        f"[a result arrived for tool call {message.tool_call_id!r}, which is not open here "
        f"(never made, or closed as abandoned)]\n{message.text}",
        metadata={LATE_RESULT_METADATA_KEY: message.tool_call_id},
    )


class _Skipped(Exception):
    """The summarizer failed and ``on_summarizer_error="skip"`` says to fold nothing this time."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause
