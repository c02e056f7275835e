"""What every backend shares: input checks, row encoding, windows and pressure counters.

Backends store messages and episodes as the JSON their pydantic models dump,
and read them back through the same models, so a row that no longer parses is
reported as a :class:`StoreError` naming its thread and seq instead of leaking
a validation error. The pressure counters are plain arithmetic over episodes:
a backend keeps one :class:`PressureCounters` per thread, updated in the same
transaction as the episode it counts.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import UnionType
from typing import Any, NamedTuple, TypeVar, cast, get_args

from anyio import to_thread
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from .._episodes import (
    _EPISODE_OF_ROLE,
    _KIND_OF_ROLE,
    Episode,
    LlmCallEpisode,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    SystemMessageEpisode,
    ToolResultEpisode,
    Usage,
    UserMessageEpisode,
    episode_for,
)
from .._errors import ConfigError, ConflictError, InvalidMessageError, StoreError
from .._messages import Message, Role, ToolCall, _check_finite, check_arguments, check_role_fields
from .._policy import EpisodicCompactionPressure
from .._trusted import trusted
from ._base import StoredMessage, ThreadInfo

__all__ = [
    "INT64_MAX",
    "PREPARE_ON_LOOP_CHARS",
    "PREPARE_ON_LOOP_MESSAGES",
    "PressureCounters",
    "Recording",
    "Window",
    "begin_write",
    "by_activity",
    "check_after_seq",
    "check_checkpoint",
    "check_choice",
    "check_from_seq",
    "check_max_tokens",
    "check_message_episodes",
    "check_path",
    "check_replace",
    "check_seconds",
    "check_stands_for",
    "check_text",
    "check_thread",
    "check_total",
    "counted_write",
    "decode_episode",
    "decode_message",
    "edit_links",
    "encode_edit",
    "encode_episode",
    "encode_episodes",
    "encode_messages",
    "encode_recording",
    "encode_rows",
    "end_write",
    "fold_links",
    "heavy_batch",
    "missing_seq_conflict",
    "not_a_sequence",
    "off_loop_if_heavy",
    "record_messages",
    "stored_message",
    "summary_index",
    "trusted",
    "utc",
    "version_conflict",
    "whole_days",
    "writes_to",
]

_T = TypeVar("_T")
_Method = TypeVar("_Method", bound=Callable[..., Awaitable[Any]])

_EPISODE_ADAPTER: TypeAdapter[Episode] = TypeAdapter(Episode)
_EPISODE_TYPES: tuple[type, ...] = get_args(get_args(Episode)[0])


def not_a_sequence(value: object, excluded: type | UnionType = str) -> bool:
    """Whether ``value`` is not a sequence of items, or is an ``excluded`` one (a str, by default).

    A list, what every caller passes on every step, is answered without the
    abstract ``Sequence`` check.
    """
    return type(value) is not list and (isinstance(value, excluded) or not isinstance(value, Sequence))


INT64_MAX = 2**63 - 1
"""The largest whole number every backend stores (a signed 64-bit integer)."""

PREPARE_ON_LOOP_MESSAGES = 16
"""The most messages a call counts or encodes on the event loop; a larger batch goes to a worker thread."""

PREPARE_ON_LOOP_CHARS = 64 * 1024
"""The most characters of text a call counts or encodes on the event loop (about a millisecond of
tokenizing); a batch holding more, a single large tool result say, goes to a worker thread."""


def heavy_batch(messages: object) -> bool:
    """Whether counting or encoding ``messages`` could stall the event loop: too many, or too much text.

    The text is each message's content (the strings of its parts, for parts)
    and its tool calls' arguments. Anything but a sequence of messages is
    light here: the encoding that runs next reports what is wrong with it.
    """
    if type(messages) is not list and not isinstance(messages, Sequence):
        return False
    if len(messages) > PREPARE_ON_LOOP_MESSAGES:
        return True
    chars = 0
    for message in messages:
        if not isinstance(message, Message):
            continue
        content = message.content
        if type(content) is str:
            chars += len(content)
        elif type(content) is list:
            chars += _parts_chars(content)
        for call in message.tool_calls:
            arguments = call.arguments
            chars += len(arguments) if type(arguments) is str else 0
    return chars > PREPARE_ON_LOOP_CHARS


def _parts_chars(parts: list[Any]) -> int:
    """The characters of the strings in content parts, to one level of nesting (an image's URL)."""
    chars = 0
    for part in parts:
        if type(part) is not dict:
            continue
        for value in part.values():
            if type(value) is str:
                chars += len(value)
            elif type(value) is dict:
                chars += sum([len(inner) for inner in value.values() if type(inner) is str])
    return chars


async def off_loop_if_heavy(messages: object, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)``, in a worker thread when preparing ``messages`` could stall the loop (``heavy_batch``).

    ``fn`` must be pure preparation (checks, counts, encodes): whatever runs
    around it sees the store exactly as it would without the thread.
    """
    if heavy_batch(messages):
        return await to_thread.run_sync(fn, *args)
    return fn(*args)


def _whole_number(key: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, f"must be a whole number >= {minimum}", value=value)
    if value > INT64_MAX:
        raise ConfigError(
            key,
            f"must be at most 2**63 - 1 ({INT64_MAX}), the largest number every backend stores",
            value=value,
        )
    return value


MAX_THREAD_BYTES = 2_048
"""The longest thread id, in bytes of UTF-8, that every backend can hold.

PostgreSQL's B-tree indexes take an entry of at most 2,704 bytes (a third of
a page): an id that does not compress, 4,000 characters say, failed there at
its first write while memory and SQLite took it.
"""


def check_thread(thread: Any) -> str:
    """``thread`` itself, once known to be a non-empty string every backend can store."""
    if not isinstance(thread, str) or not thread:
        raise ConfigError("thread", "must be a non-empty string naming the conversation", value=thread)
    if "\x00" in thread:
        # PostgreSQL text cannot hold NUL; refusing it everywhere keeps thread ids portable.
        raise ConfigError("thread", "cannot contain NUL characters; remove them", value=thread)
    ascii_only = thread.isascii()
    if not ascii_only:
        try:
            thread.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(
                "thread",
                f"must be encodable as UTF-8, but has a lone surrogate {thread[exc.start]!r} at index "
                f"{exc.start}; decode the id with errors='replace' or use another id",
                value=thread,
            ) from None
    if len(thread) > MAX_THREAD_BYTES // 4:  # a character is at most 4 bytes: shorter ids always fit
        size = len(thread) if ascii_only else len(thread.encode("utf-8"))
        if size > MAX_THREAD_BYTES:
            raise ConfigError(
                "thread",
                f"is {size:,} bytes of UTF-8, over the {MAX_THREAD_BYTES:,} every backend can index; "
                "use a digest of a longer id, e.g. hashlib.sha256(thread_id.encode()).hexdigest()",
                value=thread[:60] + "...",
            )
    return thread


_WRITE_SLOTS = 4_096
_begun = [0] * _WRITE_SLOTS
"""Writes begun in this process to the working context of the threads hashed to each slot."""
_ended = [0] * _WRITE_SLOTS
"""Of those, the writes that ended (committed, failed or were cancelled)."""


_forgets = [0] * _WRITE_SLOTS
"""``forget`` calls this process committed, to the threads hashed to each slot (see ``forgets_of``)."""


def forgot(thread: str) -> None:
    """Count a committed ``forget`` of ``thread``: a replay of it running in the process checks its log."""
    _forgets[hash(thread) % _WRITE_SLOTS] += 1


def forgets_of(thread: str) -> int:
    """How many forgets of ``thread``, or of a thread sharing its slot, this process committed.

    A replay that sees this move asks the store whether its thread was
    forgotten (a slot-mate's forget costs it that one read, never an episode).
    """
    return _forgets[hash(thread) % _WRITE_SLOTS]


async def until_forgotten(
    thread: str,
    start: int,
    batch: Callable[[int], Awaitable[tuple[int | None, Sequence[_T]]]],
    size: int,
    seq_of: Callable[[_T], int],
    tombstones: Callable[[], Awaitable[int | None]],
) -> AsyncGenerator[_T, None]:
    """A SQL store's replay: its batches from seq ``start`` on, ended by a ``forget`` of the thread.

    ``batch(start)`` reads up to ``size`` rows from seq ``start`` with the
    thread's tombstone count in the same read (``None`` when there are no
    rows); ``tombstones()`` reads that count alone. Seqs start over after a
    forget, so a replay that read on by seq would splice the new log onto the
    old one: a moved count ends it at the next batch, and a forget this
    process committed (``forgets_of``) at the next row.
    """
    forgotten: int | None = None  # the thread's tombstones when the replay began
    while True:
        forgets = forgets_of(thread)
        count, rows = await batch(start)
        if forgotten is None:
            forgotten = count
        elif count != forgotten:
            return  # forgotten since the last batch
        for row in rows:
            if forgets_of(thread) != forgets:  # a forget in this process since the batch was read
                forgets = forgets_of(thread)
                if await tombstones() != forgotten:
                    return
            yield row
        if len(rows) < size:
            return
        start = seq_of(rows[-1]) + 1


def begin_write(thread: str) -> int:
    """Count a write to ``thread``'s working context as begun; its slot, for ``end_write``."""
    slot = hash(thread) % _WRITE_SLOTS
    _begun[slot] += 1
    return slot


