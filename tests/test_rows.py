"""Row encoding: each message is encoded once and its stored copy is exactly what its JSON reads back as."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextfold import InvalidMessageError, Message, Role, ToolCall
from contextfold.episodes import Usage, episode_for
from contextfold.stores._rows import _EPISODE_ADAPTER, encode_recording, encode_rows, record_messages

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
metadata = st.dictionaries(st.text(max_size=8), scalars, max_size=5)


@st.composite
def messages(draw: Any) -> Message:
    role = draw(st.sampled_from(list(Role)))
    content = draw(st.one_of(st.none(), st.text(max_size=60)))
    name = draw(st.one_of(st.none(), st.text(max_size=8)))
    extra: dict[str, Any] = {"metadata": draw(metadata), "name": name}
    if role is Role.TOOL:
        extra["tool_call_id"] = draw(st.text(min_size=1, max_size=8))
    if role is Role.ASSISTANT:
        ids = draw(st.lists(st.text(min_size=1, max_size=6), unique=True, max_size=3))
        arguments = st.dictionaries(st.text(max_size=6), scalars, max_size=3).map(json.dumps)
        extra["tool_calls"] = [
            ToolCall(id=id_, name=draw(st.text(min_size=1, max_size=8)), arguments=draw(arguments))
            for id_ in ids
        ]
    return Message(role=role, content=content, **extra)


def read_back(message: Message) -> Message:
    return Message.model_validate_json(message.model_dump_json())


def same(copy: Message, expected: Message) -> None:
    assert copy == expected
    assert copy.__dict__ == expected.__dict__
    assert copy.model_fields_set == expected.model_fields_set
    assert copy.model_dump_json() == expected.model_dump_json()


@settings(max_examples=300, deadline=None)
@given(messages())
def test_a_plain_message_is_stored_as_its_json_reads_back(message: Message) -> None:
    """Text, names, tool calls, scalar metadata: the copy equals the JSON read back, field for field."""
    ((body, count, copy),) = encode_rows([message], [3])
    assert body == message.model_dump_json() and count == 3
    same(copy, read_back(message))
    assert copy is not message and copy.metadata is not message.metadata
    message.metadata["later"] = 1  # the caller's edits after the append do not reach the copy
    assert "later" not in copy.metadata


@pytest.mark.parametrize(
    "message",
    [
        Message.user("when", metadata={"at": datetime(2026, 1, 2, tzinfo=UTC)}),  # read back as text
        Message.user("nested", metadata={"tags": ["a", "b"], "deep": {"k": [1, 2.5]}}),
        Message.user([{"type": "text", "text": "parts"}]),
        Message.user("tuple", metadata={"pair": (1, 2)}),
    ],
    ids=["datetime", "nested", "parts", "tuple"],
)
def test_any_other_message_is_read_back_from_its_json(message: Message) -> None:
    """What is not plain text and scalars is stored as its JSON reads back, not as it was built."""
    ((_, _, copy),) = encode_rows([message], [1])
    same(copy, read_back(message))
    assert copy is not message


def test_a_message_built_without_validation_is_still_refused() -> None:
    """A model_construct that skipped the role checks is refused, not stored as plain."""
    orphan = Message.model_construct(
        role=Role.TOOL, content="result", tool_calls=(), tool_call_id=None, name=None, metadata={}
    )
    with pytest.raises(InvalidMessageError) as info:
        encode_rows([orphan], [1])
    assert info.value.field == "messages[0]" and "tool_call_id" in info.value.reason


def test_a_tool_call_built_without_validation_is_still_refused() -> None:
    """A model_construct tool call whose arguments are not JSON is refused, as its JSON would be."""
    call = ToolCall.model_construct(id="c1", name="f", arguments="{not json")
    message = Message.model_construct(
        role=Role.ASSISTANT, content=None, tool_calls=(call,), tool_call_id=None, name=None, metadata={}
    )
    with pytest.raises(InvalidMessageError) as info:
        encode_rows([message], [1])
    assert info.value.field == "messages[0]" and "arguments" in info.value.reason


calls = st.one_of(
    st.just({}),
    st.fixed_dictionaries(
        {
            "model": st.one_of(st.none(), st.text(max_size=10)),
            "usage": st.one_of(
                st.none(),
                st.builds(Usage, input_tokens=st.integers(0, 10**6), output_tokens=st.integers(0, 10**6)),
            ),
            "request_messages": st.integers(0, 1000),
            "request_tokens": st.integers(0, 10**6),
        }
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(messages(), max_size=4), calls)
def test_a_step_recorded_by_append_encodes_as_the_general_recording(
    batch: list[Message], call: dict[str, Any]
) -> None:
    """record_messages gives what encode_recording gives for each message's own episode, byte for byte."""
    tokens = list(range(len(batch)))
    fast = record_messages(batch, tokens, **call)
    episodes = [episode_for(message, **call) for message in batch]
    general = encode_recording(episodes, batch, tokens, list(range(len(batch))))
    assert fast.bodies == general.bodies
    assert fast.episodes == general.episodes
    assert fast.links == general.links
    assert fast.shared == general.shared == [True] * len(batch)
    assert [row[:2] for row in fast.rows] == [row[:2] for row in general.rows]
    for (_, _, copy), (_, _, expected), message in zip(fast.rows, general.rows, batch, strict=True):
        same(copy, expected)
        assert copy is not message
    for body in fast.bodies:
        assert _EPISODE_ADAPTER.validate_json(body)  # each reads back as an episode


@pytest.mark.parametrize("field", ["role", "arguments"])
def test_a_step_recorded_by_append_refuses_what_encode_rows_refuses(field: str) -> None:
    """A message built without validation fails record_messages with the same field and reason."""
    if field == "role":
        bad = Message.model_construct(
            role=Role.TOOL, content="result", tool_calls=(), tool_call_id=None, name=None, metadata={}
        )
    else:
        call = ToolCall.model_construct(id="c1", name="f", arguments="{not json")
        bad = Message.model_construct(
            role=Role.ASSISTANT, content=None, tool_calls=(call,), tool_call_id=None, name=None, metadata={}
        )
    with pytest.raises(InvalidMessageError) as general:
        encode_rows([Message.user("fine"), bad], [1, 1])
    with pytest.raises(InvalidMessageError) as fast:
        record_messages([Message.user("fine"), bad], [1, 1])
    assert (fast.value.field, fast.value.reason) == (general.value.field, general.value.reason)
    assert fast.value.field == "messages[1]"
