"""pydantic-ai: compaction as a capability, run before each model request.

::

    agent = Agent(model, tools=[...], capabilities=[CompactionCapability(compactor)])
    result = await agent.run("hi", message_history=history)

Before every model request (the ``before_model_request`` hook, where pydantic-ai
rewrites a request) the capability records the run's new messages in the
thread, compacts when due, and after a fold replaces both the request's and
the run's message history with the working context: the summary as a user
prompt, then the kept turns. The thread is the run's ``conversation_id``
unless ``thread=`` is given. The model's reply is recorded as soon as it
arrives (``after_model_request``), and what the run adds after its last
request (the output tool's return, say) as the run ends (``after_run``).
``run_stream`` keeps the request holding its output tool's return out of the
run's history (only its result's ``all_messages()`` holds it): the thread
gets it when that history is passed back.

The ``message_history`` an application passes is the conversation, and the
thread follows edits made to it: earlier messages left out, a message
rewritten in place, a run continued from an older history. Neither the
history ``result.all_messages()`` gave back after a fold (the summary, then the
kept turns) nor the application's own list of every original message is an
edit. A run given no history at all is given the thread's. pydantic-ai's
messages carry no ids (tool calls and results aside), so messages are matched
by what a model sees of them: the working context takes the edit, and the log,
which keeps every original, records the conversation withdrawn from the oldest
edited message on and what stays of it again, so a replay gives the edited
conversation.

The system prompt a run's messages open with is the one the thread stands
under, not a turn of it. A prompt that changed — a ``dynamic`` one pydantic-ai
renders anew on every run, an agent rebuilt with another — takes the old one's
place at the head of the working context and is recorded in the log where it
took effect; no turn is recorded or sent again. A run given no history gets the
thread's turns under its own prompt. ``instructions`` never enter the history:
sent beside it, they count toward the budget as a system prompt at the
thread's head would (``Compactor.count_beside``).

Each request part and each response becomes one contextfold message, with its
pydantic-ai form kept in metadata, so every part kind — thinking, files,
native tool calls, kinds newer than this module — comes back as it was.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_ai import AgentRunResult
from pydantic_ai import messages as pydantic_ai_messages
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    InstructionPart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
)
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.tools import RunContext

from .._compactor import _CACHED_THREADS, SUMMARY_PREFIX, TRUNCATED_METADATA_KEY, Compactor
from .._episodes import episode_for
from .._errors import ConfigError
from .._messages import SUMMARY_METADATA_KEY, TOOL_ERROR_METADATA_KEY, Message, Role, ToolCall
from .._sync import _catch_up, _off_loop, _overlap, _same_content, _with_key, content_hash, message_key
from .._threads import holding
from ..stores._base import StoredMessage
from ._edits import Edit, Row, follow, kept, said, withdrawal

__all__ = ["CompactionCapability", "from_pydantic_ai", "to_pydantic_ai"]

_KEY = "pydantic_ai"
# Response parts answered by a request part of the same tool_call_id (the others run at the provider).
_CALL_KINDS = frozenset({"tool-call", "tool-search-call", "capability-load-call"})
_RETURN_KINDS = frozenset({"tool-return", "tool-search-return", "capability-load-return", "retry-prompt"})
_CUT = re.compile(r"\n\[\.\.\. about \d+ tokens of tool output cut by contextfold \.\.\.\]\n")
"""The marker a tool result cut to fit the hard limit carries (``Compactor``'s truncation)."""
_ENDS = 256


def _dump(message: ModelMessage) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ModelMessagesTypeAdapter.dump_json([message]))[0]
    return data


