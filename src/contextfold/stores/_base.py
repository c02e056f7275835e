"""The two storage protocols and the data they exchange.

``ShortTermStore`` holds the working context: lossy by design, rewritten by
compaction through one guarded, atomic ``replace_prefix``. ``EpisodicStore``
holds the audit trail: ``record`` and ``replay`` only — there is no update
and no delete, here or in any backend.

What every backend guarantees when a call does not succeed: input that fails
validation raises before anything is written; a write that fails part-way
(the database refusing a statement, a crashed process) is rolled back whole;
a write whose caller is cancelled is either not applied or applied whole, and
which of the two is settled by the time the cancellation reaches the caller,
so nothing changes afterwards on its behalf. A closed store raises
``StoreClosedError`` from every method.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from .._episodes import Episode, EpisodeRecord, SummaryCheckpoint
from .._messages import Message
from .._policy import EpisodicCompactionPressure

__all__ = [
    "ContextWindow",
    "EpisodicStore",
    "ShortTermStore",
    "Store",
    "StoredMessage",
    "ThreadInfo",
    "ThreadState",
    "ThreadStats",
    "Tombstone",
]


class StoredMessage(BaseModel):
    """A message in a thread's working context, with its sequence number and tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int
    message: Message
    tokens: int = Field(ge=0)
    episode_seq: int | None = None
    """Seq of the episode that recorded this message, when it was recorded with it.

    After a ``fold``, a summary's is its checkpoint's, and a message the fold
    rewrote in place (masked, truncated) keeps its original's.
    """


class ThreadStats(BaseModel):
    """O(1) facts about a thread's working context."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    message_count: int = 0
    total_tokens: int = 0
    version: int = 0
    """Bumped by every ``replace_prefix``; the guard a caller passes back."""
    last_seq: int = 0
    """Sequence number of the newest message (0 for an empty thread)."""


class ThreadState(BaseModel):
    """What a compactor with the episodic policy checks before every request: stats and pressure.

    Read in one query, so the per-step check costs one round trip however
    long the thread is. ``pressure.estimated_context_tokens`` is
    ``stats.total_tokens``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    stats: ThreadStats
    pressure: EpisodicCompactionPressure


class ContextWindow(BaseModel):
    """What ``load`` read: messages in order, and the thread's state when it read them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thread: str
    messages: tuple[StoredMessage, ...]
    version: int
    total_tokens: int
    """Tokens of the whole working context, not only of the loaded messages."""
    complete: bool
    """Whether the window reaches back to the thread's first message."""
    last_seq: int = 0
    """Seq of the thread's newest message when it was read (0 for an empty thread)."""

    @property
    def plain(self) -> list[Message]:
        return [stored.message for stored in self.messages]

    @property
    def tokens(self) -> list[int]:
        return [stored.tokens for stored in self.messages]


class _Resource(Protocol):
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class ShortTermStore(_Resource, Protocol):
    """The working context a thread's next request is built from."""

    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        """Append messages (with their token counts) after the newest one; return them stored."""
        ...

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        """The working context; with ``max_tokens``, only the newest messages that fit.

        A windowed load reads from the newest message backwards and stops at the
        limit: it does not read the whole thread.
        """
        ...

    async def stats(self, thread: str) -> ThreadStats:
        """Message count, token total, version and newest seq, in O(1)."""
        ...

    async def replace_prefix(
        self,
        thread: str,
        *,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
    ) -> ThreadStats:
        """Atomically swap every message with ``seq <= through_seq`` for ``replacement``.

        Raises ``ConflictError`` unless the thread is still at ``expected_version``
        (no other prefix replacement happened since the caller read it) and
        ``through_seq`` is a message the thread holds. Messages after the cut,
        appended concurrently included, are never touched. The replacement
        messages take the sequence numbers ending at ``through_seq``, so they sort
        before every kept message and new appends keep counting up. They link no
        episode (``episode_seq`` is None): only ``fold``, whose checkpoint says
        which rows it folds, knows which rows they stand for.
        """
        ...

    def compaction_lock(self, thread: str) -> AbstractAsyncContextManager[bool]:
        """Try to become the thread's one compactor; yields whether it did (never waits).

        On the SQL backends this is a lease row timed by the database's own
        clock, taken and released in short transactions: no connection or lock
        is held while the body runs, and a crashed holder's lease expires after
        the store's ``lease_seconds`` (300 by default). A body that outlives its
        lease may meet a second compactor; the version guard of the fold then
        lets only one of them apply.
        """
        ...


class ThreadInfo(BaseModel):
    """One thread as listed by ``Store.threads()``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thread: str
    message_count: int = 0
    """Messages in the working context."""
    total_tokens: int = 0
    """Tokens of the working context."""
    episodes: int = 0
    """Episodes in the log."""
    last_activity: datetime | None = None
    """When the newest episode was recorded."""


class Tombstone(BaseModel):
    """What ``Store.forget`` removed, kept in place of the thread's rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thread: str
    forgotten_at: datetime
    messages: int
    """Working-context rows removed."""
    episodes: int
    """Episodes removed from the log."""


@runtime_checkable
class EpisodicStore(_Resource, Protocol):
    """The append-only audit trail of every thread."""

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        """Append one episode (``at`` defaults to now, UTC); return it with its seq."""
        ...

    def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        """Episodes of ``thread`` with ``seq >= from_seq``, oldest first."""
        ...

    async def pressure(
        self,
        thread: str,
        *,
        now: datetime | None = None,
        estimated_context_tokens: int | None = None,
    ) -> EpisodicCompactionPressure:
        """Pressure since the latest boundary, from maintained counters (no scan)."""
        ...

    async def latest_checkpoint(self, thread: str) -> EpisodeRecord | None:
        """The newest summary checkpoint or manual-recovery boundary, if any."""
        ...