def end_write(slot: int) -> None:
    """Count the write ``begin_write`` began as ended, whatever became of it."""
    _ended[slot] += 1


def counted_write(method: _Method) -> _Method:
    """A store method that writes the working context of its ``thread``, counted by ``writes_to``."""

    @functools.wraps(method)
    async def write(self: object, *args: Any, **kwargs: Any) -> Any:
        thread = args[0] if args else kwargs.get("thread")
        if not isinstance(thread, str):  # the method refuses it, without a write
            return await method(self, *args, **kwargs)
        slot = begin_write(thread)
        try:
            return await method(self, *args, **kwargs)
        finally:
            end_write(slot)

    return cast(_Method, write)


def writes_to(thread: str) -> int | None:
    """How many writes to ``thread``'s working context this process began, with any store object.

    ``None`` while one of them has not ended: it may commit after a read made
    now, so no read stands for the thread until it ends. Threads that share a
    slot share the count: a count that moved may be another thread's write,
    never a write missed. A compactor trusts the stats it read only while
    this count stays where it was before the read (no other store object of
    the process, a second worker say, began a write since, and none was under
    way).
    """
    slot = hash(thread) % _WRITE_SLOTS
    begun = _begun[slot]
    return begun if begun == _ended[slot] else None


def check_max_tokens(max_tokens: Any) -> int | None:
    if max_tokens is None:
        return None
    return _whole_number("max_tokens", max_tokens, minimum=0)


