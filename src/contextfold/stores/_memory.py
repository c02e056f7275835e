"""``MemoryStore``: both stores in one process's memory, for tests, examples and short runs.

Each method runs without awaiting in between its reads and writes, so on one
event loop every operation is atomic. Messages are copied through their JSON
on the way in, exactly as the SQL backends store them, so what a caller reads
back never aliases what it appended.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Self

from anyio.lowlevel import checkpoint

from .._episodes import Episode, EpisodeRecord
from .._errors import StoreClosedError
from .._messages import Message
from .._policy import EpisodicCompactionPressure
from .._resource import AsyncResource
from ._base import ContextWindow, StoredMessage, ThreadStats
from ._rows import (
    PressureCounters,
    check_from_seq,
    check_max_tokens,
    check_replace,
    check_thread,
    decode_episode,
    encode_episode,
    encode_messages,
    missing_seq_conflict,
    utc,
    version_conflict,
)

__all__ = ["MemoryStore"]


@dataclass
class _Context:
    messages: list[StoredMessage] = field(default_factory=list)
    stats: ThreadStats = field(default_factory=ThreadStats)
    compacting: bool = False


@dataclass
class _Log:
    records: list[EpisodeRecord] = field(default_factory=list)
    counters: PressureCounters = field(default_factory=PressureCounters)


class MemoryStore(AsyncResource):
    """A ``ShortTermStore`` and ``EpisodicStore`` in memory; the data lives as long as the object."""

    def __init__(self) -> None:
        self._contexts: dict[str, _Context] = {}
        self._logs: dict[str, _Log] = {}
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
        await checkpoint()
        self._check_open()

    # short-term -----------------------------------------------------------

    async def append(
        self, thread: str, messages: Sequence[Message], tokens: Sequence[int]
    ) -> list[StoredMessage]:
        await self._enter()
        check_thread(thread)
        rows = encode_messages(messages, tokens)
        context = self._contexts.setdefault(thread, _Context())
        stats = context.stats
        stored = [
            StoredMessage(seq=stats.last_seq + n, tokens=count, message=Message.model_validate_json(body))
            for n, (body, count) in enumerate(rows, start=1)
        ]
        context.messages.extend(stored)
        context.stats = stats.model_copy(
            update={
                "message_count": stats.message_count + len(stored),
                "total_tokens": stats.total_tokens + sum(count for _, count in rows),
                "last_seq": stats.last_seq + len(stored),
            }
        )
        return stored

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        await self._enter()
        check_thread(thread)
        limit = check_max_tokens(max_tokens)
        context = self._contexts.get(thread, _Context())
        messages = context.messages
        start = len(messages)
        if limit is None:
            start = 0
        else:
            left = limit
            while start > 0 and messages[start - 1].tokens <= left:
                start -= 1
                left -= messages[start].tokens
        return ContextWindow(
            thread=thread,
            messages=tuple(messages[start:]),
            version=context.stats.version,
            total_tokens=context.stats.total_tokens,
            complete=start == 0,
        )

    async def stats(self, thread: str) -> ThreadStats:
        await self._enter()
        check_thread(thread)
        context = self._contexts.get(thread)
        return context.stats if context else ThreadStats()

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
        rows = encode_messages(replacement, tokens, field="replacement")
        context = self._contexts.get(thread, _Context())
        stats = context.stats
        if stats.version != expected_version:
            raise version_conflict(thread, stats.version, expected_version)
        messages = context.messages
        cut = bisect.bisect_right(messages, through_seq, key=lambda stored: stored.seq)
        if cut == 0 or messages[cut - 1].seq != through_seq:
            raise missing_seq_conflict(thread, through_seq)
        first = through_seq - len(rows) + 1
        new = [
            StoredMessage(seq=first + n, tokens=count, message=Message.model_validate_json(body))
            for n, (body, count) in enumerate(rows)
        ]
        removed = messages[:cut]
        context.messages = new + messages[cut:]
        context.stats = stats.model_copy(
            update={
                "message_count": stats.message_count - len(removed) + len(new),
                "total_tokens": stats.total_tokens
                - sum(stored.tokens for stored in removed)
                + sum(stored.tokens for stored in new),
                "version": stats.version + 1,
            }
        )
        return context.stats

    @asynccontextmanager
    async def compaction_lock(self, thread: str) -> AsyncIterator[bool]:
        await self._enter()
        check_thread(thread)
        context = self._contexts.setdefault(thread, _Context())
        if context.compacting:
            yield False
            return
        context.compacting = True
        try:
            yield True
        finally:
            context.compacting = False

    # episodic -------------------------------------------------------------

    async def record(self, thread: str, episode: Episode, *, at: datetime | None = None) -> EpisodeRecord:
        await self._enter()
        check_thread(thread)
        when = utc(at, "at")
        body = encode_episode(episode)
        log = self._logs.setdefault(thread, _Log())
        counters = log.counters.after(episode, when)
        stored = EpisodeRecord(
            thread=thread, seq=counters.last_seq, at=when, episode=decode_episode(thread, 0, body)
        )
        log.records.append(stored)
        log.counters = counters
        return stored

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        await self._enter()
        check_thread(thread)
        index = max(check_from_seq(from_seq), 1) - 1
        records = self._logs.get(thread, _Log()).records
        while index < len(records):
            yield records[index]
            index += 1
            await self._enter()

    async def pressure(
        self,
        thread: str,
        *,
        now: datetime | None = None,
        estimated_context_tokens: int | None = None,
    ) -> EpisodicCompactionPressure:
        await self._enter()
        check_thread(thread)
        counters = self._logs.get(thread, _Log()).counters
        return counters.pressure(utc(now, "now"), estimated_context_tokens)

    async def latest_checkpoint(self, thread: str) -> EpisodeRecord | None:
        await self._enter()
        check_thread(thread)
        log = self._logs.get(thread)
        if log is None or log.counters.boundary_seq is None:
            return None
        return log.records[log.counters.boundary_seq - 1]