def _load(data: list[dict[str, Any]]) -> list[ModelMessage]:
    return ModelMessagesTypeAdapter.validate_json(json.dumps(data))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _user_content(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [
        {"type": "text", "text": item}
        if isinstance(item, str)
        else {"type": str(item.get("kind", "part")), **item}
        for item in content
    ]


def _request_part(
    part: dict[str, Any], request: dict[str, Any], *, opens: bool = False
) -> tuple[Message, str | None]:
    """A request's part as a message; ``opens``: it is the request's first part (see ``to_pydantic_ai``)."""
    kind = part.get("part_kind")
    stored: dict[str, Any] = {"request": request, "part": part}
    if opens:
        stored["opens"] = True
    metadata: dict[str, Any] = {_KEY: stored}
    call_id = part.get("tool_call_id")
    if kind == "system-prompt":
        return Message(role=Role.SYSTEM, content=_text(part.get("content", "")), metadata=metadata), None
    if kind == "user-prompt":
        return Message(
            role=Role.USER, content=_user_content(part.get("content", "")), metadata=metadata
        ), None
    if kind == "compaction" and (part.get("metadata") or {}).get(SUMMARY_METADATA_KEY):
        metadata[SUMMARY_METADATA_KEY] = True
        return Message(role=Role.USER, content=_text(part.get("content") or ""), metadata=metadata), None
    if kind in _RETURN_KINDS and call_id and (kind != "retry-prompt" or part.get("tool_name")):
        if kind == "retry-prompt" or part.get("outcome", "success") != "success":
            metadata[TOOL_ERROR_METADATA_KEY] = True
        content = _rendered(part) or _text(part.get("content", ""))
        message = Message(role=Role.TOOL, content=content, tool_call_id=call_id, metadata=metadata)
        return message, f"pydantic_ai.result:{call_id}"
    # A retry without a tool, or a part kind this module does not know: the model reads it as user text.
    content = _rendered(part) or _text(part.get("content", part))
    return Message(role=Role.USER, content=content, metadata=metadata), None


@functools.cache
def _retry_parts(kind: str) -> TypeAdapter[Any] | None:
    """The type of a retry part of ``kind`` (``RetryFeedbackPart`` is newer than some releases)."""
    part = {"retry-prompt": "RetryPromptPart", "retry-feedback": "RetryFeedbackPart"}.get(kind)
    found = getattr(pydantic_ai_messages, part, None) if part is not None else None
    return TypeAdapter(found) if found is not None else None


def _rendered(part: dict[str, Any]) -> str | None:
    """The text pydantic-ai sends the model for a retry part, which wraps its ``content`` in instructions.

    Counted as that text, a retry costs what the request carries; ``None``
    for any other part, or one this release of pydantic-ai cannot read.
    """
    kind = part.get("part_kind")
    adapter = _retry_parts(kind) if isinstance(kind, str) else None
    if adapter is None:
        return None
    try:
        text = adapter.validate_python(part).model_response()
    except (ValidationError, TypeError, ValueError, AttributeError):
        return None
    return text if isinstance(text, str) else None


def _arguments(args: Any) -> str:
    """A call's arguments as JSON text; a model's text that is not JSON as a JSON string of it.

    pydantic-ai answers a call whose arguments do not parse with a retry: the
    reply is part of the conversation, and its part in metadata keeps the text
    as the model wrote it.
    """
    if not isinstance(args, str) or not args:
        return json.dumps(args or {})
    try:
        json.loads(args)
    except ValueError:
        return json.dumps(args)
    return args


def _response(data: dict[str, Any]) -> tuple[Message, str | None]:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for part in data.get("parts", []):
        kind = part.get("part_kind")
        if kind == "text":
            texts.append(part.get("content", ""))
        elif kind in _CALL_KINDS and part.get("tool_call_id"):
            calls.append(
                ToolCall(
                    id=part["tool_call_id"],
                    name=part.get("tool_name") or kind,
                    arguments=_arguments(part.get("args")),
                )
            )
    text = "\n".join(texts) or (None if calls else "")
    message = Message(
        role=Role.ASSISTANT, content=text, tool_calls=tuple(calls), metadata={_KEY: {"response": data}}
    )
    key = "pydantic_ai.calls:" + ",".join(call.id for call in calls) if calls else None
    return message, key


def from_pydantic_ai(messages: Sequence[ModelMessage]) -> tuple[list[Message], list[str | None]]:
    """pydantic-ai messages as contextfold messages (one per request part or response), and their ids.

    A tool call and a tool result are known by their ``tool_call_id``; other
    messages have no id (``None``) and are known by their content.
    """
    out: list[Message] = []
    ids: list[str | None] = []
    for message in messages:
        data = _dump(message)
        if isinstance(message, ModelResponse):
            converted, key = _response(data)
            out.append(converted)
            ids.append(key)
            continue
        request = {name: value for name, value in data.items() if name != "parts"}
        for n, part in enumerate(data.get("parts", [])):
            converted, key = _request_part(part, request, opens=n == 0)
            out.append(converted)
            ids.append(key)
    return out, ids


def _fresh_part(message: Message, tool_names: dict[str, str]) -> dict[str, Any]:
    """A request part for a message pydantic-ai never saw (a summary) or that contextfold changed."""
    if message.is_summary:
        # pydantic-ai's own form of a summary the application wrote: every provider sends it as one.
        return {"part_kind": "compaction", "content": message.text, "metadata": {SUMMARY_METADATA_KEY: True}}
    if message.role is Role.SYSTEM:
        return {"part_kind": "system-prompt", "content": message.text}
    if message.role is Role.TOOL:
        call_id = message.tool_call_id or ""
        return {
            "part_kind": "tool-return",
            "tool_name": tool_names.get(call_id, "tool"),
            "tool_call_id": call_id,
            "content": message.text,
        }
    return {"part_kind": "user-prompt", "content": message.content if message.content is not None else ""}


def _fresh_response(message: Message) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"part_kind": "text", "content": message.text}] if message.text else []
    parts += [
        {"part_kind": "tool-call", "tool_name": call.name, "args": call.arguments, "tool_call_id": call.id}
        for call in message.tool_calls
    ]
    return {"kind": "response", "parts": parts}


