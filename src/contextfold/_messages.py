"""Messages, roles and tool calls, and their OpenAI and Anthropic wire formats.

A :class:`Message` is frozen plain data (its parts and metadata are not to be
edited in place either). ``content`` is either a string, a
list of provider content parts kept verbatim (images, thinking blocks,
cache-control marks), or ``None`` (an assistant message that only calls tools).

Parsing a payload and rendering it back in the same format gives the same
payload: what a message has no field for (OpenAI's ``refusal`` or a tool
call's extra keys, Anthropic's ``cache_control`` on a tool block or a text
block after a ``tool_use``) is kept under ``openai``/``anthropic`` keys of
``metadata``. Anthropic turns of one role in a row are the exception: they are
rendered as one turn, which the API would make of them anyway.

A message rendered and parsed back is equal to itself, unless the format has
no way to say it: Anthropic has one system parameter, so several leading
system messages come back as one, and a string next to tool calls cannot be
told from a lone text block. Other metadata is never sent: a compaction
summary goes out as an ordinary message of its role, without its mark.
"""

from __future__ import annotations

import json
import math
import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticSerializationError, to_jsonable_python

from ._errors import InvalidMessageError

__all__ = [
    "SUMMARY_METADATA_KEY",
    "TOOL_ERROR_METADATA_KEY",
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

TOOL_ERROR_METADATA_KEY = "is_error"
"""Metadata key on a tool result that reports a failure (Anthropic's ``is_error``)."""

JsonDict = dict[str, Any]


class Role(StrEnum):
    """Who a message is from."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


_TOOL, _ASSISTANT = Role.TOOL, Role.ASSISTANT
"""Members looked up once: on its enum class a member is a descriptor call, ten times a global's cost."""

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple"})


def _field_of(loc: Sequence[int | str]) -> str:
    """A dotted field path from a pydantic error location, without its union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path


def _invalid(exc: ValidationError) -> InvalidMessageError:
    errors = exc.errors()
    first = errors[0]
    inner = first.get("ctx", {}).get("error")
    if isinstance(inner, InvalidMessageError):  # our own rule, or a nested model's own error
        where = _field_of(first["loc"])
        if not where:
            return inner
        separator = "" if inner.field.startswith("[") else "."
        return InvalidMessageError(f"{where}{separator}{inner.field}", inner.reason)
    # A union (``content``) fails once per member; the deepest location is the informative one.
    deepest = max(errors, key=lambda e: len(e["loc"]))
    field = _field_of(deepest["loc"])
    reason = deepest["msg"].removeprefix("Value error, ").replace("Input should be", "must be", 1)
    if deepest["type"].endswith("_type"):
        reason += f", not {type(deepest.get('input')).__name__}"
    if field == "content" and len(errors) > 1:
        reason = (
            f"must be a string, a list of content-part objects or null, got {type(first['input']).__name__}"
        )
    return InvalidMessageError(field or "message", reason)


class _Validated(BaseModel):
    """A frozen model whose constructor raises ``InvalidMessageError``.

    ``model_validate`` and ``model_validate_json`` keep pydantic's
    ``ValidationError``, which the stores turn into their own errors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _invalid(exc) from None


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which are not JSON and which providers reject.
    raise ValueError(f"{name} is not a JSON value")


def _check_finite(value: Any, path: str = "") -> None:
    """Raise unless ``value`` is JSON data that comes back as it went in; ``path`` says where it is.

    No NaN or infinity at any depth (JSON has none: a NaN would come back as
    null), mappings keyed by strings only (JSON turns a key of 1 into "1"), and
    no object without a JSON form: it failed only at ``append``. What pydantic
    writes as JSON (a datetime, a set) is stored as that JSON and read back so.
    """
    if isinstance(value, str | bool | int | None):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessageError(
                path or "value", f"must be a finite number, got {value!r}: JSON has no NaN or infinity"
            )
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidMessageError(
                    f"{path}[{key!r}]" if path else repr(key),
                    f"must be a str key, got {type(key).__name__}: JSON keys are strings; use str({key!r})",
                )
            named = key.isidentifier()
            _check_finite(item, f"{path}.{key}" if named and path else key if named else f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_finite(item, f"{path}[{index}]")
    else:
        try:  # a datetime, a UUID, a set: stored as its JSON, and read back as that JSON
            to_jsonable_python(value)
        except PydanticSerializationError:
            raise InvalidMessageError(
                path or "value",
                f"must be JSON data, not {type(value).__name__} ({value!r:.60}), which has no JSON form; "
                "use a str, number, bool, None, list or dict",
            ) from None


_ARGUMENTS = json.JSONDecoder(parse_constant=_reject_constant)
"""One decoder for every check: ``json.loads`` with an argument builds a new one per call."""


def check_arguments(value: str) -> str:
    """``value`` unless it is not a JSON text (NaN and Infinity are not); raises ``ValueError``."""
    try:
        if value.startswith("\ufeff"):  # what json.loads says of a byte-order mark
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", value, 0)
        _ARGUMENTS.decode(value)
    except ValueError as exc:
        raise ValueError(f"must be a JSON text, got {value[:80]!r} ({exc})") from None
    except RecursionError:  # Python's decoder recurses per level of nesting
        raise ValueError(
            f"must be a JSON text Python can read, got {value[:80]!r} (nested deeper than the "
            f"interpreter's recursion limit, {sys.getrecursionlimit()})"
        ) from None
    return value


class ToolCall(_Validated):
    """One tool invocation requested by the assistant; ``arguments`` is a JSON text."""

    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, value: str) -> str:
        return check_arguments(value)

    def parsed_arguments(self) -> Any:
        """The arguments decoded from JSON."""
        return json.loads(self.arguments)


class Message(_Validated):
    """One message of a conversation."""

    role: Role
    content: str | list[JsonDict] | None = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata", "content")
    @classmethod
    def _finite_numbers(cls, value: Any) -> Any:
        # Unchecked, a NaN would be stored as null: the log would not hold what was appended.
        if not isinstance(value, str):
            _check_finite(value)
        return value

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        check_role_fields(self)
        return self

    @classmethod
    def system(cls, text: str, *, metadata: Mapping[str, Any] | None = None) -> Message:
        return cls(role=Role.SYSTEM, content=text, metadata=dict(metadata or {}))

    @classmethod
    def user(cls, text: str, *, metadata: Mapping[str, Any] | None = None) -> Message:
        return cls(role=Role.USER, content=text, metadata=dict(metadata or {}))

    @classmethod
    def assistant(
        cls,
        text: str | None = "",
        *,
        tool_calls: Sequence[ToolCall] = (),
        metadata: Mapping[str, Any] | None = None,
    ) -> Message:
        return cls(
            role=Role.ASSISTANT, content=text, tool_calls=tuple(tool_calls), metadata=dict(metadata or {})
        )

    @classmethod
    def tool(
        cls,
        tool_call_id: str,
        text: str,
        *,
        is_error: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> Message:
        """A tool's result; ``is_error`` marks a failed call (Anthropic's ``is_error``)."""
        data = dict(metadata or {})
        if is_error:
            data[TOOL_ERROR_METADATA_KEY] = True
        return cls(role=Role.TOOL, content=text, tool_call_id=tool_call_id, metadata=data)

    @property
    def text(self) -> str:
        """The textual content; text parts are joined, other parts are left out."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")

    @property
    def is_summary(self) -> bool:
        """Whether this message is a compaction summary written by contextfold."""
        return bool(self.metadata.get(SUMMARY_METADATA_KEY))


def check_role_fields(message: Message) -> None:
    """Raise unless the message's tool fields suit its role (a check a ``model_construct`` skips)."""
    role = message.role
    if role is _TOOL:
        if not message.tool_call_id:
            raise InvalidMessageError("tool_call_id", "a tool message must name the call it answers")
    elif message.tool_call_id is not None:
        raise InvalidMessageError(
            "tool_call_id", f"only tool messages answer a call, not {role.value} messages"
        )
    if not message.tool_calls:
        return
    if role is not _ASSISTANT:
        raise InvalidMessageError(
            "tool_calls", f"only assistant messages call tools, not {role.value} messages"
        )
    ids = [call.id for call in message.tool_calls]
    if len(set(ids)) != len(ids):
        raise InvalidMessageError("tool_calls", f"call ids must be unique within a message, got {ids}")


def _build(
    field: str,
    role: Any,
    content: Any,
    *,
    tool_calls: tuple[ToolCall, ...] = (),
    tool_call_id: Any = None,
    name: Any = None,
    metadata: JsonDict | None = None,
) -> Message:
    try:
        return Message(
            role=role,
            content=content,
            tool_calls=tool_calls,
            tool_call_id=tool_call_id,
            name=name,
            metadata=metadata or {},
        )
    except InvalidMessageError as exc:
        raise InvalidMessageError(f"{field}.{exc.field}", exc.reason) from None


def _require(payload: Mapping[str, Any], key: str, field: str) -> Any:
    if key not in payload:
        raise InvalidMessageError(f"{field}.{key}", "is required")
    return payload[key]


def _items(payload: Any, field: str, expected: str = "a list of objects") -> list[Any]:
    """The payload's items, copied so that a parsed message shares no list or object with it."""
    if isinstance(payload, str | bytes | Mapping) or not isinstance(payload, Iterable):
        raise InvalidMessageError(field, f"must be {expected}, got {type(payload).__name__}")
    return [_json_copy(item) for item in payload]


def _json_copy(value: Any) -> Any:
    """A copy of every object and list in a JSON-like value (strings and numbers are immutable)."""
    if isinstance(value, Mapping):
        return {key: _json_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_copy(item) for item in value]
    return value


def _mapping(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidMessageError(field, f"must be an object, got {type(value).__name__}")
    return value


_OPENAI_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
_OPENAI_EXTRA_KEY = "openai"
_OPENAI_ROLE_KEY = "openai.role"
_OPENAI_OMITTED_KEY = "openai.omitted"
_OPENAI_CALLS_KEY = "openai.tool_calls"


def _openai_calls(message: Message) -> list[JsonDict]:
    extras = message.metadata.get(_OPENAI_CALLS_KEY)
    extras = extras if isinstance(extras, Mapping) else {}
    calls: list[JsonDict] = []
    for call in message.tool_calls:
        item: JsonDict = {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        extra = extras.get(call.id)
        if isinstance(extra, Mapping):
            for key, value in extra.items():
                if key == "function" and isinstance(value, Mapping):
                    item["function"] = {**value, **item["function"]}
                elif key not in ("id", "function"):
                    item[key] = value
        calls.append(item)
    return calls


def to_openai(messages: Iterable[Message], *, omit_nulls: bool = False) -> list[JsonDict]:
    """Render messages as OpenAI Chat Completions ``messages``.

    What a parsed message carried beyond the model — the ``developer`` role,
    keys such as ``refusal`` or ``audio``, extra keys of a tool call, an
    omitted ``content`` — is restored from ``metadata``. With ``omit_nulls``
    no key is sent with a null value (a parsed ``"refusal": null``, a
    tool-calling reply's ``"content": null``), which some servers reject.
    """
    out: list[JsonDict] = []
    for message in messages:
        metadata = message.metadata
        role = message.role.value
        if message.role is Role.SYSTEM and metadata.get(_OPENAI_ROLE_KEY) == "developer":
            role = "developer"
        item: JsonDict = {"role": role}
        omitted = metadata.get(_OPENAI_OMITTED_KEY)
        if not (message.content is None and isinstance(omitted, list) and "content" in omitted):
            item["content"] = message.content
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = _openai_calls(message)
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        extra = metadata.get(_OPENAI_EXTRA_KEY)
        if isinstance(extra, Mapping):
            item.update((key, value) for key, value in extra.items() if key not in item)
        if omit_nulls:
            item = {key: value for key, value in item.items() if value is not None}
        out.append(item)
    # A caller that edits the payload (moving a cache mark, say) must not edit the messages.
    payload: list[JsonDict] = _json_copy(out)
    return payload


def _openai_call(raw: Any, field: str) -> tuple[ToolCall, JsonDict]:
    """A tool call, and its keys the model does not hold (``type`` other than function, ...)."""
    raw = _mapping(raw, field)
    call_id = raw.get("id")
    if not call_id or not isinstance(call_id, str):
        raise InvalidMessageError(f"{field}.id", f"a tool call needs a non-empty string id, got {call_id!r}")
    function = _mapping(_require(raw, "function", field), f"{field}.function")
    try:
        call = ToolCall(id=call_id, name=function.get("name", ""), arguments=function.get("arguments", "{}"))
    except InvalidMessageError as exc:
        raise InvalidMessageError(f"{field}.function.{exc.field}", exc.reason) from None
    extra: JsonDict = {
        key: value
        for key, value in raw.items()
        if key not in ("id", "function") and (key, value) != ("type", "function")
    }
    function_extra = {key: value for key, value in function.items() if key not in ("name", "arguments")}
    if function_extra:
        extra["function"] = function_extra
    return call, extra


def _sdk_data(payload: Any) -> Any:
    """``payload`` with the SDKs' own message objects (pydantic models) as their JSON data.

    Fields the SDK left unset or null (``refusal``, ``audio``, ``function_call``,
    a block's ``citations``) are left out, so they are not sent back.
    """
    if isinstance(payload, str | bytes | Mapping | BaseModel) or not isinstance(payload, Iterable):
        return _sdk_value(payload)
    return [_sdk_value(item) for item in payload]


def _sdk_value(value: Any) -> Any:
    """``value`` with the SDKs' objects in it as their JSON data, at any depth; itself if it holds none.

    A turn built by hand often holds a reply's parts as they came (Anthropic's
    ``{"role": "assistant", "content": response.content}``, an OpenAI reply's
    ``tool_calls``).
    """
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, Mapping):
        converted = {key: _sdk_value(item) for key, item in value.items()}
        return value if all(converted[key] is item for key, item in value.items()) else converted
    if isinstance(value, list | tuple):
        items = [_sdk_value(item) for item in value]
        return value if all(map(operator.is_, items, value)) else items
    return value


def from_openai(payload: Iterable[Mapping[str, Any] | BaseModel]) -> list[Message]:
    """Parse OpenAI Chat Completions ``messages``; malformed input names its field.

    Items may be the OpenAI SDK's own objects (a reply's ``ChatCompletionMessage``).
    """
    messages: list[Message] = []
    for index, raw_item in enumerate(_items(_sdk_data(payload), "messages")):
        field = f"messages[{index}]"
        item = _mapping(raw_item, field)
        role = _require(item, "role", field)
        if not isinstance(role, str) or (role not in Role._value2member_map_ and role != "developer"):
            raise InvalidMessageError(
                f"{field}.role",
                f"unknown role {role!r}; use one of {[r.value for r in Role]} (or 'developer')",
            )
        raw_calls = item.get("tool_calls")
        if raw_calls is None:
            raw_calls = ()
        elif not isinstance(raw_calls, list | tuple):
            raise InvalidMessageError(f"{field}.tool_calls", "must be a list of tool calls")
        parsed = [_openai_call(raw, f"{field}.tool_calls[{n}]") for n, raw in enumerate(raw_calls)]
        metadata: JsonDict = {}
        # Keys the model has no place for, and modelled keys whose empty value would not be
        # written back (``"tool_calls": []``, ``"name": null``), are kept verbatim.
        extra = {
            key: value
            for key, value in item.items()
            if key not in _OPENAI_KEYS or (key != "content" and not value and value != "")
        }
        if extra:
            metadata[_OPENAI_EXTRA_KEY] = extra
        if "content" not in item:
            metadata[_OPENAI_OMITTED_KEY] = ["content"]
        call_extras = {call.id: rest for call, rest in parsed if rest}
        if call_extras:
            metadata[_OPENAI_CALLS_KEY] = call_extras
        if role == "developer":
            role = Role.SYSTEM
            metadata[_OPENAI_ROLE_KEY] = "developer"
        messages.append(
            _build(
                field,
                role,
                item.get("content"),
                tool_calls=tuple(call for call, _ in parsed),
                tool_call_id=item.get("tool_call_id"),
                name=item.get("name"),
                metadata=metadata,
            )
        )
    return messages


_ANTHROPIC_EXTRA_KEY = "anthropic"
_ANTHROPIC_OMITTED_KEY = "anthropic.omitted"
_ANTHROPIC_USES_KEY = "anthropic.tool_use"
_ANTHROPIC_LAYOUT_KEY = "anthropic.layout"
_RESULT_KEYS = ("type", "tool_use_id", "content", "is_error")
_USE_KEYS = ("type", "id", "name", "input")


def _anthropic_text(content: str | list[JsonDict] | None) -> list[JsonDict]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _plain_text(blocks: list[JsonDict]) -> str | list[JsonDict]:
    """A lone ``{"type": "text", "text": ...}`` block as its string, anything else unchanged.

    Anthropic merges a string turn into its neighbour's blocks; reading such a
    block back as a string is what makes the round trip exact.
    """
    if len(blocks) == 1 and blocks[0].keys() == {"type", "text"} and blocks[0]["type"] == "text":
        text = blocks[0]["text"]
        if isinstance(text, str) and text:
            return text
    return blocks


def _tool_result_block(message: Message) -> JsonDict:
    metadata = message.metadata
    block: JsonDict = {"type": "tool_result", "tool_use_id": message.tool_call_id}
    omitted = metadata.get(_ANTHROPIC_OMITTED_KEY)
    if not (not message.content and isinstance(omitted, list) and "content" in omitted):
        block["content"] = message.content if message.content is not None else ""
    if TOOL_ERROR_METADATA_KEY in metadata:
        block["is_error"] = bool(metadata[TOOL_ERROR_METADATA_KEY])
    extra = metadata.get(_ANTHROPIC_EXTRA_KEY)
    if isinstance(extra, Mapping):
        block.update((key, value) for key, value in extra.items() if key not in block)
    return block


def _assistant_blocks(message: Message) -> list[JsonDict]:
    """Content blocks then ``tool_use`` blocks, in the parsed order when one was recorded."""
    metadata = message.metadata
    extras = metadata.get(_ANTHROPIC_USES_KEY)
    extras = extras if isinstance(extras, Mapping) else {}
    parts = _anthropic_text(message.content)
    uses: dict[str, JsonDict] = {}
    for call in message.tool_calls:
        use: JsonDict = {
            "type": "tool_use",
            "id": call.id,
            "name": call.name,
            "input": call.parsed_arguments(),
        }
        extra = extras.get(call.id)
        if isinstance(extra, Mapping):
            use.update((key, value) for key, value in extra.items() if key not in use)
        uses[call.id] = use
    layout = metadata.get(_ANTHROPIC_LAYOUT_KEY)
    # A layout recorded for other content or other calls (the message was changed since) is ignored.
    if (
        isinstance(layout, list)
        and layout.count(None) == len(parts)
        and sorted(str(entry) for entry in layout if entry is not None) == sorted(uses)
    ):
        remaining = iter(parts)
        return [next(remaining) if entry is None else uses[entry] for entry in layout]
    return parts + list(uses.values())


def to_anthropic(messages: Iterable[Message]) -> tuple[str | list[JsonDict] | None, list[JsonDict]]:
    """Render messages as Anthropic ``(system, messages)``.

    Leading system messages become the ``system`` parameter (a system-role
    summary right after them joins it); a system message later in the
    conversation is sent as user text. Tool results become ``tool_result`` blocks of a user turn,
    and consecutive turns of one role are merged into one, as the API would
    combine them.
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
            push("user", [_tool_result_block(message)])
        elif message.role is Role.ASSISTANT:
            blocks = _assistant_blocks(message)
            raw = message.content if isinstance(message.content, str) and not message.tool_calls else None
            push("assistant", blocks, raw)
        else:
            raw = message.content if isinstance(message.content, str) else None
            push("user", _anthropic_text(message.content), raw)
    # A caller that edits the payload (moving a cache mark, say) must not edit the messages.
    return _json_copy(system), _json_copy(out)


def _anthropic_call(block: Mapping[str, Any], field: str) -> ToolCall:
    call_id = block.get("id")
    if not call_id or not isinstance(call_id, str):
        raise InvalidMessageError(
            f"{field}.id", f"a tool_use block needs a non-empty string id, got {call_id!r}"
        )
    try:
        arguments = json.dumps(block.get("input", {}), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidMessageError(f"{field}.input", f"must be JSON-serializable ({exc})") from None
    try:
        return ToolCall(id=call_id, name=block.get("name", ""), arguments=arguments)
    except InvalidMessageError as exc:
        raise InvalidMessageError(f"{field}.{exc.field}", exc.reason) from None


def _anthropic_assistant(content: list[Any], field: str) -> Message:
    parts: list[JsonDict] = []
    calls: list[ToolCall] = []
    layout: list[str | None] = []
    metadata: JsonDict = {}
    for n, raw in enumerate(content):
        block = _mapping(raw, f"{field}.content[{n}]")
        if block.get("type") == "tool_use":
            call = _anthropic_call(block, f"{field}.content[{n}]")
            calls.append(call)
            layout.append(call.id)
            extra = {key: value for key, value in block.items() if key not in _USE_KEYS}
            if extra:  # cache_control, say
                metadata.setdefault(_ANTHROPIC_USES_KEY, {})[call.id] = extra
        else:
            parts.append(dict(block))
            layout.append(None)
    if layout != [None] * len(parts) + [call.id for call in calls]:
        metadata[_ANTHROPIC_LAYOUT_KEY] = layout  # text after a tool_use block, say
    text: str | list[JsonDict] | None = parts or None
    if calls and parts:
        text = _plain_text(parts)  # to_anthropic writes string content + calls as [text, tool_use...]
    return _build(field, Role.ASSISTANT, text, tool_calls=tuple(calls), metadata=metadata)


def _anthropic_user(content: list[Any], field: str) -> list[Message]:
    messages: list[Message] = []
    has_results = any(isinstance(b, Mapping) and b.get("type") == "tool_result" for b in content)
    pending: list[JsonDict] = []

    def flush() -> None:
        if pending:
            text = _plain_text(pending) if has_results else list(pending)
            messages.append(_build(field, Role.USER, text))
            pending.clear()

    for n, raw in enumerate(content):
        block_field = f"{field}.content[{n}]"
        block = _mapping(raw, block_field)
        if block.get("type") != "tool_result":
            pending.append(dict(block))
            continue
        flush()
        tool_use_id = block.get("tool_use_id")
        if not tool_use_id or not isinstance(tool_use_id, str):
            raise InvalidMessageError(
                f"{block_field}.tool_use_id",
                f"a tool_result block must name its tool_use by a non-empty string id, got {tool_use_id!r}",
            )
        if "is_error" in block and not isinstance(block["is_error"], bool):
            raise InvalidMessageError(
                f"{block_field}.is_error", f"must be true or false, got {block['is_error']!r}"
            )
        metadata: JsonDict = {TOOL_ERROR_METADATA_KEY: block["is_error"]} if "is_error" in block else {}
        extra = {key: value for key, value in block.items() if key not in _RESULT_KEYS}
        if extra:  # cache_control, say
            metadata[_ANTHROPIC_EXTRA_KEY] = extra
        if "content" not in block:
            metadata[_ANTHROPIC_OMITTED_KEY] = ["content"]
        result = block.get("content", "")
        if not isinstance(result, str | list) and result is not None:
            raise InvalidMessageError(
                f"{block_field}.content", f"must be a string or a list of blocks, got {type(result).__name__}"
            )
        messages.append(
            _build(
                block_field,
                Role.TOOL,
                result if isinstance(result, str) or result is None else list(result),
                tool_call_id=tool_use_id,
                metadata=metadata,
            )
        )
    flush()
    if not content:
        messages.append(_build(field, Role.USER, []))
    return messages


def from_anthropic(
    payload: Iterable[Mapping[str, Any] | BaseModel],
    *,
    system: str | Sequence[Mapping[str, Any]] | None = None,
) -> list[Message]:
    """Parse Anthropic Messages ``messages`` (and the ``system`` parameter).

    Items may be the Anthropic SDK's own objects (a reply's ``Message``, whose
    ``id``, ``model``, ``usage`` and stop fields are not part of the turn).
    """
    messages: list[Message] = []
    if system is not None:
        if isinstance(system, str):
            messages.append(_build("system", Role.SYSTEM, system))
        else:
            listed = _items(system, "system", "a string or a list of blocks")
            blocks = [dict(_mapping(b, f"system[{n}]")) for n, b in enumerate(listed)]
            messages.append(_build("system", Role.SYSTEM, blocks))
    for index, raw_item in enumerate(_items(_sdk_data(payload), "messages")):
        field = f"messages[{index}]"
        item = _mapping(raw_item, field)
        role = _require(item, "role", field)
        if role not in ("user", "assistant"):
            raise InvalidMessageError(
                f"{field}.role",
                f"unknown role {role!r}; Anthropic turns are 'user' or 'assistant' "
                "(pass system prompts as system=...)",
            )
        content = _require(item, "content", field)
        if isinstance(content, str):
            messages.append(_build(field, role, content))
        elif not isinstance(content, list):
            raise InvalidMessageError(f"{field}.content", "must be a string or a list of blocks")
        elif role == "assistant":
            messages.append(_anthropic_assistant(content, field))
        else:
            messages.extend(_anthropic_user(content, field))
    return messages
