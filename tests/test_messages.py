"""The Message model: roles, tool calls, metadata and validation that names the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from contextfold import InvalidMessageError, Message, Role, ToolCall
from contextfold._messages import check_role_fields
from contextfold.messages import SUMMARY_METADATA_KEY, TOOL_ERROR_METADATA_KEY


def test_roles_are_the_four_chat_roles() -> None:
    """Role has exactly system, user, assistant and tool, valued as their wire names."""
    assert [r.value for r in Role] == ["system", "user", "assistant", "tool"]
    assert Role("tool") is Role.TOOL


def test_constructors_build_each_role() -> None:
    """The role constructors fill role, content, calls, call id and metadata."""
    lookup = ToolCall(id="call_1", name="lookup", arguments='{"q": "paris"}')
    assert Message.system("be brief").role is Role.SYSTEM
    user = Message.user("hi", metadata={"source": "cli"})
    assert (user.role, user.content, user.metadata) == (Role.USER, "hi", {"source": "cli"})
    assistant = Message.assistant(None, tool_calls=[lookup])
    assert (assistant.role, assistant.content, assistant.tool_calls) == (Role.ASSISTANT, None, (lookup,))
    result = Message.tool("call_1", "sunny")
    assert (result.role, result.tool_call_id, result.content) == (Role.TOOL, "call_1", "sunny")
    assert result.metadata == {}
    failed = Message.tool("call_1", "timeout", is_error=True, metadata={"tool": "lookup"})
    assert failed.metadata == {"tool": "lookup", TOOL_ERROR_METADATA_KEY: True}


def test_messages_are_immutable_and_comparable() -> None:
    """Messages are frozen values: equal when their fields are equal, and not assignable."""
    assert Message.user("a") == Message.user("a")
    assert Message.user("a") != Message.user("b")
    message = Message.user("a")
    with pytest.raises(ValidationError):
        message.content = "b"  # type: ignore[misc]


def test_tool_call_arguments_decode_from_json() -> None:
    """parsed_arguments() is the JSON value of the arguments text; the default is an empty object."""
    assert ToolCall(id="1", name="f", arguments='{"a": [1, 2]}').parsed_arguments() == {"a": [1, 2]}
    assert ToolCall(id="1", name="f").parsed_arguments() == {}


def test_text_joins_text_parts_and_skips_others() -> None:
    """text is the string content, or the text parts joined by newlines, or empty for None."""
    parts = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "here"},
    ]
    assert Message(role=Role.USER, content=parts).text == "look\nhere"
    assert Message.user("plain").text == "plain"
    assert Message.assistant(None, tool_calls=[ToolCall(id="1", name="f")]).text == ""


def test_is_summary_reads_the_summary_metadata_flag() -> None:
    """A message is a summary exactly when its metadata carries the summary flag."""
    assert Message.user("earlier", metadata={SUMMARY_METADATA_KEY: True}).is_summary
    assert not Message.user("earlier").is_summary


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"role": "tool", "content": "x", "tool_call_id": ""}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [{"id": "1", "name": "f"}]}, "tool_calls"),
        ({"role": "narrator", "content": "x"}, "role"),
        ({"role": "user", "content": 5}, "content"),
        ({"role": "user", "content": [{"type": "text", "text": "ok"}, "loose"]}, "content[1]"),
        ({"role": "user", "content": "x", "colour": "red"}, "colour"),
        ({"role": "user", "content": "x", "name": 5}, "name"),
        ({"role": "user", "content": "x", "metadata": [1]}, "metadata"),
        (
            {"role": "assistant", "tool_calls": [{"id": "1", "name": "f", "arguments": "{"}]},
            "tool_calls[0].arguments",
        ),
        ({"role": "assistant", "tool_calls": [{"id": "", "name": "f"}]}, "tool_calls[0].id"),
        ({"role": "assistant", "tool_calls": [{"id": "1", "name": ""}]}, "tool_calls[0].name"),
        (
            {"role": "assistant", "tool_calls": [{"id": "1", "name": "f"}, {"id": "1", "name": "g"}]},
            "tool_calls",
        ),
    ],
)
def test_invalid_messages_raise_invalid_message_error_naming_the_field(
    fields: dict[str, object], field: str
) -> None:
    """Building a malformed message raises InvalidMessageError whose field names the culprit."""
    with pytest.raises(InvalidMessageError) as info:
        Message(**fields)  # type: ignore[arg-type]
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert "Value error" not in info.value.reason and "Input should" not in info.value.reason


def test_arguments_that_are_not_json_say_what_they_were() -> None:
    """A non-JSON arguments text is rejected with the offending text in the reason."""
    with pytest.raises(InvalidMessageError) as info:
        ToolCall(id="1", name="f", arguments="{city: Paris}")
    assert info.value.field == "arguments"
    assert "{city: Paris}" in info.value.reason
    assert "JSON" in info.value.reason


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ("\ufeff{}", "Unexpected UTF-8 BOM"),
        ('{"a": NaN}', "NaN is not a JSON value"),
        ("[1,", "Expecting value"),
        ("", "Expecting value"),
    ],
)
def test_arguments_are_checked_as_json_loads_reads_them(arguments: str, said: str) -> None:
    """The one shared decoder rejects what ``json.loads`` rejects, with its reason, and NaN besides."""
    with pytest.raises(InvalidMessageError, match=said) as info:
        ToolCall(id="1", name="f", arguments=arguments)
    assert info.value.field == "arguments"
    assert ToolCall(id="1", name="f", arguments=' {"a": [1, 2.5, null]} ').parsed_arguments() == {
        "a": [1, 2.5, None]
    }


def test_invalid_message_error_is_not_a_pydantic_error() -> None:
    """Construction errors are contextfold errors, not pydantic ValidationErrors."""
    with pytest.raises(InvalidMessageError) as info:
        Message.tool("", "x")
    assert not isinstance(info.value, ValidationError)


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"score": float("nan")}, "metadata.score"),
        ({"stats": {"p99 ms": [1.0, float("inf")]}}, "metadata.stats['p99 ms'][1]"),
        ({"low": -float("inf")}, "metadata.low"),
    ],
)
def test_nan_and_infinity_in_metadata_are_rejected_naming_the_field(
    metadata: dict[str, object], field: str
) -> None:
    """A NaN or infinity anywhere in metadata fails the message's construction, naming its path."""
    with pytest.raises(InvalidMessageError) as caught:
        Message.user("hi", metadata=metadata)
    assert caught.value.field == field
    assert "finite" in caught.value.reason


