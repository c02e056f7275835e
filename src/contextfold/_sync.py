"""Syncing a framework's message list with a thread: record what is new, fold, hand back the context.

A framework (LangChain, pydantic-ai, the Agents SDK) keeps its own list of a
conversation's messages and passes it whole before each model call. :func:`sync`
records exactly the messages of that list that the thread does not hold yet,
runs the compaction check, and returns the working context when it differs
from the list the framework holds, so the adapter can send (or store) it instead.

A message is known by a key:

* a stable id, passed in ``ids`` or found under ``contextfold.key`` in its
  metadata (every message ``sync`` records carries its key there, so the context
  it hands back is known again when the framework returns it);
* otherwise its content. Messages known only by content are matched against the
  end of the recorded conversation after the newest message the list shares by
  id: the longest run of the list that repeats the recorded end is old, what
  follows it is new. So a repeated "continue" is recorded again, while a list
  that carries the whole history again is not. An id the log never saw counts
  for nothing here: LangGraph gives every message sent without an id a random
  one on each run, so a chat an application sends again whole comes back under
  new ids, and is matched by its content.

A framework's id is not always unique: some providers number tool calls per
reply (``call_0`` again in the next turn), and pydantic-ai's test model names
every call after its tool. So the list is first laid against the end of the
log, each message by its id or else its content: when the longest run of the
list that repeats the log's end is followed by a message whose id the log
already holds, that message reuses the id and is new, as is all that follows
the run (a list only ever adds at its end).

What was recorded is read from the episodic log (once per thread and process,
then only the episodes added since), so a restarted process resumes a thread
without recording anything twice. A summary coming back from the framework
(marked as one, keyed by ``sync``, or opening with the summary prefix) is never
recorded as a conversation message.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from typing import Any, Protocol, TypeVar

import anyio

from ._compactor import SUMMARY_PREFIX, Compactor
from ._episodes import (
    EpisodeRecord,
    HistoryClearedEpisode,
    LlmCallEpisode,
    MessagesRetractedEpisode,
    SystemMessageEpisode,
    ToolResultEpisode,
    UserMessageEpisode,
)
from ._errors import ConfigError
from ._messages import SUMMARY_METADATA_KEY, Message
from ._threads import holding
from .stores._rows import not_a_sequence

__all__ = ["KEY_METADATA_KEY", "SUMMARY_KEY_PREFIX", "append", "content_hash", "message_key", "sync"]

KEY_METADATA_KEY = "contextfold.key"
"""Metadata key under which a synced message keeps the key it is known by."""

_T = TypeVar("_T")
_INLINE_ITEMS = 100  # hashing this many messages takes about a millisecond of the event loop

SUMMARY_KEY_PREFIX = "contextfold.summary:"
"""Prefix of the key ``sync`` gives a summary it hands back; such a message is never recorded."""

_ID_TYPES = (str, type(None))
"""What each of ``sync``'s ``ids`` may be: a framework's id, or ``None`` for a message without one."""
_NOT_A_LIST = str | Message
"""What ``messages`` may not be, although a str is a sequence: one message, or text."""


def content_hash(message: Message) -> str:
    """A digest of what a model sees of ``message`` (its metadata left out)."""
    body = {
        "role": message.role.value,
        "content": message.content,
        "calls": [[call.id, call.name, call.arguments] for call in message.tool_calls],
        "call_id": message.tool_call_id,
        "name": message.name,
    }
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def message_key(message: Message) -> str | None:
    """The key ``message`` carries in its metadata, if any."""
    key = message.metadata.get(KEY_METADATA_KEY)
    return key if isinstance(key, str) and key else None


def _is_summary(message: Message, key: str | None) -> bool:
    if message.is_summary or (key is not None and key.startswith(SUMMARY_KEY_PREFIX)):
        return True
    return message.text.startswith(SUMMARY_PREFIX)


@dataclass(slots=True)
class _Seen:
    """What one thread's log holds, as far as this process has read it."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by one ``sync`` or ``append`` of the thread at a time, from any event loop (see ``holding``)."""
    next_seq: int = 0
    keys: list[str] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    marks: list[str] = field(default_factory=list)
    """Each message as the log is laid against a list by: its framework id, else its content."""

    def add(self, message: Message) -> None:
        digest = content_hash(message)
        key = message_key(message) or f"c:{digest}"
        self.keys.append(key)
        self.hashes.append(digest)
        self.marks.append(f"h:{digest}" if _by_content(key) else key)

    def retract(self, count: int) -> None:
        keep = max(0, len(self.keys) - count)
        del self.keys[keep:], self.hashes[keep:], self.marks[keep:]


