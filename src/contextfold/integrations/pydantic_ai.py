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
arrives (``after_model_request``).

Each request part and each response becomes one contextfold message, with its
pydantic-ai form kept in metadata, so every part kind — thinking, files,
native tool calls, kinds newer than this module — comes back as it was.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
)
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.tools import RunContext

from .._compactor import TRUNCATED_METADATA_KEY, Compactor
from .._errors import ConfigError
from .._messages import SUMMARY_METADATA_KEY, TOOL_ERROR_METADATA_KEY, Message, Role, ToolCall

__all__ = ["CompactionCapability", "from_pydantic_ai", "to_pydantic_ai"]

_KEY = "pydantic_ai"
# Response parts answered by a request part of the same tool_call_id (the others run at the provider).
_CALL_KINDS = frozenset({"tool-call", "tool-search-call", "capability-load-call"})
_RETURN_KINDS = frozenset({"tool-return", "tool-search-return", "capability-load-return", "retry-prompt"})


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


def _request_part(part: dict[str, Any], request: dict[str, Any]) -> tuple[Message, str | None]:
    kind = part.get("part_kind")
    metadata: dict[str, Any] = {_KEY: {"request": request, "part": part}}
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
        message = Message(
            role=Role.TOOL, content=_text(part.get("content", "")), tool_call_id=call_id, metadata=metadata
        )
        return message, f"pydantic_ai.result:{call_id}"
    # A retry without a tool, or a part kind this module does not know: the model reads it as user text.
    return Message(role=Role.USER, content=_text(part.get("content", part)), metadata=metadata), None


def _response(data: dict[str, Any]) -> tuple[Message, str | None]:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for part in data.get("parts", []):
        kind = part.get("part_kind")
        if kind == "text":
            texts.append(part.get("content", ""))
        elif kind in _CALL_KINDS and part.get("tool_call_id"):
            args = part.get("args")
            arguments = args if isinstance(args, str) and args else json.dumps(args or {})
            calls.append(
                ToolCall(id=part["tool_call_id"], name=part.get("tool_name") or kind, arguments=arguments)
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
        for part in data.get("parts", []):
            converted, key = _request_part(part, request)
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
        if out and out[-1].get("kind") == "request" and origins[-1] == request:
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


def _parts_of(message: ModelMessage) -> str:
    data = _dump(message)
    return json.dumps([data.get("kind"), data.get("parts")], sort_keys=True)


@dataclass
class CompactionCapability(AbstractCapability[Any]):
    """Compacts the run's message history before each model request (``Agent(capabilities=[...])``)."""

    compactor: Compactor
    thread: str | None = None

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

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        messages, ids = from_pydantic_ai(request_context.messages)
        context = await self.compactor.sync(self._thread(ctx), messages, ids=ids)
        if context is not None:
            rewritten = _the_runs_own(to_pydantic_ai(context), request_context.messages)
            request_context.messages = list(rewritten)
            ctx.messages[:] = rewritten
        return request_context

    async def after_model_request(
        self, ctx: RunContext[Any], *, request_context: ModelRequestContext, response: ModelResponse
    ) -> ModelResponse:
        messages, ids = from_pydantic_ai([*request_context.messages, response])
        await self.compactor.sync(self._thread(ctx), messages, ids=ids, compact=False)
        return response