def test_nan_in_a_content_part_is_rejected_naming_the_part() -> None:
    """A NaN inside a list content part fails construction with the part's index and key."""
    with pytest.raises(InvalidMessageError) as caught:
        Message(role=Role.USER, content=[{"type": "text", "text": "hi", "weight": float("nan")}])
    assert caught.value.field == "content[0].weight"


def test_finite_floats_in_metadata_round_trip_through_json() -> None:
    """Finite floats in metadata and content parts are kept and read back unchanged."""
    parts = [{"type": "text", "text": "hi", "w": 0.5}]
    message = Message(role=Role.USER, content=parts, metadata={"t": 1e300})
    assert Message.model_validate_json(message.model_dump_json()) == message


@pytest.mark.parametrize(
    ("fields", "field", "reason"),
    [
        ({"role": "tool", "content": "x"}, "tool_call_id", "a tool message must name the call it answers"),
        ({"role": "tool", "content": "x", "tool_call_id": ""}, "tool_call_id", "must name the call"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "tool_call_id", "not user messages"),
        (
            {"role": "user", "content": "x", "tool_calls": [{"id": "c1", "name": "f"}]},
            "tool_calls",
            "only assistant messages call tools, not user messages",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "c1", "name": "f"}, {"id": "c1", "name": "g"}]},
            "tool_calls",
            "call ids must be unique within a message",
        ),
    ],
)
def test_a_tool_field_that_does_not_suit_the_role_is_refused(
    fields: dict[str, Any], field: str, reason: str
) -> None:
    """Each role's tool fields are checked: by the constructor, and for a model_construct by the check."""
    with pytest.raises(InvalidMessageError) as raised:
        Message(**fields)
    assert raised.value.field == field and reason in raised.value.reason
    calls = tuple(ToolCall(**call) for call in fields.get("tool_calls", ()))
    unchecked = Message.model_construct(**{**fields, "role": Role(fields["role"]), "tool_calls": calls})
    with pytest.raises(InvalidMessageError, match=reason):
        check_role_fields(unchecked)
    Message(
        **{**fields, "role": "assistant", "tool_call_id": None, "tool_calls": ()}
    )  # the fields alone are fine


def test_tool_arguments_nested_past_the_recursion_limit_are_an_invalid_message() -> None:
    """Python's JSON decoder recursed into a bare RecursionError; it is the argument's own error."""
    too_deep = "nested deeper than the interpreter's recursion limit"
    with pytest.raises(InvalidMessageError, match=too_deep) as info:
        ToolCall(id="c1", name="f", arguments="[" * 100_000)
    assert info.value.field == "arguments"
    assert ToolCall(id="c1", name="f", arguments="[" * 50 + "]" * 50).parsed_arguments()
