"""Messages, roles and tool calls, and their OpenAI and Anthropic wire formats.

A :class:`Message` is immutable plain data. ``content`` is either a string, a
list of provider content parts kept verbatim (images, cache-control marks and
other parts survive a round trip), or ``None`` (an assistant message that only
calls tools). Conversion to and from a wire format never drops information the
other format can carry; anything else is kept in ``metadata``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._errors import InvalidMessageError

__all__ = [
    "SUMMARY_METADATA_KEY",
    "Message",
    "Role",
    "ToolCall",
    "from_anthropic",
    "from_openai",
    "to_anthropic",
    "to_openai",
]

SUMMARY_METADATA_KEY = "contextfold.summary"
"""Metadata key that marks a message as a compaction summary."""

_ANTHROPIC_ERROR_KEY = "anthropic.is_error"

JsonDict = dict[str, Any]


class Role(StrEnum):
    """Who a message is from."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ToolCall(BaseModel):
    """One tool invocation requested by the assistant; ``arguments`` is a JSON text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, value: str) -> str:
        try:
            json.loads(value)
        except ValueError as exc:
            raise ValueError(f"must be a JSON text, got {value[:80]!r} ({exc})") from None
        return value

    def parsed_arguments(self) -> Any:
        """The arguments decoded from JSON."""
        return json.loads(self.arguments)


class Message(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    content: str | list[JsonDict] | None = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.role is Role.TOOL and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        if self.role is not Role.TOOL and self.tool_call_id is not None:
            raise ValueError(f"tool_call_id: only tool messages answer a call, not {self.role}")
        if self.tool_calls and self.role is not Role.ASSISTANT:
            raise ValueError(f"tool_calls: only assistant messages call tools, not {self.role}")
        ids = [call.id for call in self.tool_calls]
        if len(set(ids)) != len(ids):
            raise ValueError(f"tool_calls: call ids must be unique, got {ids}")
        return self

    @classmethod
    def system(cls, text: str, **metadata: Any) -> Message:
        return cls(role=Role.SYSTEM, content=text, metadata=metadata)

    @classmethod
    def user(cls, text: str, **metadata: Any) -> Message:
        return cls(role=Role.USER, content=text, metadata=metadata)

    @classmethod
    def assistant(
        cls, text: str | None = "", *, tool_calls: Sequence[ToolCall] = (), **metadata: Any
    ) -> Message:
        return cls(role=Role.ASSISTANT, content=text, tool_calls=tuple(tool_calls), metadata=metadata)

    @classmethod
    def tool(cls, tool_call_id: str, text: str, **metadata: Any) -> Message:
        return cls(role=Role.TOOL, content=text, tool_call_id=tool_call_id, metadata=metadata)

    @property
    def text(self) -> str:
        """The textual content; text parts are joined, other parts are left out."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(
            str(part.get("text", "")) for part in self.content if part.get("type") == "text"
        )

    @property
    def is_summary(self) -> bool:
        """Whether this message is a compaction summary written by contextfold."""
        return bool(self.metadata.get(SUMMARY_METADATA_KEY))