def encode_messages(
    messages: Sequence[Message], tokens: Sequence[int], *, field: str = "messages"
) -> list[tuple[str, int]]:
    """Each message's JSON with its token count, checked to read back before anything is written."""
    return [(body, count) for body, count, _ in encode_rows(messages, tokens, field=field)]


def encode_rows(
    messages: Sequence[Message], tokens: Sequence[int], *, field: str = "messages"
) -> list[tuple[str, int, Message]]:
    """``encode_messages`` with the copy each JSON reads back as, for a backend that keeps objects."""
    if not_a_sequence(messages, Message | str):
        raise ConfigError(field, "must be a sequence of Message objects", value=messages)
    if not_a_sequence(tokens):
        raise ConfigError("tokens", f"must be a sequence of token counts, one per item of {field}")
    if len(tokens) != len(messages):
        raise ConfigError(
            "tokens",
            f"needs one count per message: got {len(tokens)} counts for {len(messages)} {field}",
        )
    return [
        _row(message, count, field, index)
        for index, (message, count) in enumerate(zip(messages, tokens, strict=True))
    ]


def _row(
    message: Message, count: int, field: str, index: int, *, encode: bool = True
) -> tuple[str, int, Message]:
    """One message's JSON, its count and the copy its JSON reads back as, each checked.

    With ``encode=False`` the JSON of a plain message is left out (``""``) once
    its text is known to encode (see ``_encodes``): for a store that keeps the
    copy itself.
    """
    if not isinstance(message, Message):
        raise InvalidMessageError(
            f"{field}[{index}]",
            f"must be a Message, got {type(message).__name__}; build one with Message.user(...)",
        )
    if type(count) is not int or not 0 <= count <= INT64_MAX:  # the key is built for the error only
        _whole_number(f"tokens[{index}]", count, minimum=0)
    # The common message is copied without parsing its JSON (its metadata checked meanwhile).
    copy = _plain_copy(message)
    if copy is not None:
        if not _encodes(copy):  # what the encode would refuse, or (a metadata key) write mangled
            raise InvalidMessageError(f"{field}[{index}]", _NOT_UTF8)
        if not encode:
            return "", count, copy
    try:
        if copy is None:
            body, copy = _encode_and_read_back(message, f"{field}[{index}]")
        else:
            # Every field was found of the exact type its serializer expects, so no warning can
            # arise for warnings="error" to raise (asking for it costs more than the encode).
            body = _MESSAGE_TO_JSON(message, warnings=False).decode()
    except PydanticSerializationError as exc:  # a lone surrogate, say
        raise InvalidMessageError(f"{field}[{index}]", _first_error(exc)) from None
    return body, count, copy


def _encode_and_read_back(message: Message, where: str) -> tuple[str, Message]:
    """A message ``_plain_copy`` cannot copy: its JSON and the message that JSON reads back as."""
    # Metadata edited in place after the message was built would be written as null.
    _check_finite(message.metadata, f"{where}.metadata")
    if _surrogate_key(message.metadata) or _surrogate_key(message.content):
        raise InvalidMessageError(where, _NOT_UTF8)
    if isinstance(message.content, list):
        _check_finite(message.content, f"{where}.content")
    try:
        body = message.model_dump_json(warnings="error")
        return body, Message.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidMessageError(where, _first_error(exc)) from None


_MESSAGE_TO_JSON = Message.__pydantic_serializer__.to_json
"""What ``Message.model_dump_json`` calls, without its keyword-argument relay (the same bytes)."""

_SCALARS = frozenset({str, int, float, bool, type(None)})
_OPTIONAL_TEXT = frozenset({str, type(None)})


def _plain_copy(message: Message) -> Message | None:
    """The message as its JSON reads back, built without parsing it; ``None`` unless that is certain.

    Certain for the common message: text or no content, metadata of plain
    scalars (finite numbers) under string keys, tool calls whose arguments are JSON, and fields
    that pass the message's own checks (a ``model_construct`` could have
    skipped them). All of it is immutable but the metadata, which is copied.
    Anything else is read back from its JSON, which also reports what does not.
    """
    if type(message) is not Message:
        return None
    fields = message.__dict__
    metadata = fields["metadata"]
    if (
        type(fields["role"]) is not Role
        or type(fields["content"]) not in _OPTIONAL_TEXT
        or type(fields["tool_call_id"]) not in _OPTIONAL_TEXT
        or type(fields["name"]) not in _OPTIONAL_TEXT
        or type(metadata) is not dict
    ):
        return None
    for key, value in metadata.items():
        kind = type(value)
        if type(key) is not str or kind not in _SCALARS or (kind is float and not math.isfinite(value)):
            return None
    calls = fields["tool_calls"]
    if calls:
        calls = _plain_calls(calls)
        if calls is None:
            return None
    try:
        check_role_fields(message)
    except InvalidMessageError:
        return None
    return trusted(
        Message,
        role=fields["role"],
        content=fields["content"],
        tool_calls=calls,
        tool_call_id=fields["tool_call_id"],
        name=fields["name"],
        metadata=dict(metadata),
    )


