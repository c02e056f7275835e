"""``MemoryStore``: both stores in one process's memory, for tests, examples and short runs.

Each method runs without awaiting in between its reads and writes, so on one
event loop every operation is atomic: a ``fold`` checks the guard, records the
checkpoint and swaps the prefix with nothing else running in between. Nothing
in it belongs to an event loop, so loops in several threads may share one (a
sync framework's calls, each in a loop of its own): each write holds a thread
lock over its reads and writes, so two threads writing one conversation thread
at the same moment are kept apart too. Messages
are copied through their JSON on the way in, exactly as the SQL backends
store them, so what a caller reads back never aliases what it appended. The
episodic log keeps each episode as its JSON text and decodes it when
replayed: a long log is a list of strings, not objects the garbage collector
walks on every full pass.

Every call but the per-step point reads is a cancellation point. Those reads
(``state``, ``stats``, ``pressure``: a dictionary lookup) neither yield to
other tasks nor look for a cancellation, as ``SQLiteStore``'s on-loop reads do
not: a no-op check that yielded would wait one round of every other ready
task, which with many busy agents on one loop is most of its latency, and
asking anyio whether the caller was cancelled costs more than the lookup.
The other calls are paced (see :class:`~contextfold._pacing.Pacer`): each
looks for a cancellation, and they yield to other tasks at least every
0.2 ms, so a loop that only records and checks still lets a background
summary (or any other task) run, without paying a round of the event loop on
every write.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Self

from .._episodes import Episode, EpisodeRecord, SummaryCheckpoint
from .._errors import StoreClosedError
from .._messages import Message
from .._pacing import Pacer
from .._policy import EpisodicCompactionPressure
from .._resource import AsyncResource
from ._base import ContextWindow, StoredMessage, ThreadInfo, ThreadState, ThreadStats, Tombstone
from ._rows import (
    PressureCounters,
    Recording,
    begin_write,
    by_activity,
    check_after_seq,
    check_checkpoint,
    check_from_seq,
    check_max_tokens,
    check_replace,
    check_thread,
    check_total,
    counted_write,
    decode_episode,
    edit_links,
    encode_edit,
    encode_episode,
    encode_recording,
    encode_rows,
    end_write,
    fold_links,
    missing_seq_conflict,
    off_loop_if_heavy,
    summary_index,
    tail_from,
    trusted,
    utc,
    version_conflict,
)

__all__ = ["MemoryStore"]


@dataclass
class _Context:
    messages: list[StoredMessage] = field(default_factory=list)
    stats: ThreadStats = field(default_factory=ThreadStats)


@dataclass
class _Log:
    records: list[tuple[datetime, str] | Message] = field(default_factory=list)
    """Each episode's time and JSON; its seq is its position plus one. A step recorded unencoded
    (``Recording.encoded``) holds the store's copy of its message instead until the episode is
    first read, and its time and the JSON before that message wait in ``unencoded``."""
    unencoded: dict[int, tuple[datetime, str]] = field(default_factory=dict)
    """By position in ``records``: an unencoded episode's time and JSON head. These tuples hold no
    object the collector tracks, so such an episode adds none to a full collection's walk."""
    counters: PressureCounters = field(default_factory=PressureCounters)

    def read(self, thread: str, seq: int) -> EpisodeRecord:
        entry = self.records[seq - 1]
        if isinstance(entry, Message):  # encoded on its first read; each read decodes a copy
            at, head = self.unencoded.pop(seq - 1)
            body = f"{head}{entry.model_dump_json()}}}"
            self.records[seq - 1] = (at, body)
        else:
            at, body = entry
        return EpisodeRecord(thread=thread, seq=seq, at=at, episode=decode_episode(thread, seq, body))

    def last_at(self) -> datetime | None:
        """When the newest episode was recorded."""
        if not self.records:
            return None
        entry = self.records[-1]
        return self.unencoded[len(self.records) - 1][0] if isinstance(entry, Message) else entry[0]


_NO_CONTEXT = _Context()
"""What a thread without messages reads as; never written to."""

_NO_COUNTERS = PressureCounters()


_Row = tuple[str, int, Message]
"""A message's JSON, its token count and the copy read back from that JSON."""