class _Reading(Protocol):
    """What ``_catch_up`` brings up to date: ``_Seen``, or an adapter's own reading of a thread's log."""

    next_seq: int

    @property
    def keys(self) -> Sequence[str | None]: ...

    def add(self, message: Message) -> None: ...

    def retract(self, count: int) -> None: ...


def _by_content(key: str) -> bool:
    """Whether a key is one ``sync`` made (``c:``, for a message that came without an id)."""
    return key.startswith("c:")


_SEEN: weakref.WeakKeyDictionary[Compactor, dict[str, _Seen]] = weakref.WeakKeyDictionary()


def _seen(compactor: Compactor, thread: str) -> _Seen:
    return _SEEN.setdefault(compactor, {}).setdefault(thread, _Seen())


async def _catch_up(compactor: Compactor, thread: str, seen: _Reading) -> None:
    """Read the episodes recorded since the last read (all of them on first sight of the thread)."""
    records = [record async for record in compactor.episodic.replay(thread, from_seq=seen.next_seq)]
    if records:
        seen.next_seq = records[-1].seq + 1
        await _off_loop(len(records), _apply, seen, records)


def _apply(seen: _Reading, records: Sequence[EpisodeRecord]) -> None:
    for record in records:
        episode = record.episode
        if isinstance(episode, UserMessageEpisode | SystemMessageEpisode | ToolResultEpisode):
            seen.add(episode.message)
        elif isinstance(episode, LlmCallEpisode):
            seen.add(episode.reply)
        elif isinstance(episode, MessagesRetractedEpisode):
            seen.retract(episode.count)
        elif isinstance(episode, HistoryClearedEpisode):
            seen.retract(len(seen.keys))