_NOT_UTF8 = (
    "holds text with a lone surrogate, which UTF-8 cannot encode (surrogates not allowed); "
    "decode the text with errors='replace' or drop the character"
)


def _surrogate_key(value: object) -> bool:
    """Whether a mapping at any depth of ``value`` has a key with a lone surrogate.

    Its JSON would not fail: the key would be written mangled. Values are left
    to the encode, which refuses them.
    """
    if isinstance(value, dict):
        return any(
            (type(key) is str and not key.isascii() and not _utf8(key)) or _surrogate_key(item)
            for key, item in value.items()
        )
    if isinstance(value, list | tuple):
        return any(_surrogate_key(item) for item in value)
    return False


def _encodes(copy: Message) -> bool:
    """Whether every text of a ``_plain_copy`` encodes as UTF-8 (no lone surrogate), as its JSON must.

    An ASCII string is known to at no cost; another is encoded once to see.
    """
    fields = copy.__dict__
    content = fields["content"]
    if content is not None and not content.isascii() and not _utf8(content):
        return False
    for text in (fields["tool_call_id"], fields["name"]):
        if text is not None and not text.isascii() and not _utf8(text):
            return False
    for call in fields["tool_calls"]:
        for text in (call.id, call.name, call.arguments):
            if not text.isascii() and not _utf8(text):
                return False
    for key, value in fields["metadata"].items():
        if not key.isascii() and not _utf8(key):
            return False
        if type(value) is str and not value.isascii() and not _utf8(value):
            return False
    return True


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _plain_calls(calls: object) -> tuple[ToolCall, ...] | None:
    """Copies of tool calls as their JSON reads back, or ``None`` unless each one certainly does."""
    if type(calls) is not tuple:
        return None
    copies = []
    for call in calls:
        if type(call) is not ToolCall:
            return None
        fields = call.__dict__
        id_, name, arguments = fields["id"], fields["name"], fields["arguments"]
        if not (type(id_) is str and id_ and type(name) is str and name and type(arguments) is str):
            return None
        try:
            check_arguments(arguments)
        except ValueError:
            return None
        copies.append(trusted(ToolCall, id=id_, name=name, arguments=arguments))
    return tuple(copies)


def check_from_seq(from_seq: Any) -> int:
    return _whole_number("from_seq", from_seq, minimum=0)


def check_after_seq(after_seq: Any) -> int:
    return _whole_number("after_seq", after_seq, minimum=0)


FIRST_SEQ = -INT64_MAX
"""Below every seq a context can hold: a ``tail`` from ``after_seq=0`` reads from here.

A replacement longer than the rows it replaces takes seqs down from
``through_seq``, below the first one appended (an edit that adds a message to a
thread never folded goes to 0 and below), so 0 is not the least seq.
"""


def tail_from(after_seq: int) -> int:
    """The lowest seq a ``tail`` excludes: ``after_seq``, or below every seq for the complete read (0)."""
    return after_seq if after_seq else FIRST_SEQ - 1


def check_total(thread: str, total: int) -> int:
    """``total`` (a thread's token total after a write), once known to fit every backend."""
    if total > INT64_MAX:
        raise ConfigError(
            "tokens",
            f"would bring thread {thread!r} to {total} tokens, over 2**63 - 1; pass real token counts",
            value=total,
        )
    return total


