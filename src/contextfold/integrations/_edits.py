"""Following an edit an application made to a conversation a framework holds for it.

An adapter finds the edit its own way (LangChain by message id, pydantic-ai by
content); what follows is the same for both. The log, which keeps every
original, records the conversation withdrawn from the oldest edited message on
(``MessagesRetractedEpisode``, or ``HistoryClearedEpisode`` from the start) and
what stays of it recorded again, as edited, so a replay gives the edited
conversation; the working context takes the edit.

On one ``Store`` the two are one transaction (``Store.record_and_replace``),
guarded by the version the context was loaded at, so a failure leaves both as
they were, and a fold that comes between makes the edit load the context
again and retry. The whole edit, from loading the context and reading the log
to the write, holds the thread's ``sync`` lock (the one ``_sync.sync`` and
``_sync.append`` hold, from any event loop), so no step of the thread lands in
between. With two stores (``Compactor(short_term=..., episodic=...)``) the
context is written first and the log second, as a fold's two writes are: every
withdrawal the log records was applied, and a failure between the two leaves
the context edited and the log without the edit.
"""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from .._compactor import Compactor
from .._episodes import Episode, HistoryClearedEpisode, MessagesRetractedEpisode, conversation, episode_for
from .._errors import ConflictError
from .._messages import Message
from .._sync import _seen, content_hash, message_key
from .._threads import holding
from ..stores._base import ContextWindow, Store, StoredMessage, implements
from ..stores._rows import off_loop_if_heavy

__all__ = ["Edit", "Plan", "Row", "follow", "kept", "said", "withdrawal"]

_ATTEMPTS = 3
"""Loads of the context an edit makes when folds keep coming between its load and its write."""


class Row(NamedTuple):
    """A message of the edited working context."""

    message: Message
    tokens: int | None
    """``None`` to count them."""
    stands_for: int | None = None
    """The seq of the loaded row it is (kept, or rewritten in place): it keeps that row's episode link."""
    recorded: int | None = None
    """The index in ``Edit.episodes`` of the episode that records it again: it links that one instead."""


def kept(stored: StoredMessage) -> Row:
    """``stored`` left as it was."""
    return Row(stored.message, stored.tokens, stored.seq)


@dataclass(frozen=True, slots=True)
class Edit:
    """What following an edit writes: the log's episodes and the context replacing the loaded one."""

    episodes: list[Episode]
    context: list[Row] | None
    """The whole working context after the edit; ``None`` leaves it as it is."""


Plan = Callable[[Sequence[StoredMessage]], Awaitable[Edit | None]]
"""The edit of a thread's working context, loaded whole (again after a conflict); ``None`` for none."""


async def said(compactor: Compactor, thread: str) -> list[Message]:
    """The conversation a replay of ``thread``'s log gives, retractions and clears applied."""
    return conversation([record async for record in compactor.episodic.replay(thread)])


def withdrawal(said: int, first: int, again: Sequence[Message], context: list[Row] | None) -> Edit:
    """Withdraw the ``said``-message conversation from ``first`` on, then record ``again``; ``context`` after.

    Each row of ``context`` that is a message of ``again`` (by its key, else its
    content; the newest of them, each row before the next's) links the episode
    that records it again.
    """
    if first >= said:
        return Edit([], context)
    episodes: list[Episode] = [
        HistoryClearedEpisode() if first == 0 else MessagesRetractedEpisode(count=said - first),
        *map(episode_for, again),
    ]
    if context is None:
        return Edit(episodes, None)
    found = _recorded([row.message for row in context], again)
    rows = [row if n is None else row._replace(recorded=1 + n) for row, n in zip(context, found, strict=True)]
    return Edit(episodes, rows)


def _recorded(context: Sequence[Message], again: Sequence[Message]) -> list[int | None]:
    """For each message of ``context``, the position in ``again`` of the same message, if any.

    Matched from the end, each message to the newest one of its mark before
    the position the next message took: a key may repeat (a provider reusing
    a tool call id), and the context's tail is the end of ``again``.
    """
    where: dict[str, list[int]] = {}
    for n, message in enumerate(again):
        where.setdefault(_mark(message), []).append(n)
    found: list[int | None] = [None] * len(context)
    before = len(again)
    for index in range(len(context) - 1, -1, -1):
        message = context[index]
        positions = where.get(_mark(message)) if not message.is_summary else None
        if positions:
            at = bisect.bisect_left(positions, before) - 1
            if at >= 0:
                found[index] = before = positions[at]
    return found


def _mark(message: Message) -> str:
    key = message_key(message)
    return f"k:{key}" if key is not None else f"h:{content_hash(message)}"


async def follow(compactor: Compactor, thread: str, plan: Plan) -> None:
    """Load ``thread``'s working context, ``plan`` the edit of it, and write that; again after a conflict.

    Holds the thread's ``sync`` lock throughout: call it without holding it.
    """
    async with holding(_seen(compactor, thread).lock):
        await compactor._ready_counter()  # it counts the edited messages: no tokenizer load on the loop
        try:
            for attempt in range(_ATTEMPTS):
                window = await compactor.short_term.load(thread)
                edit = await plan(window.messages)
                if edit is None:
                    return
                try:
                    await _write(compactor, thread, window, edit)
                    return
                except ConflictError:  # a fold came between: plan the edit of the context it left
                    if attempt == _ATTEMPTS - 1:
                        raise
        finally:
            compactor._forget_seen(thread)


async def _write(compactor: Compactor, thread: str, window: ContextWindow, edit: Edit) -> None:
    """Write ``edit`` of the context ``window`` holds: one transaction on one ``Store``."""
    rows = edit.context if window.messages else None  # an empty context has nothing to replace
    if rows is None:
        await _record(compactor, thread, edit.episodes)
        return
    replacement = [row.message for row in rows]
    uncounted = [row.message for row in rows if row.tokens is None]
    counts = iter(await off_loop_if_heavy(uncounted, compactor._counts, uncounted))
    tokens = [next(counts) if row.tokens is None else row.tokens for row in rows]
    through_seq, version = window.messages[-1].seq, window.version
    store = compactor._store
    if store is not None:
        await store.record_and_replace(
            thread,
            edit.episodes,
            through_seq=through_seq,
            expected_version=version,
            replacement=replacement,
            tokens=tokens,
            message_episodes=[row.recorded for row in rows],
            stands_for=[row.stands_for for row in rows],
        )
        return
    await compactor.short_term.replace_prefix(
        thread, through_seq=through_seq, expected_version=version, replacement=replacement, tokens=tokens
    )
    await _record(compactor, thread, edit.episodes)


async def _record(compactor: Compactor, thread: str, episodes: Sequence[Episode]) -> None:
    """Record ``episodes``: one transaction on a ``Store``, else one write each."""
    if not episodes:
        return
    log = compactor.episodic
    if implements(log, Store):
        await cast(Store, log).record_and_append(thread, episodes, [], [])
    else:
        for episode in episodes:
            await log.record(thread, episode)