class MemoryStore(AsyncResource):
    """A ``Store`` (both memories) in memory; the data lives as long as the object.

    The compaction lock is a flag in this object: it spans the tasks of one
    process, and a second ``MemoryStore`` is a different store.
    """

    def __init__(self) -> None:
        self._contexts: dict[str, _Context] = {}
        self._logs: dict[str, _Log] = {}
        self._tombstones: dict[str, list[Tombstone]] = {}
        self._compacting: set[str] = set()
        # Each write's reads and writes under one lock: one event loop never interleaves them
        # (nothing awaits in between), but loops in other OS threads could.
        self._lock = threading.Lock()
        self._pace = Pacer()
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this MemoryStore was closed with aclose(); create a new MemoryStore")

    async def _enter(self) -> None:
        await self._pace()
        self._check_open()

    def _total_after(self, thread: str, rows: list[_Row]) -> int:
        """The thread's token total once ``rows`` are appended, checked to fit every backend."""
        total = self._contexts.get(thread, _NO_CONTEXT).stats.total_tokens
        for _, count, _ in rows:  # loops, not comprehensions, here: a step has one or two rows
            total += count
        return check_total(thread, total)

    def _append_rows(
        self, thread: str, rows: list[_Row], episode_seqs: list[int | None], total: int
    ) -> list[StoredMessage]:
        """Append ``rows``; ``total`` is the thread's token total after them (``_total_after``)."""
        context = self._contexts.get(thread)
        if context is None:
            context = self._contexts[thread] = _Context()
        stats = context.stats
        seq = stats.last_seq
        stored: list[StoredMessage] = []
        for (_, count, copy), link in zip(rows, episode_seqs, strict=True):
            seq += 1
            stored.append(trusted(StoredMessage, seq=seq, message=copy, tokens=count, episode_seq=link))
        context.messages += stored
        context.stats = trusted(
            ThreadStats,
            message_count=stats.message_count + len(stored),
            total_tokens=total,
            version=stats.version,
            last_seq=seq,
        )
        return stored

    def _record_bodies(
        self,
        thread: str,
        episodes: Sequence[Episode],
        bodies: Sequence[str],
        when: datetime,
        rows: Sequence[_Row] | None = None,
    ) -> list[int]:
        """Append the episodes' JSON to the thread's log; return their seqs.

        With ``rows``, each body is the JSON before that row's message, whose copy the log
        keeps until the episode is first read (``Recording.encoded``).
        """
        log = self._logs.get(thread)
        if log is None:
            log = self._logs[thread] = _Log()
        counters = log.counters
        seqs: list[int] = []
        for episode in episodes:
            counters = counters.after(episode, when)
            seqs.append(counters.last_seq)
        records = log.records
        if rows is None:
            for body in bodies:
                records.append((when, body))
        else:
            unencoded = log.unencoded
            for head, (_, _, copy) in zip(bodies, rows, strict=True):
                unencoded[len(records)] = (when, head)
                records.append(copy)
        log.counters = counters
        return seqs

    def _window(self, thread: str, context: _Context, start: int, *, complete: bool) -> ContextWindow:
        return ContextWindow(
            thread=thread,
            messages=tuple(context.messages[start:]),
            version=context.stats.version,
            total_tokens=context.stats.total_tokens,
            complete=complete,
            last_seq=context.stats.last_seq,
        )

    # short-term -----------------------------------------------------------

    @counted_write
    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        await self._enter()
        check_thread(thread)
        rows = await off_loop_if_heavy(messages, encode_rows, messages, tokens)
        self._check_open()  # a large batch was encoded in a thread: the store may have closed meanwhile
        with self._lock:
            return self._append_rows(thread, rows, [None] * len(rows), self._total_after(thread, rows))

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        await self._enter()
        check_thread(thread)
        limit = check_max_tokens(max_tokens)
        with self._lock:  # the messages and the stats of one moment, whatever other threads write
            context = self._contexts.get(thread, _NO_CONTEXT)
            messages = context.messages
            start = len(messages)
            if limit is None:
                start = 0
            else:
                left = limit
                while start > 0 and messages[start - 1].tokens <= left:
                    start -= 1
                    left -= messages[start].tokens
            return self._window(thread, context, start, complete=start == 0)

    async def tail(self, thread: str, *, after_seq: int) -> ContextWindow:
        await self._enter()
        check_thread(thread)
        after = check_after_seq(after_seq)
        with self._lock:
            context = self._contexts.get(thread, _NO_CONTEXT)
            start = bisect.bisect_right(context.messages, tail_from(after), key=lambda stored: stored.seq)
            return self._window(thread, context, start, complete=after == 0)

    async def stats(self, thread: str) -> ThreadStats:
        self._check_open()
        check_thread(thread)
        return self._contexts.get(thread, _NO_CONTEXT).stats

    async def state(self, thread: str, *, now: datetime | None = None) -> ThreadState:
        self._check_open()
        check_thread(thread)
        when = utc(now, "now")
        stats = self._contexts.get(thread, _NO_CONTEXT).stats
        log = self._logs.get(thread)
        counters = log.counters if log is not None else _NO_COUNTERS
        return trusted(ThreadState, stats=stats, pressure=counters.pressure(when, stats.total_tokens))

    def _swap(
        self, thread: str, through_seq: int, expected_version: int, rows: list[_Row]
    ) -> tuple[_Context, int, ThreadStats]:
        """Check the guard; return the context, the cut index and the stats after the swap."""
        context = self._contexts.get(thread, _Context())
        stats = context.stats
        if stats.version != expected_version:
            raise version_conflict(thread, stats.version, expected_version)
        messages = context.messages
        cut = bisect.bisect_right(messages, through_seq, key=lambda stored: stored.seq)
        if cut == 0 or messages[cut - 1].seq != through_seq:
            raise missing_seq_conflict(thread, through_seq)
        removed = sum(stored.tokens for stored in messages[:cut])
        new = trusted(
            ThreadStats,
            message_count=stats.message_count - cut + len(rows),
            total_tokens=check_total(
                thread, stats.total_tokens - removed + sum(count for _, count, _ in rows)
            ),
            version=stats.version + 1,
            last_seq=stats.last_seq,
        )
        return context, cut, new

    @staticmethod
    def _apply(
        context: _Context,
        cut: int,
        stats: ThreadStats,
        through_seq: int,
        rows: list[_Row],
        links: Sequence[int | None],
    ) -> None:
        first = through_seq - len(rows) + 1
        new = [
            trusted(StoredMessage, seq=first + n, message=copy, tokens=count, episode_seq=link)
            for n, ((_, count, copy), link) in enumerate(zip(rows, links, strict=True))
        ]
        context.messages = new + context.messages[cut:]
        context.stats = stats

    @counted_write
    async def replace_prefix(
        self,
        thread: str,
        *,
        through_seq: int,
        expected_version: int,
        replacement: Sequence[Message],
        tokens: Sequence[int],
    ) -> ThreadStats:
        await self._enter()
        check_thread(thread)
        check_replace(through_seq, expected_version)
        rows = await off_loop_if_heavy(
            replacement, partial(encode_rows, replacement, tokens, field="replacement")
        )
        self._check_open()
        with self._lock:
            context, cut, stats = self._swap(thread, through_seq, expected_version, rows)
            self._apply(context, cut, stats, through_seq, rows, [None] * len(rows))
        return stats

    @asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        await self._enter()
        check_thread(thread)
        with self._lock:
            taken = thread not in self._compacting
            self._compacting.add(thread)
        if not taken:
            yield False
            return
        try:
            yield True
        finally:
            self._compacting.discard(thread)

    # episodic -------------------------------------------------------------

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        await self._enter()
        check_thread(thread)
        when = utc(at, "at")
        body = encode_episode(episode)
        with self._lock:
            (seq,) = self._record_bodies(thread, [episode], [body], when)
        return EpisodeRecord(thread=thread, seq=seq, at=when, episode=episode)

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        await self._enter()
        check_thread(thread)
        index = max(check_from_seq(from_seq), 1) - 1
        log = self._logs.get(thread, _Log())
        while index < len(log.records) and self._logs.get(thread) is log:
            yield log.read(thread, index + 1)
            index += 1
            await self._enter()

    async def pressure(
        self,
        thread: str,
        *,
        now: datetime | None = None,
        estimated_context_tokens: int | None = None,
    ) -> EpisodicCompactionPressure:
        self._check_open()
        check_thread(thread)
        log = self._logs.get(thread)
        counters = log.counters if log is not None else _NO_COUNTERS
        return counters.pressure(utc(now, "now"), estimated_context_tokens)

    async def latest_checkpoint(self, thread: str) -> EpisodeRecord | None:
        await self._enter()
        check_thread(thread)
        log = self._logs.get(thread)
        if log is None or log.counters.boundary_seq is None:
            return None
        return log.read(thread, log.counters.boundary_seq)

    # both memories --------------------------------------------------------

    @counted_write
    async def record_and_append(
        self,
        thread: str,
        episodes: Sequence[Episode],
        messages: Sequence[Message],
        tokens: Sequence[int],
        *,
        message_episodes: Sequence[int] | None = None,
    ) -> list[StoredMessage]:
        check_thread(thread)
        recording = await off_loop_if_heavy(
            messages, encode_recording, episodes, messages, tokens, message_episodes
        )
        return (await self._write_recording(thread, recording))[0]

    _KEEPS_EPISODES = True
    """``_write_recording`` takes a step recorded with ``encode=False`` (see ``record_messages``)."""

    async def _write_recording(
        self, thread: str, recording: Recording
    ) -> tuple[list[StoredMessage], ThreadStats | None]:
        """``record_and_append`` of a step checked and encoded already: nothing is written unless all is.

        Also the thread's stats once it is written, as ``stats`` would read them.
        """
        await self._enter()
        check_thread(thread)
        slot = begin_write(thread)
        try:
            rows = recording.rows
            when = datetime.now(UTC)
            # A step ``Compactor.append`` checked without encoding it: each episode's JSON is made when read.
            unencoded = None if recording.encoded else rows
            with self._lock:
                total = self._total_after(thread, rows)  # before anything is written
                seqs = self._record_bodies(thread, recording.episodes, recording.bodies, when, unencoded)
                links: list[int | None] = []
                for link in recording.links:
                    links.append(None if link is None else seqs[link])
                stored = self._append_rows(thread, rows, links, total)
                return stored, self._contexts[thread].stats
        finally:
            end_write(slot)

    @counted_write
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
        await self._enter()
        check_thread(thread)
        body = check_checkpoint(checkpoint)
        check_replace(through_seq, expected_version)
        rows = await off_loop_if_heavy(
            replacement, partial(encode_rows, replacement, tokens, field="replacement")
        )
        self._check_open()
        with self._lock:
            context, cut, stats = self._swap(thread, through_seq, expected_version, rows)
            when = datetime.now(UTC)
            (seq,) = self._record_bodies(thread, [checkpoint], [body], when)
            record = trusted(EpisodeRecord, thread=thread, seq=seq, at=when, episode=checkpoint)
            self._contexts[thread] = context
            messages, ends = context.messages, min(len(rows), cut)
            links = fold_links(
                checkpoint,
                record.seq,
                size=len(rows),
                summary_at=summary_index([copy for _, _, copy in rows], checkpoint),
                count=cut,
                first=[(row.seq, row.episode_seq) for row in messages[:ends]],
                last=[(row.seq, row.episode_seq) for row in messages[cut - ends : cut]],
            )
            self._apply(context, cut, stats, through_seq, rows, links)
        return record

    @counted_write
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
        await self._enter()
        check_thread(thread)
        check_replace(through_seq, expected_version)
        recording, kept = await off_loop_if_heavy(
            replacement, encode_edit, episodes, replacement, tokens, message_episodes, stands_for
        )
        rows = recording.rows
        self._check_open()
        with self._lock:
            context, cut, stats = self._swap(thread, through_seq, expected_version, rows)
            seqs = self._record_bodies(thread, recording.episodes, recording.bodies, datetime.now(UTC))
            replaced = context.messages[:cut]
            wanted = {seq for seq in kept if seq is not None}
            links = edit_links(
                recording.links,
                seqs,
                kept,
                {row.seq: row.episode_seq for row in replaced if row.seq in wanted},
            )
            self._apply(context, cut, stats, through_seq, rows, links)
        return stats

    @counted_write
    async def forget(self, thread: str) -> Tombstone:
        await self._enter()
        check_thread(thread)
        with self._lock:
            return self._forget(thread)

    def _forget(self, thread: str) -> Tombstone:
        context = self._contexts.get(thread)
        log = self._logs.pop(thread, None)
        tombstone = Tombstone(
            thread=thread,
            forgotten_at=datetime.now(UTC),
            messages=len(context.messages) if context else 0,
            episodes=len(log.records) if log else 0,
        )
        if context is not None:
            # The version and seq counter go on, so a cache of the forgotten context never matches;
            # a thread that never held a message nor was replaced had no context, and its version
            # stays (as on SQLite and PostgreSQL, which keep no row for it).
            stats = context.stats
            held = stats.last_seq > 0 or stats.version > 0
            context.messages = []
            context.stats = ThreadStats(version=stats.version + (1 if held else 0), last_seq=stats.last_seq)
        self._tombstones.setdefault(thread, []).append(tombstone)
        return tombstone

    async def tombstones(self, thread: str) -> list[Tombstone]:
        await self._enter()
        check_thread(thread)
        return list(self._tombstones.get(thread, ()))

    async def threads(self) -> list[ThreadInfo]:
        await self._enter()
        infos: list[ThreadInfo] = []
        for thread in self._contexts.keys() | self._logs.keys():
            context = self._contexts.get(thread)
            log = self._logs.get(thread)
            stats = context.stats if context else ThreadStats()
            if stats.message_count == 0 and not (log and log.records):
                continue
            infos.append(
                ThreadInfo(
                    thread=thread,
                    message_count=stats.message_count,
                    total_tokens=stats.total_tokens,
                    episodes=len(log.records) if log else 0,
                    last_activity=log.last_at() if log else None,
                )
            )
        return by_activity(infos)