def check_seconds(key: str, value: Any, *, example: float, maximum: float) -> float:
    """A store option in seconds: a finite number above 0 and at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, f"must be a number of seconds, e.g. {example}", value=value)
    if not math.isfinite(value) or not 0 < value <= maximum:
        raise ConfigError(
            key,
            f"must be a finite number of seconds above 0 and at most {maximum:g}, e.g. {example}",
            value=value,
        )
    return float(value)


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        shown = " or ".join(repr(choice) for choice in choices)
        raise ConfigError(key, f"must be {shown}", value=value)
    return value


def check_path(key: str, value: Any) -> str:
    """A file path option as text, refused before anything touches the file system."""
    if isinstance(value, bool) or not isinstance(value, str | os.PathLike):
        raise ConfigError(key, "must be a file path (str or pathlib.Path), e.g. 'agent.db'", value=value)
    path = os.fspath(value)
    if not isinstance(path, str):
        raise ConfigError(key, "must be a text path, not bytes; decode it with os.fsdecode()", value=value)
    return check_text(key, path, example="agent.db")


def check_text(key: str, value: Any, *, example: str) -> str:
    """A string option (a URL, a schema, a path) with no NUL character, which no database or OS accepts."""
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a non-empty string, e.g. {example!r}", value=value)
    if "\x00" in value:
        raise ConfigError(key, "cannot contain NUL characters; remove them", value=value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(key, "must be encodable as UTF-8 (it has a lone surrogate)", value=value) from None
    return value


def check_replace(through_seq: Any, expected_version: Any) -> None:
    # Any seq the thread holds, 0 and below included (see FIRST_SEQ): a missing one is a ConflictError.
    _whole_number("through_seq", through_seq, minimum=FIRST_SEQ)
    _whole_number("expected_version", expected_version, minimum=0)


def version_conflict(thread: str, version: int, expected_version: int) -> ConflictError:
    return ConflictError(
        f"thread {thread!r} is at version {version}, not {expected_version}: another "
        "compaction replaced its prefix since it was loaded; load it again and retry"
    )


def missing_seq_conflict(thread: str, through_seq: int) -> ConflictError:
    return ConflictError(
        f"thread {thread!r} holds no message with seq {through_seq}; load it again and "
        "cut at a seq the window returned"
    )


def encode_episode(episode: Episode) -> str:
    """The episode's JSON, checked to read back as the same kind of episode."""
    if not isinstance(episode, _EPISODE_TYPES):
        names = ", ".join(kind.__name__ for kind in _EPISODE_TYPES)
        raise InvalidMessageError("episode", f"must be one of {names}, got {type(episode).__name__}")
    try:
        body = episode.model_dump_json(warnings="error")
        _EPISODE_ADAPTER.validate_json(body)
    except (ValidationError, PydanticSerializationError) as exc:
        raise InvalidMessageError("episode", _first_error(exc)) from None
    return body


def encode_episodes(episodes: Sequence[Episode]) -> list[str]:
    """Each episode's JSON, all checked before anything is written."""
    if not_a_sequence(episodes):
        raise ConfigError("episodes", "must be a sequence of episodes", value=episodes)
    bodies: list[str] = []
    for index, episode in enumerate(episodes):
        try:
            bodies.append(encode_episode(episode))
        except InvalidMessageError as exc:
            raise InvalidMessageError(f"episodes[{index}]", exc.reason) from None
    return bodies


_MESSAGE_FIELD: dict[type, str] = {
    UserMessageEpisode: "message",
    SystemMessageEpisode: "message",
    ToolResultEpisode: "message",
    LlmCallEpisode: "reply",
}
"""The field holding the message, for each kind of episode that records one."""


def message_field(episode: Episode) -> str | None:
    """The name of the field that holds ``episode``'s message, ``None`` for other kinds."""
    return _MESSAGE_FIELD.get(type(episode))


_MESSAGE_ONLY: dict[type, str] = {kind: _KIND_OF_ROLE[role] for role, kind in _EPISODE_OF_ROLE.items()}
"""The kind of each episode type that holds nothing but its kind and its message."""


def _spliced(episode: Episode, field: str, message_body: str) -> str:
    """The episode's JSON with its message written as ``message_body`` (already encoded and checked)."""
    kind = _MESSAGE_ONLY.get(type(episode))
    if kind is not None and episode.kind == kind:
        return f'{{"kind":"{kind}","message":{message_body}}}'
    rest = episode.model_dump_json(exclude={field}, warnings="error")
    return f'{rest[:-1]},"{field}":{message_body}}}'


class Recording(NamedTuple):
    """A step to record, checked and encoded once: what a store writes for ``record_and_append``.

    Only :func:`encode_recording` and :func:`record_messages` build one, so a
    store writes it as it is, without checking it again.
    """

    episodes: list[Episode]
    bodies: list[str]
    """Each episode's JSON; unless ``encoded`` is false: then the JSON before its message."""
    rows: list[tuple[str, int, Message]]
    """Each message's JSON, its tokens and the copy that JSON reads back as."""
    links: list[int | None]
    """For each row, the index of the episode that records it."""
    shared: list[bool]
    """For each row, whether its JSON is its episode's body but the last character (stored once)."""
    encoded: bool = True
    """False for ``record_messages(encode=False)``: rows hold no JSON, and episode ``i``'s JSON is
    ``bodies[i] + <row i's message as JSON> + "}"``, made when a ``MemoryStore`` is first asked for it."""