def to_pydantic_ai(messages: Sequence[Message]) -> list[ModelMessage]:
    """contextfold messages as pydantic-ai messages; consecutive parts of one request share one request.

    A part goes back into the request it came from: parts of two requests are
    two requests, as pydantic-ai recorded them (it merges them when it sends
    them), and parts contextfold wrote (a summary) are a request of their own.
    A request's first part opens a new one, so two requests alike in all but
    their parts (an application's own, with no timestamp or run) stay two.
    """
    tool_names = {call.id: call.name for message in messages for call in message.tool_calls}
    out: list[dict[str, Any]] = []
    origins: list[dict[str, Any] | None] = []
    for message in messages:
        stored = message.metadata.get(_KEY)
        stored = stored if isinstance(stored, dict) else {}
        if message.role is Role.ASSISTANT:
            out.append(stored.get("response") or _fresh_response(message))
            origins.append(None)
            continue
        part = stored.get("part")
        if not isinstance(part, dict) or message.metadata.get(TRUNCATED_METADATA_KEY):
            part = _fresh_part(message, tool_names)
        request = stored.get("request")
        request = request if isinstance(request, dict) else None
        opens = stored.get("opens") is True
        if out and out[-1].get("kind") == "request" and origins[-1] == request and not opens:
            out[-1]["parts"].append(part)
        else:
            out.append({**(request or {"kind": "request"}), "parts": [part]})
            origins.append(request)
    return _load(out)


def _the_runs_own(rewritten: list[ModelMessage], given: Sequence[ModelMessage]) -> list[ModelMessage]:
    """``rewritten`` with each request and response the run gave the capability as the run's own object.

    A message is kept as it was recorded: a response before pydantic-ai stamped
    it with the run's ``run_id``, ``conversation_id`` and ``model_id``, a
    request before pydantic-ai recorded on it what it sent. The run's own
    objects carry all that, and pydantic-ai finds where the run's new messages
    start by them, so ``new_messages()`` after a fold is as without one.
    """
    own: dict[str, ModelMessage] = {}
    for message in given:
        own.setdefault(_parts_of(message), message)
    return [own.get(_parts_of(message), message) for message in rewritten]


def _rewritten(context: Sequence[Message], given: Sequence[ModelMessage]) -> list[ModelMessage]:
    """A run's messages as ``context``, each the run gave the capability as its own object."""
    return _the_runs_own(to_pydantic_ai(context), given)


def _parts_of(message: ModelMessage) -> str:
    data = _dump(message)
    return json.dumps([data.get("kind"), data.get("parts")], sort_keys=True)


def _is_summary(message: Message) -> bool:
    return message.is_summary or message.text.startswith(SUMMARY_PREFIX)


def _opening(messages: Sequence[Message]) -> int:
    """How many system messages ``messages`` opens with: the system prompt the conversation stands under."""
    n = 0
    while n < len(messages) and messages[n].role is Role.SYSTEM:
        n += 1
    return n


def _is_prompt_record(message: Message) -> bool:
    stored = message.metadata.get(_KEY)
    return isinstance(stored, dict) and stored.get("system_prompt") is True


def _prompts(messages: Sequence[Message]) -> list[bool]:
    """Which of ``messages`` (a conversation) is a system prompt it stood under, not a turn of it.

    Those it opens with, and each one the capability recorded when a run's
    system prompt changed (see ``CompactionCapability._stand``).
    """
    out: list[bool] = []
    opening = True
    for message in messages:
        prompt = _is_prompt_record(message) or (opening and message.role is Role.SYSTEM)
        opening = opening and prompt
        out.append(prompt)
    return out