async def _off_loop(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, in a worker thread when ``size`` items make it more than a moment's work."""
    if size <= _INLINE_ITEMS:
        return fn(*args)
    return await anyio.to_thread.run_sync(partial(fn, *args))


def _overlap(head: list[str], tail: list[str]) -> int:
    """The length of the longest prefix of ``head`` that is a suffix of ``tail`` (KMP, linear)."""
    tail = tail[-len(head) :] if head else []
    joined: list[str | None] = [*head, None, *tail]
    border = [0] * len(joined)
    for i in range(1, len(joined)):
        k = border[i - 1]
        while k and joined[i] != joined[k]:
            k = border[k - 1]
        if joined[i] == joined[k]:
            k += 1
        border[i] = k
    return border[-1] if joined else 0


@dataclass(slots=True)
class _Reused:
    """A list that may reuse ids the log holds: what is new either way, until the context decides."""

    after: list[int]
    """The messages after the list's longest run that repeats the log's end: new if the ids are reused."""
    usual: list[int]
    """What is new if they are not (the messages known by id are old)."""
    run: Counter[str]
    """Each id that may be reused, and how often it occurs in that run (zero included)."""

    def new(self, context: Sequence[Message]) -> list[int]:
        """``after`` if the run holds every message of the context known by a reused id, else ``usual``.

        An id the run does not account for is on a message the context still
        holds, so the list carries that old message again (in another order, say).
        """
        held = Counter(key for key in map(message_key, context) if key is not None and key in self.run)
        return self.after if all(self.run[key] >= count for key, count in held.items()) else self.usual


def _new_messages(
    seen: _Seen, messages: Sequence[Message], keys: Sequence[str | None]
) -> list[int] | _Reused:
    """Indexes of the messages the log does not hold yet, in order; ``_Reused`` when the context decides."""
    listed = _Listed(seen, messages, keys)
    usual = listed.usual()
    return listed.reused(usual) or usual


class _Listed:
    """A framework's list, read against what the log holds; each message hashed once at most."""

    __slots__ = ("_digests", "keys", "messages", "position", "seen")

    def __init__(self, seen: _Seen, messages: Sequence[Message], keys: Sequence[str | None]) -> None:
        self.seen = seen
        self.messages = messages
        self.keys = keys
        self.position = {key: n for n, key in enumerate(seen.keys)}
        """Where in the log each key was last recorded: the keys the log knows."""
        self._digests: dict[int, str] = {}

    def digest(self, index: int) -> str:
        found = self._digests.get(index)
        if found is None:
            found = self._digests[index] = content_hash(self.messages[index])
        return found

    def usual(self) -> list[int]:
        """The new messages when every id is the message's own: a known id is an old message."""
        seen, keys, position = self.seen, self.keys, self.position
        anchor_index = -1  # in ``messages``: the newest message shared by key
        anchor_position = -1  # in the log
        for index, key in enumerate(keys):
            if key is not None and key in position:
                anchor_index, anchor_position = index, max(anchor_position, position[key])
        fresh: list[int] = []
        loose: list[int] = []
        hashed = set(seen.hashes)
        for index, (message, key) in enumerate(zip(self.messages, keys, strict=True)):
            if _is_summary(message, key) or (key is not None and key in position):
                continue
            if key is not None and _by_content(key):
                fresh.append(index)  # a key ``sync`` gave, to a message the log has withdrawn since
            elif index > anchor_index:
                loose.append(index)  # no id, or one the log never saw: matched by content
            elif self.digest(index) not in hashed:
                fresh.append(index)  # a message the log never saw, before the anchor
        digests = [self.digest(index) for index in loose]
        old = _overlap(digests, seen.hashes[anchor_position + 1 :])
        return sorted(fresh + loose[old:])

    def reused(self, usual: list[int]) -> _Reused | None:
        """Whether the list may reuse an id the log holds (see the module's docstring); ``None`` if not.

        The list's longest run that repeats the log's end is old. A message after
        it that the log knows by a framework's id may reuse that id, and then it
        and everything after the run is new. ``None`` (decided the usual way) when
        no message after the run has a known id, or one has a key ``sync`` itself
        gave: such a message is old, so the list is not the log's end plus new ones.
        """
        seen, keys, position = self.seen, self.keys, self.position
        order = [
            index for index in range(len(self.messages)) if not _is_summary(self.messages[index], keys[index])
        ]
        marks: list[str] = []
        for index in order:
            key = keys[index]
            at = position.get(key) if key is not None and _by_content(key) else None
            if at is not None:  # a message the context handed back: laid by what the log holds for it
                marks.append(seen.marks[at])
            elif key is not None and not _by_content(key):
                marks.append(key)
            else:
                marks.append(f"h:{self.digest(index)}")
        old = _overlap(marks, seen.marks)
        after = order[old:]
        follows = [key for key in (keys[index] for index in after) if key is not None and key in position]
        if not old or not follows or any(_by_content(key) for key in follows) or after == usual:
            return None
        in_run = Counter(keys[index] for index in order[:old])
        return _Reused(after, usual, Counter({key: in_run[key] for key in follows}))


async def sync(
    compactor: Compactor,
    thread: str,
    messages: Sequence[Message],
    *,
    ids: Sequence[str | None] | None = None,
    compact: bool = True,
    recorded: list[Message] | None = None,
) -> list[Message] | None:
    """Record the messages of ``messages`` not yet recorded, compact if due, return the changed context.

    ``messages`` is the framework's whole current list for ``thread``;
    ``ids[i]``, when given, is the framework's stable id of ``messages[i]``.
    Returns the working context when it differs from ``messages`` (after a
    fold, say), ``None`` when the framework's list already is the context.
    Every message returned carries its key under ``contextfold.key``; a
    summary's key starts with ``contextfold.summary:``. With ``compact=False``
    the messages are only recorded (at the end of a run, say). ``recorded``,
    when given, receives the messages this call recorded.
    """
    if compact is not True and compact is not False:
        raise ConfigError("compact", "must be True or False", value=compact)
    keys = _keys(messages, ids)
    seen = _seen(compactor, thread)
    async with holding(seen.lock):
        await _catch_up(compactor, thread, seen)
        found = await _off_loop(len(messages), _new_messages, seen, messages, keys)
        fresh = found.new(await compactor.context(thread)) if isinstance(found, _Reused) else found
        new = [_with_key(messages[index], keys[index]) for index in fresh]
        await _record(compactor, thread, seen, new, compact)
        context = [_keyed(message) for message in await compactor.context(thread)]
    if recorded is not None:
        recorded += new
    same = await _off_loop(len(messages), _same_content, context, messages)
    return None if same else context


async def append(
    compactor: Compactor, thread: str, messages: Sequence[Message], *, ids: Sequence[str | None]
) -> None:
    """Record every message of ``messages`` after what ``thread`` holds, then compact if due.

    What a session's ``add_items`` is: the messages are new by the caller's
    word, so none is matched against the log (two tasks adding the same text
    at once record it twice). Each is keyed as ``sync`` keys it, under the
    same per-thread lock, so a later ``sync`` knows them.
    """
    keys = _keys(messages, ids)
    seen = _seen(compactor, thread)
    async with holding(seen.lock):
        await _catch_up(compactor, thread, seen)
        new = [_with_key(message, key) for message, key in zip(messages, keys, strict=True)]
        await _record(compactor, thread, seen, new, compact=True)
        # No context is loaded after this check: what it saw must not stand in for the store's
        # state at the session's next read, which may come after other workers wrote.
        compactor._forget_seen(thread)


def _keys(messages: Sequence[Message], ids: Sequence[str | None] | None) -> list[str | None]:
    """Each message's key: the framework's id, else the key ``sync`` gave it earlier, else ``None``.

    The arguments are checked here, before anything is read or recorded: one
    ``isinstance`` of each message and each id, run in C, is all a good call pays.
    """
    if not_a_sequence(messages, _NOT_A_LIST):
        raise ConfigError(
            "messages",
            "must be a list of Message objects, the framework's whole list for the thread "
            "(a single message goes in a list too: [message])",
            value=messages,
        )
    _check_items(
        "messages", messages, Message, "Message objects", "convert it first, e.g. with Message.user(text)"
    )
    if ids is None:
        return [message_key(message) for message in messages]
    if not_a_sequence(ids):
        raise ConfigError(
            "ids",
            "must be a list holding one id (a str, or None) per message, or None; "
            "e.g. ids=[str(row_id) for row_id in row_ids]",
            value=ids,
        )
    _check_items(
        "ids",
        ids,
        _ID_TYPES,
        "str ids (or None for a message without one)",
        "pass str ids, e.g. ids=[str(row_id) for row_id in row_ids]",
    )
    if len(ids) != len(messages):
        raise ConfigError(
            "ids",
            f"must hold one id (or None) per message: got {len(ids)} ids for {len(messages)} messages",
        )
    return [given or message_key(message) for given, message in zip(ids, messages, strict=True)]


def _check_items(
    key: str, items: Sequence[object], kind: type | tuple[type, ...], what: str, fix: str
) -> None:
    """Refuse ``items`` unless each is a ``kind``, naming the first that is not (one pass in C if all are)."""
    if all(map(isinstance, items, repeat(kind))):
        return
    index, item = next((index, item) for index, item in enumerate(items) if not isinstance(item, kind))
    raise ConfigError(
        key,
        f"must hold {what} only, and {key}[{index}] is of type {type(item).__name__}; {fix}",
        value=item,
    )


def _with_key(message: Message, key: str | None) -> Message:
    """A copy of ``message`` to record, its key (a new one when it has none) in its metadata."""
    return message.model_copy(
        update={"metadata": {**message.metadata, KEY_METADATA_KEY: key or f"c:{uuid.uuid4().hex}"}}
    )


async def _record(compactor: Compactor, thread: str, seen: _Seen, new: list[Message], compact: bool) -> None:
    """Append ``new`` (with the thread's lock held), note them as seen, and compact if asked."""
    if new:
        await compactor.append(thread, new)
        await _catch_up(compactor, thread, seen)
    if compact:
        await compactor.maybe_compact(thread)


def alike(first: Message, second: Message) -> bool:
    """Whether a model sees the two messages alike (what ``content_hash`` digests), without hashing them."""
    return first is second or (
        first.role,
        first.content,
        first.tool_calls,
        first.tool_call_id,
        first.name,
    ) == (second.role, second.content, second.tool_calls, second.tool_call_id, second.name)


def _same_content(first: Sequence[Message], second: Sequence[Message]) -> bool:
    return len(first) == len(second) and all(alike(a, b) for a, b in zip(first, second, strict=True))


def _keyed(message: Message) -> Message:
    """``message`` with its key in metadata; a summary gets one derived from its text."""
    if message_key(message) is not None:
        return message
    if message.metadata.get(SUMMARY_METADATA_KEY):
        key = SUMMARY_KEY_PREFIX + content_hash(message)
        return message.model_copy(update={"metadata": {**message.metadata, KEY_METADATA_KEY: key}})
    return message