def encode_recording(
    episodes: Sequence[Episode],
    messages: Sequence[Message],
    tokens: Sequence[int],
    message_episodes: Sequence[int | None] | None,
    *,
    field: str = "messages",
    unlinked: bool = False,
) -> Recording:
    """A step's episode bodies, message rows and links, each message encoded and read back once.

    ``field`` names the messages in errors; with ``unlinked``, ``message_episodes``
    may hold ``None`` for a message no episode of the batch records.

    A message recorded by its own episode (what ``Compactor.append`` does for
    every message) is not encoded a second time for the episode: the row's
    JSON, already checked to read back, is written into the episode's. The
    episode's other fields were validated when it was built.
    """
    if not_a_sequence(episodes):
        raise ConfigError("episodes", "must be a sequence of episodes", value=episodes)
    rows = encode_rows(messages, tokens, field=field)
    links = check_message_episodes(message_episodes, len(rows), len(episodes), unlinked=unlinked)
    shared: dict[int, tuple[str, str]] = {}  # episode index: (its message's field, that message's JSON)
    for (body, _, _), message, link in zip(rows, messages, links, strict=True):
        if link is not None:
            holder = message_field(episodes[link])
            if holder is not None and getattr(episodes[link], holder) is message:
                shared[link] = (holder, body)
    bodies: list[str] = []
    for index, episode in enumerate(episodes):
        try:
            if index in shared:
                bodies.append(_spliced(episode, *shared[index]))
            else:
                bodies.append(encode_episode(episode))
        except PydanticSerializationError as exc:
            raise InvalidMessageError(f"episodes[{index}]", _first_error(exc)) from None
        except InvalidMessageError as exc:
            raise InvalidMessageError(f"episodes[{index}]", exc.reason) from None
    return Recording(list(episodes), bodies, rows, links, _shared(bodies, rows, links))


def _shared(
    bodies: Sequence[str], rows: Sequence[tuple[str, int, Message]], links: Sequence[int | None]
) -> list[bool]:
    """For each row, whether its JSON is its episode's body but the last character (so stored once)."""
    flags = []
    for (body, _, _), link in zip(rows, links, strict=True):
        episode = None if link is None else bodies[link]
        flags.append(episode is not None and len(episode) > len(body) and episode.endswith(body, 0, -1))
    return flags


def record_messages(
    messages: list[Message],
    tokens: list[int],
    *,
    model: str | None = None,
    usage: Usage | None = None,
    request_messages: int = 0,
    request_tokens: int = 0,
    encode: bool = True,
) -> Recording:
    """The step ``Compactor.append`` records: each message by an episode of its own, encoded once.

    What ``encode_recording`` makes of ``episode_for`` each message, with one
    check and one encode per message and nothing to look up between them.
    The LLM-call fields go to each assistant reply's episode.

    ``encode=False`` is for a store that keeps objects (``MemoryStore``): every
    message and field is checked as its JSON would be, but no message's JSON
    is made (see ``Recording.encoded``).
    """
    episodes: list[Episode] = []
    bodies: list[str] = []
    rows: list[tuple[str, int, Message]] = []
    reply_head: str | None = None
    for index, (message, count) in enumerate(zip(messages, tokens, strict=True)):
        row = _row(message, count, "messages", index, encode=encode)
        episode = episode_for(
            message,
            model=model,
            usage=usage,
            request_messages=request_messages,
            request_tokens=request_tokens,
        )
        kind = _MESSAGE_ONLY.get(type(episode))
        if kind is not None:
            head = f'{{"kind":"{kind}","message":'
        else:
            if reply_head is None:  # every reply of the step shares the call's fields
                reply_head = _reply_head(episode) + ',"reply":'
            head = reply_head
        bodies.append(f"{head}{row[0]}}}" if encode else head)
        episodes.append(episode)
        rows.append(row)
    n = len(rows)
    return Recording(episodes, bodies, rows, list(range(n)), [True] * n, encode)


_DEFAULT_REPLY_HEAD = '{"kind":"llm_call","request_messages":0,"request_tokens":0,"model":null,"usage":null'
"""An LLM call's JSON without its reply and closing brace, when the call's fields are the defaults."""


def _reply_head(episode: Episode) -> str:
    """The LLM call's JSON up to where its reply goes (what ``_spliced`` writes around it)."""
    assert isinstance(episode, LlmCallEpisode)
    if (
        episode.model is None
        and episode.usage is None
        and episode.request_messages == 0
        and episode.request_tokens == 0
    ):
        return _DEFAULT_REPLY_HEAD
    try:
        return episode.model_dump_json(exclude={"reply"}, warnings="error")[:-1]
    except PydanticSerializationError as exc:
        raise InvalidMessageError("model", _first_error(exc)) from None


def check_message_episodes(
    message_episodes: Sequence[int | None] | None, messages: int, episodes: int, *, unlinked: bool = False
) -> list[int | None]:
    """For each message, the index of the episode that records it (``None`` when not given).

    With ``unlinked``, an item may be ``None`` too: a message no episode of the batch records.
    """
    if message_episodes is None:
        return [None] * messages
    _check_per_message("message_episodes", message_episodes, messages, "episode index", "episode indexes")
    for index, value in enumerate(message_episodes):
        if value is None and unlinked:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < episodes:
            raise ConfigError(
                f"message_episodes[{index}]",
                f"must index the episodes passed with it (0 to {episodes - 1})"
                + (", or be None" if unlinked else ""),
                value=value,
            )
    return list(message_episodes)


def _check_per_message(key: str, values: Sequence[object], messages: int, one: str, many: str) -> None:
    """That ``values`` is a sequence of one item (``one``, ``many`` of them) per message."""
    if not_a_sequence(values):
        raise ConfigError(key, f"must be a sequence of {many}, one per message", value=values)
    if len(values) != messages:
        raise ConfigError(key, f"needs one {one} per message: got {len(values)} for {messages} messages")


