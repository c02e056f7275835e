"""The OpenAI Agents SDK: a ``Session`` over contextfold stores that compacts before every model call.

::

    session = CompactingSession("user-42", compactor)
    config = RunConfig(call_model_input_filter=session.model_input_filter)
    result = await Runner.run(agent, "hi", session=session, run_config=config)

The SDK reads a session once per ``Runner.run``; ``model_input_filter``
records the items each model call is about to send, compacts when due and
sends the working context instead, so a long run stays under budget too.
It does so only for the session's own list: the items ``get_items`` gave,
then what the run added. Any other input is sent as the SDK gave it and
nothing of it is recorded: a handoff's ``input_filter`` or
``nest_handoff_history`` rewrote it, a ``session_input_callback`` or
``SessionSettings(limit=...)`` trimmed it, or it is a sub-agent's
(``Agent.as_tool`` runs with its parent's ``RunConfig``). The SDK passes
``add_items`` what such a run adds, and the session folds there. A model
input that is the run's last one, or the session's items, item for item with
new items at its end (holding what ``add_items`` was given since) is the
run's own: such a call hashes and converts only its new items, and the rest
is compared for equality, off the event loop when long. The agent's
``instructions``, sent beside the input, count toward the budget as a
system prompt at the thread's head would.
``pop_item`` and ``clear_session`` are recorded in the log
(``MessagesRetractedEpisode``, ``HistoryClearedEpisode``), so replaying the
log with ``contextfold.conversation()`` gives back exactly the session.

Items are Responses-API items. A run of model output items (reasoning,
an assistant message, its ``function_call`` items) becomes one assistant
message, each ``*_call_output`` a tool result, and every item is kept
verbatim in metadata, so what the session hands back is what it was given.
Images and files in an input message or a tool's output (``input_image``,
``input_file``) stay content parts of the message: they are counted as the
provider counts an image, never cut as text, and shown to a summarizer as
placeholders.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from agents import TResponseInputItem
from agents.memory import SessionSettings
from agents.run_config import CallModelData, ModelInputData

from .._compactor import TRUNCATED_METADATA_KEY, Compactor
from .._episodes import Episode, HistoryClearedEpisode, MessagesRetractedEpisode, episode_for
from .._errors import ConfigError
from .._messages import Message, Role, ToolCall
from .._sync import _off_loop, append, content_hash, sync
from ..stores._base import StoredMessage
from ._edits import Edit, Row, follow, kept

__all__ = ["CompactingSession", "from_items", "to_items"]

_ITEMS_KEY = "openai_agents.items"
_INPUT_ROLES = {"user": Role.USER, "system": Role.SYSTEM, "developer": Role.SYSTEM}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})


def _kind(item: Mapping[str, Any]) -> str:
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"  # an easy input message: {"role": ..., "content": ...}
    return str(kind)


def _is_output(item: Mapping[str, Any]) -> bool:
    return _kind(item).endswith("_call_output")


def _is_model_output(item: Mapping[str, Any]) -> bool:
    """Items the model produced: reasoning, its messages, its tool calls (hosted ones too)."""
    kind = _kind(item)
    if kind == "message":
        return item.get("role") == "assistant"
    return kind == "reasoning" or (kind.endswith("_call") and not _is_output(item))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", part.get("refusal", "")))
            for part in content
            if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS
        )
    return ""


def _parts(content: list[Any]) -> list[dict[str, Any]]:
    """Responses-API content parts as contextfold's: text parts as ``text``, any other part as it is.

    contextfold reads ``input_image`` parts as images (counted by the image
    rule, shown to summarizers as placeholders) and never cuts a part that is
    not text; read as JSON text, a base64 image would count as tens of
    thousands of tokens and be cut to fit.
    """
    return [
        {"type": "text", "text": _text([part])} if part.get("type") in _TEXT_PARTS else dict(part)
        for part in content
        if isinstance(part, Mapping)
    ]


def _input_content(content: Any) -> str | list[dict[str, Any]]:
    """An input message's content: its parts when it holds more than text (an image, a file), else its text.

    Text alone stays one string, as it was always recorded, so the messages of
    a thread written before hash as they did.
    """
    if isinstance(content, list) and any(
        isinstance(part, Mapping) and part.get("type") not in _TEXT_PARTS for part in content
    ):
        return _parts(content)
    return _text(content)


def _response_parts(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """contextfold content parts back as Responses-API input parts (see ``_parts``)."""
    return [
        {"type": "input_text", "text": str(part.get("text", ""))} if part.get("type") == "text" else part
        for part in content
    ]


def _plain(item: Any) -> dict[str, Any]:
    data = item.model_dump(mode="json", exclude_none=True) if hasattr(item, "model_dump") else item
    copied: dict[str, Any] = json.loads(json.dumps(data, default=str))
    return copied


def _assistant(group: list[dict[str, Any]]) -> tuple[Message, str | None]:
    texts = [_text(item.get("content")) for item in group if _kind(item) == "message"]
    calls = [
        ToolCall(
            id=item["call_id"],
            name=str(item.get("name") or _kind(item)),
            arguments=item["arguments"]
            if isinstance(item.get("arguments"), str) and item["arguments"]
            else json.dumps(item.get("action", item.get("input", {}))),
        )
        for item in group
        if item.get("call_id") and not _is_output(item)
    ]
    text = "\n".join(t for t in texts if t) or (None if calls else "")
    message = Message(
        role=Role.ASSISTANT, content=text, tool_calls=tuple(calls), metadata={_ITEMS_KEY: group}
    )
    return message, ("openai_agents.calls:" + ",".join(c.id for c in calls)) if calls else None


def from_items(items: Sequence[Any]) -> tuple[list[Message], list[str | None]]:
    """Responses-API items as contextfold messages, and the id each is known by (``None``: by content)."""
    converted = _convert(items)
    return converted.messages, converted.ids


@dataclass(frozen=True, slots=True)
class _Converted:
    """Items as messages, the id each is known by, and where the last message's items start."""

    messages: list[Message]
    ids: list[str | None]
    last: int | None
    """The index of the last message's first item (0 when there is none): a group may go on from there.

    ``None`` when the last message is the session's own, standing for items of the input.
    """

    def extended(self, items: Sequence[Any]) -> _Converted | None:
        """The conversion of ``items``, which go on from the items converted: only the new ones read."""
        if self.last is None:
            return None
        more = _convert(items[self.last :])
        keep = len(self.messages) - 1 if self.messages else 0
        return _Converted(
            [*self.messages[:keep], *more.messages],
            [*self.ids[:keep], *more.ids],
            self.last + (more.last or 0),
        )