def _build(field: str, **data: Any) -> Message:
    try:
        return Message(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        where = f"{field}.{loc}" if loc else field
        raise InvalidMessageError(where, first["msg"].removeprefix("Value error, ")) from None


def _require(payload: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in payload:
        raise InvalidMessageError(f"{field}.{key}", "is required")
    return payload[key]


# OpenAI Chat Completions ---------------------------------------------------


def to_openai(messages: Iterable[Message]) -> list[JsonDict]:
    """Render messages as OpenAI Chat Completions ``messages``."""
    out: list[JsonDict] = []
    for message in messages:
        item: JsonDict = {"role": message.role.value, "content": message.content}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def from_openai(payload: Iterable[Mapping[str, Any]]) -> list[Message]:
    """Parse OpenAI Chat Completions ``messages``; malformed input names its field."""
    messages: list[Message] = []
    for index, item in enumerate(payload):
        field = f"messages[{index}]"
        if not isinstance(item, Mapping):
            raise InvalidMessageError(field, f"must be an object, got {type(item).__name__}")
        role = _require(item, "role", field)
        if role == "developer":
            role = "system"
        if role not in Role._value2member_map_:
            raise InvalidMessageError(
                f"{field}.role", f"unknown role {role!r}; use one of {[r.value for r in Role]}"
            )
        calls: list[ToolCall] = []
        for n, raw in enumerate(item.get("tool_calls") or ()):
            call_field = f"{field}.tool_calls[{n}]"
            function = raw.get("function") or {}
            call_id = raw.get("id")
            if not call_id:
                raise InvalidMessageError(f"{call_field}.id", "a tool call needs a non-empty id")
            try:
                calls.append(
                    ToolCall(
                        id=call_id,
                        name=function.get("name", ""),
                        arguments=function.get("arguments", "{}"),
                    )
                )
            except ValidationError as exc:
                first = exc.errors()[0]
                loc = first["loc"][0] if first["loc"] else "function"
                name = f"function.{loc}" if loc in ("name", "arguments") else str(loc)
                raise InvalidMessageError(
                    f"{call_field}.{name}", first["msg"].removeprefix("Value error, ")
                ) from None
        extra = {
            key: value
            for key, value in item.items()
            if key not in ("role", "content", "tool_calls", "tool_call_id", "name")
        }
        metadata: JsonDict = {"openai": extra} if extra else {}
        if item.get("role") == "developer":
            metadata["openai.role"] = "developer"
        messages.append(
            _build(
                field,
                role=role,
                content=item.get("content"),
                tool_calls=tuple(calls),
                tool_call_id=item.get("tool_call_id"),
                name=item.get("name"),
                metadata=metadata,
            )
        )
    return messages


# Anthropic Messages ---------------------------------------------------------


def _anthropic_text(content: str | list[JsonDict] | None) -> list[JsonDict]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def to_anthropic(messages: Iterable[Message]) -> tuple[str | list[JsonDict] | None, list[JsonDict]]:
    """Render messages as Anthropic ``(system, messages)``.

    Leading system messages become the ``system`` parameter; a system message
    later in the conversation (a summary, say) is sent as a user turn. Tool
    results become ``tool_result`` blocks of a user turn, and consecutive turns
    of one role are merged, as the Messages API requires.
    """
    items = list(messages)
    system_parts: list[Message] = []
    while items and items[0].role is Role.SYSTEM:
        system_parts.append(items.pop(0))
    system: str | list[JsonDict] | None
    if not system_parts:
        system = None
    elif len(system_parts) == 1 and not isinstance(system_parts[0].content, list):
        system = system_parts[0].content
    else:
        system = [block for part in system_parts for block in _anthropic_text(part.content)]

    out: list[JsonDict] = []

    def push(role: str, blocks: list[JsonDict], raw: str | None = None) -> None:
        if out and out[-1]["role"] == role:
            previous = out[-1]["content"]
            if isinstance(previous, str):
                previous = _anthropic_text(previous)
            out[-1]["content"] = previous + blocks
        elif raw is not None:
            out.append({"role": role, "content": raw})
        else:
            out.append({"role": role, "content": blocks})

    for message in items:
        if message.role is Role.TOOL:
            block: JsonDict = {
                "type": "tool_result",
                "tool_use_id": message.tool_call_id,
                "content": message.content if message.content is not None else "",
            }
            if message.metadata.get(_ANTHROPIC_ERROR_KEY):
                block["is_error"] = True
            push("user", [block])
        elif message.role is Role.ASSISTANT:
            blocks = _anthropic_text(message.content)
            blocks += [
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": call.parsed_arguments(),
                }
                for call in message.tool_calls
            ]
            raw = message.content if isinstance(message.content, str) and not message.tool_calls else None
            push("assistant", blocks, raw)
        else:
            raw = message.content if isinstance(message.content, str) else None
            push("user", _anthropic_text(message.content), raw)
    return system, out


def from_anthropic(
    payload: Iterable[Mapping[str, Any]], *, system: str | Sequence[Mapping[str, Any]] | None = None
) -> list[Message]:
    """Parse Anthropic Messages ``messages`` (and the ``system`` parameter)."""
    messages: list[Message] = []
    if system is not None:
        content: str | list[JsonDict] = system if isinstance(system, str) else [dict(b) for b in system]
        messages.append(_build("system", role=Role.SYSTEM, content=content))
    for index, item in enumerate(payload):
        field = f"messages[{index}]"
        role = _require(item, "role", field)
        if role not in ("user", "assistant"):
            raise InvalidMessageError(
                f"{field}.role", f"unknown role {role!r}; Anthropic turns are 'user' or 'assistant'"
            )
        content = _require(item, "content", field)
        if isinstance(content, str):
            messages.append(_build(field, role=role, content=content))
            continue
        if not isinstance(content, list):
            raise InvalidMessageError(f"{field}.content", "must be a string or a list of blocks")
        if role == "assistant":
            parts: list[JsonDict] = []
            calls: list[ToolCall] = []
            for n, block in enumerate(content):
                if block.get("type") == "tool_use":
                    if not block.get("id"):
                        raise InvalidMessageError(
                            f"{field}.content[{n}].id", "a tool_use block needs a non-empty id"
                        )
                    try:
                        arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                        call = ToolCall(id=block["id"], name=block.get("name", ""), arguments=arguments)
                        calls.append(call)
                    except (TypeError, ValidationError) as exc:
                        raise InvalidMessageError(f"{field}.content[{n}]", str(exc)) from None
                else:
                    parts.append(dict(block))
            messages.append(
                _build(field, role=Role.ASSISTANT, content=parts or None, tool_calls=tuple(calls))
            )
            continue
        pending: list[JsonDict] = []
        for n, block in enumerate(content):
            if block.get("type") != "tool_result":
                pending.append(dict(block))
                continue
            if pending:
                messages.append(_build(field, role=Role.USER, content=pending))
                pending = []
            tool_use_id = block.get("tool_use_id")
            if not tool_use_id:
                raise InvalidMessageError(
                    f"{field}.content[{n}].tool_use_id", "a tool_result block must name its tool_use"
                )
            metadata = {_ANTHROPIC_ERROR_KEY: True} if block.get("is_error") else {}
            result = block.get("content", "")
            messages.append(
                _build(
                    f"{field}.content[{n}]",
                    role=Role.TOOL,
                    content=result if isinstance(result, str) else list(result),
                    tool_call_id=tool_use_id,
                    metadata=metadata,
                )
            )
        if pending:
            messages.append(_build(field, role=Role.USER, content=pending))
    return messages