def _as_prompt_record(message: Message) -> Message:
    """``message`` (a part of a run's system prompt) as recorded: marked, and in a request of no run."""
    stored = message.metadata.get(_KEY)
    part = stored.get("part") if isinstance(stored, dict) else None
    record = {"request": {"kind": "request"}, "part": part, "system_prompt": True}
    return _with_key(message.model_copy(update={"metadata": {**message.metadata, _KEY: record}}), None)


def _compared(message: Message) -> bool:
    """Whether a change to ``message`` is an edit: not for a summary, nor a prompt pydantic-ai renders anew.

    pydantic-ai re-renders a ``dynamic`` system prompt in the history it is
    given on every run; that is not the application's edit. A statement of an
    ``on_change="append"`` one (it has a ``context_id``) stays as it was.
    """
    if _is_summary(message):
        return False
    stored = message.metadata.get(_KEY)
    part = stored.get("part") if isinstance(stored, dict) else None
    return not (
        isinstance(part, dict)
        and part.get("part_kind") == "system-prompt"
        and part.get("dynamic_ref")
        and not part.get("context_id")
    )


def _positions(said: Sequence[Message], held: Sequence[Message]) -> list[int | None]:
    """Where in ``said`` each message of ``held`` (a working context, in order) is, by key, from the end.

    A key may repeat (a model that gives every tool call the same id), so each
    message is the nearest one of its key before the next message's position.
    """
    keys = [message_key(message) for message in said]
    out: list[int | None] = []
    position = len(said)
    for message in reversed(held):
        key = message_key(message)
        n = position - 1
        while n >= 0 and (key is None or keys[n] != key):
            n -= 1
        out.append(n if n >= 0 else None)
        position = n if n >= 0 else position
    return out[::-1]


def _occurs(needle: list[str], haystack: list[str]) -> bool:
    """Whether ``needle`` is a run of ``haystack``; both hold digests of one length, so text search aligns."""
    return ",".join(needle) in ",".join(haystack)


@dataclass(frozen=True, slots=True)
class _Edit:
    """What the application's history changed of the log's conversation, by position in it."""

    instead: dict[int, list[Message]] = field(default_factory=dict)
    """Each message of the conversation the history rewrote (what it holds instead) or left out (``[]``)."""
    before: dict[int, list[Message]] = field(default_factory=dict)
    """Messages the history holds just before one of the conversation, that the conversation lacks."""

    @property
    def first(self) -> int:
        return min(self.instead.keys() | self.before.keys())

    def conversation(self, said: Sequence[Message]) -> list[tuple[Message, int | None]]:
        """The edited conversation, each message with its position in ``said`` (``None`` for an edit's)."""
        out: list[tuple[Message, int | None]] = []
        for n, message in enumerate(said):
            out += [(added, None) for added in self.before.get(n, ())]
            if n in self.instead:
                out += [(added, None) for added in self.instead[n]]
            else:
                out.append((message, n))
        return out