def _convert(items: Sequence[Any]) -> _Converted:
    messages: list[Message] = []
    ids: list[str | None] = []
    group: list[dict[str, Any]] = []
    first = 0  # of the group
    last = 0

    def flush() -> None:
        nonlocal last
        if group:
            message, key = _assistant(list(group))
            messages.append(message)
            ids.append(key)
            last = first
            group.clear()

    for index, raw in enumerate(items):
        item = _plain(raw)
        if _is_model_output(item):
            if not group:
                first = index
            group.append(item)
            continue
        flush()
        last = index
        metadata = {_ITEMS_KEY: [item]}
        if _is_output(item) and item.get("call_id"):
            output = item.get("output", "")
            content: str | list[dict[str, Any]]
            if isinstance(output, list) and output and all(isinstance(part, Mapping) for part in output):
                content = _parts(output)  # a ToolOutputImage's, say: [{"type": "input_image", ...}]
            else:
                content = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            messages.append(
                Message(role=Role.TOOL, content=content, tool_call_id=item["call_id"], metadata=metadata)
            )
            ids.append(f"openai_agents.output:{item['call_id']}")
        elif _kind(item) == "message" and item.get("role") in _INPUT_ROLES:
            role = _INPUT_ROLES[str(item["role"])]
            content = _input_content(item.get("content"))
            messages.append(Message(role=role, content=content, metadata=metadata))
            ids.append(None)
        else:
            # An item kind this module does not know: kept verbatim, read by the summarizer as text.
            messages.append(
                Message(role=Role.USER, content=json.dumps(item, ensure_ascii=False), metadata=metadata)
            )
            ids.append(None)
    flush()
    return _Converted(messages, ids, last)