def check_checkpoint(checkpoint: Any) -> str:
    """The fold's checkpoint as JSON, once known to be a ``SummaryCheckpoint``."""
    if not isinstance(checkpoint, SummaryCheckpoint):
        raise InvalidMessageError(
            "checkpoint", f"must be a SummaryCheckpoint, got {type(checkpoint).__name__}"
        )
    try:
        return encode_episode(checkpoint)
    except InvalidMessageError as exc:
        raise InvalidMessageError("checkpoint", exc.reason) from None


def summary_index(replacement: Sequence[Message], checkpoint: SummaryCheckpoint) -> int | None:
    """Index of the replacement message a fold links to its checkpoint, if any.

    The first summary message, when the checkpoint carries a summary; a fold
    that only drops or masks writes no summary, so a summary in its
    replacement is the previous one, carried over with its own link.
    """
    if not checkpoint.summary:
        return None
    for index, message in enumerate(replacement):
        if message.is_summary:
            return index
    return None


def fold_links(
    checkpoint: SummaryCheckpoint,
    checkpoint_seq: int,
    *,
    size: int,
    summary_at: int | None,
    count: int,
    first: Sequence[tuple[int, int | None]],
    last: Sequence[tuple[int, int | None]],
) -> list[int | None]:
    """The ``episode_seq`` of each of a fold's ``size`` replacement rows (see ``Store.fold``).

    ``count`` rows are replaced; ``first`` and ``last`` are the ``(seq,
    episode_seq)`` of the oldest and of the newest of them, oldest first, at
    least ``min(size, count)`` each. The replacement opens with the rows
    before ``checkpoint.from_seq`` (the head the fold keeps), one for one; the
    rest stand for the newest replaced rows, one for one, so a row rewritten
    in place keeps its original's link. The message at ``summary_at`` (see
    ``summary_index``) links to the checkpoint instead.
    """
    head = 0  # replaced rows before the folded range, counted up to size
    while head < size and head < len(first) and first[head][0] < checkpoint.from_seq:
        head += 1
    offset = count - len(last)  # index among the replaced rows of last[0]
    links: list[int | None] = []
    for index in range(size):
        if index < head:
            links.append(first[index][1])
            continue
        row = count - size + index  # the replaced row this one stands for, counted from the end
        links.append(last[row - offset][1] if row >= max(head, offset) else None)
    if summary_at is not None:
        links[summary_at] = checkpoint_seq
    return links


def check_stands_for(stands_for: Sequence[int | None] | None, messages: int) -> list[int | None]:
    """For each replacement message, the seq of the replaced row it stands for (``None`` when not given)."""
    if stands_for is None:
        return [None] * messages
    _check_per_message("stands_for", stands_for, messages, "seq (or None)", "seqs (or None)")
    for index, value in enumerate(stands_for):
        if value is not None:
            # Any seq a context can hold: a replacement longer than what it replaced took 0 and below.
            _whole_number(f"stands_for[{index}]", value, minimum=FIRST_SEQ)
    return list(stands_for)


def encode_edit(
    episodes: Sequence[Episode],
    replacement: Sequence[Message],
    tokens: Sequence[int],
    message_episodes: Sequence[int | None] | None,
    stands_for: Sequence[int | None] | None,
) -> tuple[Recording, list[int | None]]:
    """``record_and_replace``'s input, checked and encoded: its recording, and what each row stands for."""
    recording = encode_recording(
        episodes, replacement, tokens, message_episodes, field="replacement", unlinked=True
    )
    return recording, check_stands_for(stands_for, len(replacement))


def edit_links(
    recorded: Sequence[int | None],
    episode_seqs: Sequence[int],
    stands_for: Sequence[int | None],
    replaced: Mapping[int, int | None],
) -> list[int | None]:
    """The ``episode_seq`` of each replacement row of ``Store.record_and_replace`` (see there).

    ``recorded[i]`` is the index of the episode that records row ``i``, whose
    seq is in ``episode_seqs``; else the row keeps the link of the replaced row
    whose seq is ``stands_for[i]``, found in ``replaced`` (seq: episode seq).
    """
    links: list[int | None] = []
    for episode, seq in zip(recorded, stands_for, strict=True):
        if episode is not None:
            links.append(episode_seqs[episode])
        else:
            links.append(None if seq is None else replaced.get(seq))
    return links


def decode_message(thread: str, seq: int, body: str | bytes) -> Message:
    try:
        return Message.model_validate_json(body)
    except ValidationError as exc:
        raise StoreError(
            f"thread {thread!r}: short-term message seq {seq} is corrupt and cannot be read "
            f"({_first_error(exc)}); restore the row from a backup or compact past it"
        ) from exc


def decode_episode(thread: str, seq: int, body: str | bytes) -> Episode:
    try:
        return _EPISODE_ADAPTER.validate_json(body)
    except ValidationError as exc:
        raise StoreError(
            f"thread {thread!r}: episode seq {seq} is corrupt and cannot be read ({_first_error(exc)}); "
            "the log is append-only, so restore the database from a backup"
        ) from exc


def _first_error(exc: ValidationError | PydanticSerializationError) -> str:
    if isinstance(exc, PydanticSerializationError):
        return str(exc)
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    return f"{loc}: {first['msg']}" if loc else first["msg"]