@dataclass(slots=True)
class _Log:
    """What a thread's log says, as far as the capability read it: each message's digest and key.

    ``_sync._catch_up`` brings it up to date, with ``lock`` held (``CompactionCapability._reading``).
    """

    next_seq: int = 0
    digests: list[str] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    compared: list[bool] = field(default_factory=list)
    ends: list[tuple[str, str] | None] = field(default_factory=list)
    """A tool result's first and last characters, to know the original of one contextfold cut."""
    prompts: dict[int, Message] = field(default_factory=dict)
    """Each system prompt the conversation stood under (see ``_prompts``), by position."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the log is read or brought up to date, from any event loop (see ``holding``)."""

    @classmethod
    def of(cls, said: Sequence[Message]) -> _Log:
        log = cls()
        for message in said:
            log.add(message)
        return log

    def add(self, message: Message) -> None:
        opening = len(self.prompts) == len(self.digests)
        if _is_prompt_record(message) or (opening and message.role is Role.SYSTEM):
            self.prompts[len(self.digests)] = message
        self.digests.append(content_hash(message))
        self.keys.append(message_key(message))
        self.compared.append(_compared(message) and len(self.digests) - 1 not in self.prompts)
        text = message.text if message.role is Role.TOOL else None
        self.ends.append((text[:_ENDS], text[-_ENDS:]) if text is not None else None)

    def retract(self, count: int) -> None:
        keep = max(0, len(self.keys) - count)
        del self.digests[keep:], self.keys[keep:], self.compared[keep:], self.ends[keep:]
        self.prompts = {n: prompt for n, prompt in self.prompts.items() if n < keep}

    def prompt(self) -> list[Message]:
        """The system prompt the conversation stands under now: the newest run of recorded ones."""
        positions = sorted(self.prompts)
        first = len(positions)
        while first and (first == len(positions) or positions[first - 1] == positions[first] - 1):
            first -= 1
        return [self.prompts[n] for n in positions[first:]]

    def placed(
        self, messages: Sequence[Message], ids: Sequence[str | None]
    ) -> tuple[list[Message], list[str | None]]:
        """``messages`` (a run's, without the system prompt they open with) as ``sync`` lays them on the log.

        The system prompts the log holds among the turns ``messages`` shares
        with its end are put back where the log holds them, each as recorded
        (by its key), so the shared turns are known as the log's, and what
        follows them is new.
        """
        if not self.prompts:
            return list(messages), list(ids)
        turns: list[str] = []
        prompts: list[tuple[int, Message]] = []  # each prompt, after how many turns
        for n, digest in enumerate(self.digests):
            if n in self.prompts:
                prompts.append((len(turns), self.prompts[n]))
            else:
                turns.append(digest)
        listed = [index for index, message in enumerate(messages) if not _is_summary(message)]
        shared = _overlap([self._digest(messages[index], ids[index]) for index in listed], turns)
        start = len(turns) - shared
        at: dict[int, list[Message]] = {}
        for after, prompt in prompts:
            if after >= start:
                index = (
                    listed[after - start]
                    if after - start < shared
                    else (listed[shared - 1] + 1 if shared else 0)
                )
                at.setdefault(index, []).append(prompt)
        out: list[Message] = []
        keys: list[str | None] = []
        for index in range(len(messages) + 1):
            out += at.get(index, ())
            keys += [None] * len(at.get(index, ()))
            if index < len(messages):
                out.append(messages[index])
                keys.append(ids[index])
        return out, keys

    def held(self, given: Sequence[Message], ids: Sequence[str | None]) -> tuple[list[int], list[str]]:
        """The messages of ``given`` an edit counts for, and their digests.

        A tool result contextfold cut to fit (``all_messages()`` holds it so)
        has its original's digest.
        """
        listed = _turns(given)
        return listed, [self._digest(given[index], ids[index]) for index in listed]

    def _digest(self, message: Message, id_: str | None) -> str:
        text = message.text
        if message.role is Role.TOOL and id_ is not None and (cut := _CUT.search(text)) is not None:
            head, tail = text[: cut.start()], text[cut.end() :]
            for n in range(len(self.keys) - 1, -1, -1):
                ends = self.ends[n]
                if self.keys[n] == id_ and ends is not None:
                    if ends[0].startswith(head[:_ENDS]) and ends[1].endswith(tail[-_ENDS:] if tail else ""):
                        return self.digests[n]
        return content_hash(message)


def _as_sent(message: Message) -> Message:
    """``message`` of a working context as the history ``to_pydantic_ai`` gives holds it."""
    stored = message.metadata.get(_KEY)
    stored = stored if isinstance(stored, dict) else {}
    response, part, request = stored.get("response"), stored.get("part"), stored.get("request")
    if message.role is Role.ASSISTANT and isinstance(response, dict):
        return _response(response)[0]
    if (
        isinstance(part, dict)
        and isinstance(request, dict)
        and not message.metadata.get(TRUNCATED_METADATA_KEY)
    ):
        return _request_part(part, request)[0]
    return message


def _unedited(
    context: Sequence[Message], given: Sequence[Message], ids: Sequence[str | None], log: _Log | None
) -> bool:
    """Whether ``given`` plainly holds the conversation as it is; ``False`` if it may hold an edit.

    A history that holds a summary, or any history while the context holds
    none, is the context's form: it holds the context's messages as one run. A
    history without a summary while the context holds one is the application's
    own list: it holds the whole conversation (``log``) as one run. What comes
    before the run (older history the log never saw) or after it (the run's
    new messages) is no edit.
    """
    if any(map(_is_summary, given)) or not any(map(_is_summary, context)):
        expected = [content_hash(_as_sent(context[n])) for n in _turns(context)]
        held = [content_hash(given[n]) for n in _turns(given)]
        return _occurs(expected, held)
    if log is None:
        return False
    expected = [digest for digest, compared in zip(log.digests, log.compared, strict=True) if compared]
    return _occurs(expected, log.held(given, ids)[1])