@runtime_checkable
class Store(ShortTermStore, EpisodicStore, Protocol):
    """Both memories in one backend, so that what must be atomic is one transaction.

    Every bundled backend is a ``Store``. With two separate objects (a
    ``ShortTermStore`` and an ``EpisodicStore``) recording and folding are
    two writes, not one: each write is atomic on its own, but a crash or a
    failure between them can leave episodes that never reached the context,
    or a checkpoint whose prefix swap did not happen. Only a ``Store`` makes
    ``record_and_append``, ``fold`` and ``record_and_replace`` one transaction.
    """

    async def state(self, thread: str, *, now: datetime | None = None) -> ThreadState:
        """``stats`` and ``pressure`` (age measured at ``now``, default now) in one read."""
        ...

    async def tail(self, thread: str, *, after_seq: int) -> ContextWindow:
        """Messages with ``seq > after_seq``, oldest first, with the thread's current state.

        The incremental read of a cached context: when ``version`` is the one
        the cache was built at, the cache plus these messages is the whole
        working context. ``complete`` is ``after_seq == 0``.
        """
        ...

    async def record_and_append(
        self,
        thread: str,
        episodes: Sequence[Episode],
        messages: Sequence[Message],
        tokens: Sequence[int],
        *,
        message_episodes: Sequence[int] | None = None,
    ) -> list[StoredMessage]:
        """Record ``episodes`` and append ``messages`` in one transaction.

        ``message_episodes[i]`` is the index in ``episodes`` of the episode
        that records ``messages[i]``; the stored message keeps that episode's
        seq as ``episode_seq``. Either everything is written or nothing is.
        """
        ...

    async def fold(
        self,
        thread: str,
        *,
        checkpoint: SummaryCheckpoint,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
    ) -> EpisodeRecord:
        """Record ``checkpoint`` and ``replace_prefix`` in one transaction; return the record.

        Raises ``ConflictError`` exactly when ``replace_prefix`` would, and
        then writes nothing: every checkpoint in the log was applied.

        Each replacement message keeps the ``episode_seq`` of the row it stands
        for, so a later fold that drops it still knows which log seqs it covers:

        - the replaced rows before ``checkpoint.from_seq`` (the pinned head and
          a previous summary: the head the fold keeps) are carried over, one
          for one, by the first replacement messages;
        - the other replacement messages stand for the newest replaced rows,
          one for one and in order (the kept messages a fold rewrites in
          place, masked or truncated, end at ``through_seq``); one for which
          no such row is left links no episode;
        - when the checkpoint carries a summary, the first summary message in
          the replacement (``Message.is_summary``) gets the checkpoint's seq
          instead. A checkpoint without one (a fold that only drops or masks)
          links no row, and a previous summary it carries over keeps its link.
        """
        ...

    async def record_and_replace(
        self,
        thread: str,
        episodes: Sequence[Episode],
        *,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
        message_episodes: Sequence[int | None] | None = None,
        stands_for: Sequence[int | None] | None = None,
    ) -> ThreadStats:
        """Record ``episodes`` and ``replace_prefix`` in one transaction; return the stats after it.

        How an edit of the conversation is applied (a message removed or
        rewritten, a history cleared): the log records the conversation withdrawn
        (``MessagesRetractedEpisode``, ``HistoryClearedEpisode``) and what stays
        of it again, and the working context takes the edit, or neither does.
        Raises ``ConflictError`` exactly when ``replace_prefix`` would, and then
        writes nothing, no episode either. The episodes take the log's next seqs.

        Each replacement message links an episode as a fold's do:

        - ``message_episodes[i]``, when not ``None``, is the index in ``episodes``
          of the episode that records ``replacement[i]``: the row links its seq;
        - else ``stands_for[i]``, when not ``None``, is the seq of the replaced
          row the message stands for (the same message, kept or rewritten in
          place): the row keeps that row's ``episode_seq``. A seq that is not one
          of the replaced rows links no episode;
        - else the row links no episode, as after ``replace_prefix``.
        """
        ...

    async def forget(self, thread: str) -> Tombstone:
        """Remove every row of ``thread`` from both memories and leave a tombstone.

        The one sanctioned removal from the append-only log, for deletion
        requests; the database rejects every other UPDATE or DELETE on it.
        Forgetting a thread that holds nothing still writes a tombstone.
        """
        ...

    async def tombstones(self, thread: str) -> list[Tombstone]:
        """The tombstones ``forget`` left for ``thread``, oldest first."""
        ...

    async def threads(self) -> list[ThreadInfo]:
        """Every thread with a working context or a log, by last activity, newest first."""
        ...


def implements(value: object, protocol: type) -> bool:
    """``isinstance(value, protocol)``, also for a wrapper that forwards its attributes (``__getattr__``).

    From Python 3.12 a runtime protocol's check looks attributes up
    statically and misses forwarded ones (a logging or metrics proxy around
    a store); the protocol's members are then looked up as a call would.
    """
    if isinstance(value, protocol):
        return True
    members = getattr(protocol, "__protocol_attrs__", None)
    if members is None:
        return False
    plain: frozenset[str] = getattr(protocol, "__non_callable_proto_members__", frozenset())
    # As isinstance() has it: a method set to None is a member withdrawn.
    return all(getattr(value, name, None) is not None or name in plain for name in members)