def utc(value: datetime | None, key: str) -> datetime:
    """``value`` (now when ``None``) as an aware UTC datetime; a naive one is rejected."""
    if value is None:
        return datetime.now(UTC)
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise ConfigError(
            key, "must be a timezone-aware datetime, for example datetime.now(UTC)", value=value
        )
    return value.astimezone(UTC)


def whole_days(first: datetime | None, now: datetime) -> int:
    """Whole days from ``first`` to ``now`` (0 without a first episode or when ``now`` is earlier)."""
    if first is None:
        return 0
    return max(0, math.floor((now - first).total_seconds() / 86_400))


class PressureCounters(NamedTuple):
    """A thread's episodic counters, maintained per episode so ``pressure`` never scans the log.

    A named tuple: a new one is made for every recorded episode.
    """

    last_seq: int = 0
    total_user_messages: int = 0
    user_messages_since_boundary: int = 0
    run_completed_since_boundary: int = 0
    user_messages_after_latest_run_completed: int = 0
    boundary_seq: int | None = None
    """Seq of the newest summary checkpoint or manual-recovery boundary."""
    first_at: datetime | None = None

    def after(self, episode: Episode, at: datetime) -> PressureCounters:
        """The counters once ``episode`` is recorded at ``at`` with seq ``last_seq + 1``."""
        seq = self.last_seq + 1
        total = self.total_user_messages
        since = self.user_messages_since_boundary
        runs = self.run_completed_since_boundary
        after = self.user_messages_after_latest_run_completed
        boundary = self.boundary_seq
        if isinstance(episode, UserMessageEpisode):
            total, since, after = total + 1, since + 1, after + 1
        elif isinstance(episode, RunCompletedEpisode):
            if episode.clean:
                runs, after = runs + 1, 0
        elif isinstance(episode, SummaryCheckpoint | ManualRecoveryBoundary):
            since, runs, after, boundary = 0, 0, 0, seq
        return PressureCounters(seq, total, since, runs, after, boundary, self.first_at or at)

    def pressure(self, now: datetime, estimated_context_tokens: int | None) -> EpisodicCompactionPressure:
        return EpisodicCompactionPressure(
            estimated_context_tokens=estimated_context_tokens,
            user_messages_since_boundary=self.user_messages_since_boundary,
            run_completed_since_boundary=self.run_completed_since_boundary,
            user_messages_after_latest_run_completed=self.user_messages_after_latest_run_completed,
            conversation_age_days=whole_days(self.first_at, now),
            total_user_messages=self.total_user_messages,
        )


class Window:
    """Collects a thread's messages newest first until the token budget is spent.

    A backend feeds rows in batches and stops asking for more as soon as
    :meth:`offer` says the window is full, so a windowed load reads only the
    rows near the limit, however long the thread is.
    """

    def __init__(self, thread: str, max_tokens: int | None) -> None:
        self.thread = thread
        self._left = max_tokens
        self._rows: list[tuple[int, int, str | bytes, int | None]] = []
        self.full = False

    def offer(self, seq: int, tokens: int, body: str | bytes, episode_seq: int | None = None) -> bool:
        """Take one older row if it fits; ``False`` once the budget is spent (take no more)."""
        if self.full:
            return False
        if type(seq) is not int or type(tokens) is not int:
            # SQLite keeps whatever type was written to a column, so check before comparing.
            raise StoreError(
                f"thread {self.thread!r}: short-term message seq {seq!r} is corrupt (tokens {tokens!r} "
                "is not a whole number); restore the row from a backup or compact past it"
            )
        if self._left is not None:
            if tokens > self._left:
                self.full = True
                return False
            self._left -= tokens
        self._rows.append((seq, tokens, body, episode_seq))
        return True

    def messages(self) -> tuple[StoredMessage, ...]:
        """The taken rows, oldest first, parsed."""
        return tuple(
            stored_message(self.thread, seq, tokens, body, episode_seq)
            for seq, tokens, body, episode_seq in reversed(self._rows)
        )


def stored_message(
    thread: str, seq: int, tokens: int, body: str | bytes, episode_seq: int | None = None
) -> StoredMessage:
    """A message row read back, its JSON parsed and its numbers checked."""
    whole = type(seq) is int and type(tokens) is int and (episode_seq is None or type(episode_seq) is int)
    if not whole:
        raise StoreError(
            f"thread {thread!r}: short-term message seq {seq!r} is corrupt (tokens {tokens!r}, episode seq "
            f"{episode_seq!r} are not whole numbers); restore the row from a backup or compact past it"
        )
    return StoredMessage(
        seq=seq, tokens=tokens, message=decode_message(thread, seq, body), episode_seq=episode_seq
    )


def by_activity(infos: list[ThreadInfo]) -> list[ThreadInfo]:
    """Threads by last activity, newest first; threads without a log last; ties by thread id."""
    return sorted(
        infos,
        key=lambda info: (
            info.last_activity is None,
            -info.last_activity.timestamp() if info.last_activity else 0.0,
            info.thread,
        ),
    )