def _as_held(
    context: Sequence[Message], messages: Sequence[Message], ids: Sequence[str | None]
) -> list[str | None]:
    """``ids``, each message of ``messages`` that is one of ``context``'s turns with that turn's key.

    pydantic-ai's messages carry no keys, so a context handed to a run comes
    back without the keys ``sync`` gave it, and ``sync`` matches its unkeyed
    messages against the log's end. The log need not end as the context does:
    a fold records the results of the calls it closed as abandoned after the
    run's new prompt, and puts them after their calls in the context (or folds
    them away with the calls). So the context's turns, when ``messages`` holds
    them as one run and only once, are known by their keys (an abandoned
    call's result, recorded without one, by its content); else ``ids`` stays.
    """
    turns = _turns(context)
    listed = _turns(messages)
    if not turns or len(turns) > len(listed):
        return list(ids)
    expected = [content_hash(_as_sent(context[n])) for n in turns]
    needle, haystack = ",".join(expected), ",".join(content_hash(messages[n]) for n in listed)
    found = haystack.find(needle)  # digests of one length: a match starts at a digest (see ``_occurs``)
    if found < 0 or haystack.find(needle, found + 1) >= 0:
        return list(ids)
    start = found // (len(expected[0]) + 1)
    out = list(ids)
    for offset, n in enumerate(turns):
        out[listed[start + offset]] = message_key(context[n])
    return out


def _turns(messages: Sequence[Message]) -> list[int]:
    """The positions of the messages of ``messages`` an edit counts for: no system prompt, no summary."""
    return [
        n
        for n, (message, prompt) in enumerate(zip(messages, _prompts(messages), strict=True))
        if not prompt and _compared(message)
    ]


