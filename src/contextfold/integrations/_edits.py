"""Following an edit an application made to a conversation a framework holds for it.

An adapter finds the edit its own way (LangChain by message id, pydantic-ai by
content); what follows is the same for both. The working context takes the
edit (``replace_prefix``), and the log, which keeps every original, records the
conversation withdrawn from the oldest edited message on
(``MessagesRetractedEpisode``, or ``HistoryClearedEpisode`` from the start) and
what stays of it recorded again, as edited, so a replay gives the edited
conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._compactor import Compactor
from .._episodes import Episode, HistoryClearedEpisode, MessagesRetractedEpisode, conversation, episode_for
from .._errors import ConflictError
from .._messages import Message
from ..stores._base import Store, StoredMessage

__all__ = ["Rebuild", "record_edit", "replace_context", "said"]

Rebuild = Callable[[Sequence[StoredMessage]], list[tuple[Message, int | None]]]
"""The edited context from the stored one: each message with its tokens, ``None`` to count them."""


async def said(compactor: Compactor, thread: str) -> list[Message]:
    """The conversation a replay of ``thread``'s log gives, retractions and clears applied."""
    return conversation([record async for record in compactor.episodic.replay(thread)])


async def replace_context(compactor: Compactor, thread: str, rebuild: Rebuild) -> None:
    """Replace ``thread``'s working context with ``rebuild`` of it, again if a fold comes between."""
    await compactor._ready_counter()  # it counts the edited messages: no tokenizer load on the loop
    for attempt in range(3):
        window = await compactor.short_term.load(thread)
        if not window.messages:
            break
        rebuilt = rebuild(window.messages)
        try:
            await compactor.short_term.replace_prefix(
                thread,
                through_seq=window.messages[-1].seq,
                expected_version=window.version,
                replacement=[message for message, _ in rebuilt],
                tokens=[compactor.counter.count(m) if n is None else n for m, n in rebuilt],
            )
            break
        except ConflictError:  # a fold came between: rebuild the context it left
            if attempt == 2:
                raise
    compactor._forget_seen(thread)


async def record_edit(
    compactor: Compactor, thread: str, *, said: int, first: int, again: Sequence[Message]
) -> None:
    """Record that the ``said``-message conversation is withdrawn from ``first`` on, then ``again``."""
    if first >= said:
        return
    episodes: list[Episode] = [
        HistoryClearedEpisode() if first == 0 else MessagesRetractedEpisode(count=said - first),
        *map(episode_for, again),
    ]
    log = compactor.episodic
    if isinstance(log, Store):
        await log.record_and_append(thread, episodes, [], [])
    else:
        for episode in episodes:
            await log.record(thread, episode)