def _fresh(message: Message) -> list[dict[str, Any]]:
    """Items for a message the SDK never gave us (a summary) or that contextfold changed."""
    if message.role is Role.TOOL:  # a cut output keeps its images (see ``Compactor._cap_tool_outputs``)
        content = message.content
        output = _response_parts(content) if isinstance(content, list) else message.text
        return [{"type": "function_call_output", "call_id": message.tool_call_id, "output": output}]
    if message.role is Role.ASSISTANT:
        items: list[dict[str, Any]] = [{"role": "assistant", "content": message.text}] if message.text else []
        items += [
            {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments}
            for call in message.tool_calls
        ]
        return items
    return [{"role": message.role.value, "content": message.text}]


def to_items(messages: Sequence[Message]) -> list[TResponseInputItem]:
    """contextfold messages as Responses-API items, the SDK's own items where they were kept."""
    out: list[dict[str, Any]] = []
    for message in messages:
        kept = message.metadata.get(_ITEMS_KEY)
        if not isinstance(kept, list) or message.metadata.get(TRUNCATED_METADATA_KEY):
            out += _fresh(message)
        else:
            out += [dict(item) for item in kept]
    return cast(list[TResponseInputItem], out)


class CompactingSession:
    """An Agents SDK ``Session`` whose history is a contextfold thread (named ``session_id``)."""

    session_settings: SessionSettings | None = None

    def __init__(self, session_id: str, compactor: Compactor) -> None:
        if not isinstance(session_id, str) or not session_id:
            raise ConfigError(
                "session_id", "must be a non-empty string (the thread's name)", value=session_id
            )
        if not isinstance(compactor, Compactor):
            raise ConfigError("compactor", "must be a contextfold.Compactor", value=compactor)
        self.session_id = session_id
        self.compactor = compactor
        self._filter_recorded: list[str] = []
        """Content hashes of what ``model_input_filter`` recorded, in order, until ``add_items`` comes."""
        self._start: list[Any] | None = None
        """The items ``get_items`` last gave whole, until a model input starts with them."""
        self._start_context: list[Message] = []
        """The working context those items are of: it stands for them in the input synced."""
        self._start_marks: list[str] | None = None
        """The marks of ``_start`` (see ``_marks``), once a model input had to be compared by them."""
        self._sent: list[Any] | None = None
        """The run's own list at its last model call: the next call's input starts with it."""
        self._sent_marks: list[str] | None = None
        """The marks of ``_sent``, when known."""
        self._held: Counter[str] = Counter()
        """Marks known to be among ``_sent``'s: at least those of every item a call of the run added."""
        self._converted: _Converted | None = None
        """``_sent`` as it was synced, so the next call converts only what it adds."""
        self._added: Counter[str] = Counter()
        """What ``add_items`` was given since the last model call or read: the next input holds it."""

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The working context as items: the newest ``limit`` of them when given (a negative one: all)."""
        context = await self.compactor.context(self.session_id)
        items = to_items(context)
        # A run's first model input starts with the items whole, less the calls no output answers (the
        # SDK sends none). Cut by a ``limit``, they are a trimmed list, left as the SDK sends it; the SDK
        # also reads the newest few to check its own writes in the middle of a run.
        if limit is None or limit < 0 or limit >= len(items):
            self._start, self._start_context, self._start_marks = list(_answered(items)), list(context), None
        self._added.clear()
        if limit is None or limit < 0:  # as the SDK's SQLiteSession, whose SQL LIMIT -1 means none
            return items
        return items[-limit:] if limit else []

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Record the items after the session's, then compact if due.

        Every item is recorded, as every session of the SDK does, but for those
        ``model_input_filter`` recorded first (the SDK saves a run's items after
        its model calls saw them): they are skipped, in order.
        """
        if self._start is not None or self._sent is not None:
            self._added.update(_marks(items))
        new, new_ids = from_items(items)
        keep = [n for n, message in enumerate(new) if not self._recorded_by_filter(message)]
        self._filter_recorded.clear()
        await append(self.compactor, self.session_id, [new[n] for n in keep], ids=[new_ids[n] for n in keep])

    def _recorded_by_filter(self, message: Message) -> bool:
        """Whether ``message`` is the oldest one the filter recorded that ``add_items`` has not seen."""
        if self._filter_recorded and self._filter_recorded[0] == content_hash(message):
            del self._filter_recorded[0]
            return True
        return False

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove the newest item; the log records the retraction. ``None`` only when the session is empty.

        A summary as the newest item (all that was before it folded away) is
        removed as well: the log records the session cleared and what stays
        recorded again, so a replay gives back exactly the session. Both
        memories take the removal in one write, holding the thread's lock,
        from the context as it is then (see ``_edits.follow``): an item added
        meanwhile stays, and a fold that comes between is popped from again.
        """
        popped: TResponseInputItem | None = None

        async def plan(window: Sequence[StoredMessage]) -> Edit | None:
            nonlocal popped
            popped = None
            if not window:
                return None
            last, stays = window[-1], window[:-1]
            items = to_items([last.message])
            rows = [kept(stored) for stored in stays]
            if last.message.is_summary:  # all before it folded away: the log starts over with what stays
                start: Episode = HistoryClearedEpisode()
                again = [stored.message for stored in stays]
                rows = [row._replace(recorded=1 + n) for n, row in enumerate(rows)]
            elif items:  # the newest message's items but its last stay, as a message of their own
                start, (again, _) = MessagesRetractedEpisode(count=1), from_items(items[:-1])
                rows += [Row(message, None, recorded=1 + n) for n, message in enumerate(again)]
            else:
                return None
            popped = items[-1]
            return Edit([start, *map(episode_for, again)], rows)

        await follow(self.compactor, self.session_id, plan)
        return popped

    async def clear_session(self) -> None:
        """Empty the session; the log keeps every item and records the clear, in the same write."""

        async def plan(window: Sequence[StoredMessage]) -> Edit:
            return Edit([HistoryClearedEpisode()], [])

        await follow(self.compactor, self.session_id, plan)

    async def model_input_filter(self, data: CallModelData[Any]) -> ModelInputData:
        """For ``RunConfig(call_model_input_filter=...)``: record the input, compact, send the context.

        Only for the session's own list (see the module's docstring): an input
        that does not start with it, and with what ``add_items`` was given
        since, is sent as it is and nothing of it is recorded. Laid against the
        log, such a list would be recorded again as new, and the context sent
        in its place would undo what rewrote or trimmed it.

        The run's own input is the last one, or the session's items, with new
        items at its end: found so, a call reads and converts only those.

        The agent's ``instructions`` go to the model beside the input, as its
        system prompt: they are counted toward the budget as the thread's
        pinned head would be (``Compactor.count_beside``), so the request sent,
        instructions and all, is what the trigger and the target measure.
        """
        given = list(data.model_data.input)
        converted: _Converted | None = None
        if self._start is not None or self._sent is not None:
            base = await self._goes_on(given)
            if base is None and not await self._is_own(given):
                return data.model_data
            if base is self._sent and self._converted is not None:
                converted = self._converted.extended(given)
            elif base is not None and base is self._start:
                converted = self._standing(given, base)
            self._start, self._start_context, self._sent = None, [], given
            self._added.clear()
        if converted is None:
            converted = await self._input(given)
        self._converted = converted
        instructions = data.model_data.instructions
        beside = [Message.system(instructions)] if instructions else []
        await self.compactor.count_beside(self.session_id, beside)
        recorded: list[Message] = []
        context = await sync(
            self.compactor, self.session_id, converted.messages, ids=converted.ids, recorded=recorded
        )
        self._filter_recorded += [content_hash(message) for message in recorded]
        if context is None:
            return data.model_data
        return ModelInputData(input=_answered(to_items(context)), instructions=data.model_data.instructions)

    async def _goes_on(self, given: list[Any]) -> list[Any] | None:
        """The list (``_sent`` or ``_start``) ``given`` is, item for item, with new items after it.

        Such an input is the run's own when the new items, with those the run
        added before, hold every item ``add_items`` was given since: only the
        new items are read. ``None`` when that does not settle it.
        """
        for base in (self._sent, self._start):
            if base is None or len(base) > len(given):
                continue
            if not await _off_loop(len(base), _copies, given[: len(base)], base):
                continue
            new = _marks(given[len(base) :])
            held = Counter(new)
            if base is self._sent:
                held.update({mark: self._held[mark] for mark in self._added})
            if self._added - held:
                continue
            known = self._sent_marks if base is self._sent else self._start_marks
            self._sent_marks = None if known is None else [*known, *new]
            if base is self._sent:
                self._held.update(new)
            else:
                self._held = Counter(new)
            return base
        return None

    async def _is_own(self, given: list[Any]) -> bool:
        """Whether a model input is the run's own list: it goes on from the last or the session's items.

        Compared item by item as the model sees them. It also holds every item ``add_items`` was
        given since (a streamed run saves its input after the first model call): a handoff filter
        that drops the newest of them rewrote it.
        """
        marks = await _off_loop(len(given), _marks, given)
        extends = False
        if self._sent is not None and len(self._sent) <= len(marks):
            if self._sent_marks is None:
                self._sent_marks = await _off_loop(len(self._sent), _marks, self._sent)
            extends = _extends(marks, self._sent_marks)
        if not extends and self._start is not None and len(self._start) <= len(marks):
            if self._start_marks is None:
                self._start_marks = await _off_loop(len(self._start), _marks, self._start)
            extends = _extends(marks, self._start_marks)
        if not extends or self._added - Counter(marks):
            return False
        self._sent_marks, self._held = marks, Counter(marks)
        return True

    def _standing(self, given: list[Any], start: list[Any]) -> _Converted | None:
        """The input as the session's messages, for the items ``get_items`` gave, then the new items.

        The session's own messages stand for its items: the input holds them less the calls no
        output answers, so read item by item it is not the log's end. ``None`` when the new items
        open with model output, which would go on from the last of those messages.
        """
        new_items = given[len(start) :]
        if not new_items or _is_model_output(_plain(new_items[0])):
            return None
        new = _convert(new_items)
        context = self._start_context
        return _Converted(
            [*context, *new.messages], [*(None for _ in context), *new.ids], len(start) + (new.last or 0)
        )

    async def _input(self, given: list[TResponseInputItem]) -> _Converted:
        """The model input as messages to sync, and their ids.

        The SDK builds the input from ``get_items`` without the calls no output
        answers (``pop_item`` can leave one). Then the input is not the log's
        end plus new items, and matching it by content would record the history
        again: when it starts with the session's items less those calls, the
        session's own messages stand for that part.
        """
        cache = self.compactor._cache.get(self.session_id)
        if cache is None or cache.open_calls:
            context = await self.compactor.context(self.session_id)
            items = to_items(context)
            held = _answered(items)
            if len(held) < len(items) and [_plain(item) for item in given[: len(held)]] == held:
                new = _convert(given[len(held) :])
                last = len(held) + (new.last or 0) if new.messages else None
                return _Converted([*context, *new.messages], [*(None for _ in context), *new.ids], last)
        return await _off_loop(len(given), _convert, given)


def _marks(items: Sequence[Any]) -> list[str]:
    """Each item as the model sees it (ids and metadata left out), to tell whether a list extends another."""
    plain = [_plain(item) for item in items]
    return [f"{_kind(item)}:{content_hash(from_items([item])[0][0])}" for item in plain]


def _copies(items: Sequence[Any], kept: Sequence[Any]) -> bool:
    """Whether ``items`` are equal to ``kept``, each a copy of its own.

    The SDK builds every model input afresh. An item that is one of ``kept``
    itself may have been changed in place since it was kept (by a handoff's
    ``input_filter``, say), so it proves nothing.
    """
    return len(items) == len(kept) and all(
        item is not held and item == held for item, held in zip(items, kept, strict=True)
    )


def _extends(marks: list[str], start: list[str] | None) -> bool:
    return start is not None and marks[: len(start)] == start


def _answered(items: list[TResponseInputItem]) -> list[TResponseInputItem]:
    """``items`` without the calls no output answers, nor the reasoning right before one.

    What the SDK does to the items it sends itself: the model is only ever
    sent calls with their outputs (a call left open by ``pop_item``, say, or
    by a run that stopped mid-tool, stays in the session). Outputs answer
    calls of their ``call_id`` in order, so a provider's reused ids pair up.
    """
    waiting: dict[str, list[int]] = {}
    for index, item in enumerate(cast(list[dict[str, Any]], items)):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            continue
        if _is_output(item):
            if waiting.get(call_id):
                waiting[call_id].pop(0)
        elif _is_model_output(item):
            waiting.setdefault(call_id, []).append(index)
    unanswered = {index for indexes in waiting.values() for index in indexes}
    if not unanswered:
        return items
    dropped = unanswered | {
        index - 1
        for index in unanswered
        if index and _kind(cast(dict[str, Any], items[index - 1])) == "reasoning"
    }
    return [item for index, item in enumerate(items) if index not in dropped]