def _edit_of(
    said: Sequence[Message], context: Sequence[Message], given: Sequence[Message], ids: Sequence[str | None]
) -> _Edit | None:
    """The edit ``given`` (a run's messages) made to ``said`` (the log's conversation), ``None`` if none.

    Messages are compared by what a model sees of them. The conversation, or
    the context's part of it when ``given`` is in the context's form (see
    ``_unedited``), is aligned with ``given``: what ``given`` left out, rewrote
    or put in between is the edit. What it holds before the conversation's
    start or after its end is no edit.
    """
    log = _Log.of(said)
    listed, held = log.held(given, ids)
    if any(map(_is_summary, given)) or not any(map(_is_summary, context)):
        reference = [n for n in _positions(said, context) if n is not None]
    else:
        reference = list(range(len(said)))
    reference = [n for n in reference if log.compared[n]]
    expected = [log.digests[n] for n in reference]
    if not reference or _occurs(expected, held):
        return None
    edit = _Edit()
    matcher = difflib.SequenceMatcher(None, expected, held, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or i1 == i2 == 0:
            continue  # what the history holds before the conversation's start is not the conversation's
        # What follows the conversation's end is new: ``sync`` records it as it records a run's messages.
        added = (
            []
            if i2 == len(reference)
            else [_with_key(given[listed[j]], ids[listed[j]]) for j in range(j1, j2)]
        )
        for i in range(i1, i2):
            edit.instead[reference[i]] = []
        if i1 < i2:
            edit.instead[reference[i1]] = added
        elif added:
            edit.before.setdefault(reference[i1], []).extend(added)
    return edit if edit.instead or edit.before else None


def _followed(edit: _Edit, said: Sequence[Message], window: Sequence[StoredMessage]) -> Edit:
    """What following ``edit`` of ``said`` (the log's conversation) writes to ``window``'s context."""
    edited = edit.conversation(said)
    touched = edit.instead.keys() | edit.before.keys()
    positions = _positions(said, [stored.message for stored in window])
    at = {n: stored for n, stored in zip(positions, window, strict=True) if n is not None}
    context: list[Row] = []
    if any(_is_summary(stored.message) for stored in window) and not touched <= at.keys():
        # The summary speaks for a message the edit changed: the edited conversation replaces
        # it, unfolded, until the next fold, under the system prompt the context stands under.
        prompts = _prompts([message for message, _ in edited])
        context += map(kept, window[: _opening([stored.message for stored in window])])
        context += [
            kept(at[n]) if n is not None and n in at else Row(message, None)
            for (message, n), prompt in zip(edited, prompts, strict=True)
            if not prompt
        ]
    else:
        for n, stored in zip(positions, window, strict=True):
            if n is not None:
                context += [Row(message, None) for message in edit.before.get(n, ())]
            if n is not None and n in edit.instead:
                context += [Row(message, None) for message in edit.instead[n]]
            else:
                context.append(kept(stored))
    first = edit.first
    return withdrawal(len(said), first, [message for message, _ in edited[first:]], context)


def _instructions(request_context: ModelRequestContext) -> list[Message]:
    """The instructions the request sends beside its messages, as the system message a model reads them as.

    Those of the prefix: a loaded capability's (``via_history``) reach the model in the messages.
    """
    parameters = request_context.model_request_parameters
    text = InstructionPart.join(
        [
            part
            for part in parameters.instruction_parts or ()
            if parameters.instruction_visibility_of(part) == "prefix"
        ]
    )
    return [Message.system(text)] if text else []


@dataclass
class CompactionCapability(AbstractCapability[Any]):
    """Compacts the run's message history before each model request (``Agent(capabilities=[...])``)."""

    compactor: Compactor
    thread: str | None = None
    _logs: OrderedDict[str, _Log] = field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    """What each thread's log says, for the threads used last (as many as the compactor caches)."""
    _runs: OrderedDict[str, None] = field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    """The runs (the latest ones) whose given history ``_follow`` took: their later requests do not."""

    def __post_init__(self) -> None:
        if not isinstance(self.compactor, Compactor):
            raise ConfigError("compactor", "must be a contextfold.Compactor", value=self.compactor)

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # holds a live compactor: not a spec-serializable capability

    def _thread(self, ctx: RunContext[Any]) -> str:
        thread = self.thread or ctx.conversation_id
        if not thread:
            raise ConfigError(
                "conversation_id",
                "names the contextfold thread and is missing; pass agent.run(..., conversation_id=...) "
                "or CompactionCapability(compactor, thread=...)",
            )
        return thread

    @asynccontextmanager
    async def _reading(self, thread: str) -> AsyncIterator[_Log]:
        """What ``thread``'s log says, brought up to date (only the episodes added since are read), held.

        A thread met first reads its whole log, in a worker thread when it is long.
        """
        logs = self._logs
        log = logs.get(thread)
        if log is None:
            log = logs[thread] = _Log()
            while len(logs) > _CACHED_THREADS:
                logs.popitem(last=False)
        else:
            logs.move_to_end(thread)
        async with holding(log.lock):
            await _catch_up(self.compactor, thread, log)
            yield log

    def _first_request(self, ctx: RunContext[Any]) -> bool:
        """Whether no model request of ``ctx``'s run went past ``_follow`` yet (see ``_followed``)."""
        run = ctx.run_id
        if run is None:
            return False
        if run in self._runs:
            self._runs.move_to_end(run)
            return False
        return True

    def _followed(self, run: str) -> None:
        runs = self._runs
        runs[run] = None
        while len(runs) > _CACHED_THREADS:
            runs.popitem(last=False)

    async def _follow(self, thread: str, messages: list[Message], ids: list[str | None]) -> None:
        """Make the working context and the log follow an edit ``messages`` made, if they made one.

        The edit is found and followed holding the thread's log (``_reading``),
        then its ``sync`` lock (see ``_edits.follow``), the order ``_sync`` takes
        them in: no step of the thread lands between the read and the write.
        """
        compactor = self.compactor
        context = await compactor.context(thread)
        reading = any(map(_is_summary, context)) and not any(map(_is_summary, messages))
        size = len(context) + len(messages)
        if not reading and await _off_loop(size, _unedited, context, messages, ids, None):
            return  # the common run (no edit), told without reading the log
        async with self._reading(thread) as log:
            if reading and await _off_loop(size, _unedited, context, messages, ids, log):
                return

            async def plan(window: Sequence[StoredMessage]) -> Edit | None:
                held = [stored.message for stored in window]
                size = len(held) + len(messages)
                if await _off_loop(size, _unedited, held, messages, ids, log):
                    return None  # another step took the context where the history is
                conversation = await said(compactor, thread)
                if not conversation:
                    return None
                edit = await _off_loop(size, _edit_of, conversation, held, messages, ids)
                return None if edit is None else await _off_loop(size, _followed, edit, conversation, window)

            await follow(compactor, thread, plan)

    async def _stand(self, thread: str, log: _Log, prompt: list[Message]) -> None:
        """Make ``prompt``, the system prompt a run's messages open with, the one the thread stands under.

        A prompt that changed (a ``dynamic`` one rendered anew, an agent
        rebuilt with another) is recorded in the log where it took effect, and
        takes the place of the old one at the head of the working context, in
        one write; the conversation itself is neither withdrawn nor recorded
        again. ``log`` (held) is brought up to date with it.
        """
        if not prompt:
            return  # a run of an agent without a system prompt goes on under the thread's
        compactor = self.compactor
        current = log.prompt()
        changed = not _same_content(current, prompt)
        if changed:
            current = [_as_prompt_record(message) for message in prompt]
            if not log.digests:
                await compactor.append(thread, current)  # the thread opens with it
                await _catch_up(compactor, thread, log)
                return
        elif _same_content((context := await compactor.context(thread))[: _opening(context)], prompt):
            return
        episodes = [episode_for(message) for message in current] if changed else []

        async def plan(window: Sequence[StoredMessage]) -> Edit:
            head = _opening([stored.message for stored in window])
            if _same_content([stored.message for stored in window[:head]], prompt):
                return Edit(episodes, None)
            rows = [Row(message, None, recorded=n if changed else None) for n, message in enumerate(current)]
            return Edit(episodes, rows + [kept(stored) for stored in window[head:]])

        await follow(compactor, thread, plan)
        if changed:
            await _catch_up(compactor, thread, log)

    async def _sync(
        self, thread: str, messages: list[Message], ids: list[str | None], *, compact: bool
    ) -> list[Message] | None:
        """``sync`` the run's messages; the working context when it is not what they hold, else ``None``.

        The system prompt the messages open with is left out (``_stand`` keeps
        it, before a request), and the prompts the log holds among their turns
        are put back, so a changed prompt makes no turn new. The working
        context's turns they hold are known by their keys (``_as_held``).
        """
        head = _opening(messages)
        held = await self.compactor.context(thread)
        ids = await _off_loop(len(held) + len(messages), _as_held, held, messages, ids)
        async with self._reading(thread) as log:
            if compact:
                await self._stand(thread, log, messages[:head])
            listed, keys = await _off_loop(len(messages) - head, log.placed, messages[head:], ids[head:])
        context = await self.compactor.sync(thread, listed, ids=keys, compact=compact)
        context = listed if context is None else context
        return None if await _off_loop(len(messages), _same_content, context, messages) else context

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        thread = self._thread(ctx)
        given = list(request_context.messages)
        messages, ids = await _off_loop(len(given), from_pydantic_ai, given)
        if ctx.run_id is not None and self._first_request(ctx):
            if any(m.run_id != ctx.run_id for m in given):
                # The run was given a history (a run given none is given the thread's): follow its edits.
                # Only at the run's first request: the later ones add the run's own messages, no edit.
                await self._follow(thread, messages, ids)
            self._followed(ctx.run_id)
        await self.compactor.count_beside(thread, _instructions(request_context))
        context = await self._sync(thread, messages, ids, compact=True)
        if context is not None:
            rewritten = await _off_loop(len(context) + len(given), _rewritten, context, given)
            request_context.messages = list(rewritten)
            ctx.messages[:] = rewritten
        return request_context

    async def after_model_request(
        self, ctx: RunContext[Any], *, request_context: ModelRequestContext, response: ModelResponse
    ) -> ModelResponse:
        # The run's messages, not the request's: the model's rendering of a system prompt in mid-conversation
        # (as a ``<system>`` user prompt, say) is not a new message.
        given = [*ctx.messages, response]
        messages, ids = await _off_loop(len(given), from_pydantic_ai, given)
        await self._sync(self._thread(ctx), messages, ids, compact=False)
        return response

    async def after_run(self, ctx: RunContext[Any], *, result: AgentRunResult[Any]) -> AgentRunResult[Any]:
        # What the run added after its last model request: the output tool's return ("Final result
        # processed."), the results of the calls a run that ends at a deferred call made. A run that
        # made no request of its own went through no ``_follow``: its history is not recorded here.
        given = result.all_messages()
        tail = next((n for n in range(len(given) - 1, -1, -1) if isinstance(given[n], ModelResponse)), None)
        if tail is None or tail == len(given) - 1 or given[tail].run_id not in (None, ctx.run_id):
            return result
        messages, ids = await _off_loop(len(given), from_pydantic_ai, given)
        await self._sync(self._thread(ctx), messages, ids, compact=False)
        return result
