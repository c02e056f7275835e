"""OpenAI Chat Completions and Anthropic Messages: lossless round trips and field-naming rejections."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextfold import (
    InvalidMessageError,
    Message,
    Role,
    ToolCall,
    from_anthropic,
    from_openai,
    to_anthropic,
    to_openai,
)
from contextfold.messages import SUMMARY_METADATA_KEY

NAN = float("nan")
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="

OPENAI: list[dict[str, Any]] = [
    {"role": "developer", "content": "You are terse."},
    {"role": "system", "content": "Tools: get_weather, get_time."},
    {
        "role": "user",
        "name": "alice",
        "content": [
            {"type": "text", "text": "What is in this image, and the weather in Paris?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny, 24°C"}]},
    {"role": "assistant", "content": "A red pixel. Sunny at noon ☀️"},
]

ANTHROPIC_SYSTEM: list[dict[str, Any]] = [
    {"type": "text", "text": "You are terse."},
    {"type": "text", "text": "Tools: get_weather.", "cache_control": {"type": "ephemeral"}},
]

ANTHROPIC: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is here, and the weather?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        ],
    },
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_2",
                "content": "clock unavailable",
                "is_error": True,
            },
            {"type": "text", "text": "Thanks!"},
        ],
    },
    {"role": "assistant", "content": "Sunny; the clock failed."},
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_3",
                "content": [
                    {"type": "text", "text": "chart"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                ],
                "is_error": False,
            }
        ],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "Here it is."}]},
]


def call(call_id: str, name: str = "lookup", arguments: object = None) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=json.dumps(arguments or {}))


# OpenAI -----------------------------------------------------------------------------


def test_openai_round_trip_is_lossless() -> None:
    """OpenAI -> Message -> OpenAI returns the payload unchanged: developer role, parts, parallel calls."""
    assert to_openai(from_openai(OPENAI)) == OPENAI


def test_openai_payload_parses_into_messages() -> None:
    """Parsing keeps roles, names, image parts, parallel calls and which call each result answers."""
    messages = from_openai(OPENAI)
    assert [m.role for m in messages] == [
        Role.SYSTEM,
        Role.SYSTEM,
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.TOOL,
        Role.ASSISTANT,
    ]
    assert messages[2].name == "alice"
    assert isinstance(messages[2].content, list) and messages[2].content[1]["type"] == "image_url"
    assert [(c.id, c.name, c.parsed_arguments()) for c in messages[3].tool_calls] == [
        ("call_1", "get_weather", {"city": "Paris"}),
        ("call_2", "get_time", {"tz": "Europe/Paris"}),
    ]
    assert messages[3].content is None
    assert [m.tool_call_id for m in messages[4:6]] == ["call_2", "call_1"]


def test_messages_round_trip_through_openai() -> None:
    """Message -> OpenAI -> Message gives equal messages."""
    messages = [
        Message.system("be brief"),
        Message(role=Role.USER, content=[{"type": "text", "text": "hi"}], name="bob"),
        Message.assistant("calling", tool_calls=[call("a", arguments={"x": 1}), call("b", "other")]),
        Message.tool("b", "B"),
        Message.tool("a", "A"),
        Message.assistant(None, tool_calls=[call("c")]),
        Message.tool("c", ""),
        Message.assistant("done"),
    ]
    assert from_openai(to_openai(messages)) == messages


# Anthropic --------------------------------------------------------------------------


def test_anthropic_round_trip_is_lossless() -> None:
    """Anthropic -> Message -> Anthropic returns system and turns unchanged: images, tool_use, is_error."""
    system, turns = to_anthropic(from_anthropic(ANTHROPIC, system=ANTHROPIC_SYSTEM))
    assert system == ANTHROPIC_SYSTEM
    assert turns == ANTHROPIC


def test_anthropic_string_system_round_trips_as_a_string() -> None:
    """A string system parameter comes back as the same string."""
    system, turns = to_anthropic(from_anthropic([{"role": "user", "content": "hi"}], system="be brief"))
    assert (system, turns) == ("be brief", [{"role": "user", "content": "hi"}])
    assert to_anthropic(from_anthropic([{"role": "user", "content": "hi"}]))[0] is None


def test_anthropic_payload_parses_into_messages() -> None:
    """tool_use blocks become tool calls and tool_result blocks become tool messages, errors marked."""
    messages = from_anthropic(ANTHROPIC, system=ANTHROPIC_SYSTEM)
    roles = [m.role.value for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user", "assistant", "tool", "assistant"]
    assistant = messages[2]
    assert assistant.content == "Let me check."
    assert [(c.id, c.name, c.parsed_arguments()) for c in assistant.tool_calls] == [
        ("toolu_1", "get_weather", {"city": "Paris"}),
        ("toolu_2", "get_time", {}),
    ]
    assert (messages[3].tool_call_id, messages[3].content) == ("toolu_1", "sunny")
    assert messages[4].tool_call_id == "toolu_2"
    assert messages[5].content == "Thanks!"
    assert isinstance(messages[7].content, list) and messages[7].content[1]["type"] == "image"


def test_messages_round_trip_through_anthropic() -> None:
    """Message -> Anthropic -> Message gives equal messages where Anthropic can represent them."""
    messages = [
        Message.system("be brief"),
        Message.user("weather?"),
        Message.assistant("checking", tool_calls=[call("a", "weather"), call("b", "time")]),
        Message.tool("a", "sunny"),
        Message(role=Role.TOOL, tool_call_id="b", content="broken", metadata={"is_error": True}),
        Message.user("and tomorrow?"),
        Message.assistant(None, tool_calls=[call("c", "forecast", {"day": "tomorrow"})]),
        Message.tool("c", [{"type": "text", "text": "rain"}]),  # type: ignore[arg-type]
        Message.assistant("Rain tomorrow."),
    ]
    system, turns = to_anthropic(messages)
    assert from_anthropic(turns, system=system) == messages


def test_anthropic_merges_consecutive_turns_of_one_role() -> None:
    """Tool results and the next user message share one user turn, as the Messages API requires."""
    system, turns = to_anthropic(
        [
            Message.user("go"),
            Message.assistant(None, tool_calls=[call("a")]),
            Message.tool("a", "done"),
            Message.user("next"),
        ]
    )
    assert system is None
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "a", "content": "done"},
        {"type": "text", "text": "next"},
    ]


def test_a_later_system_message_is_sent_as_a_user_turn() -> None:
    """Only leading system messages become the system parameter; a later one is sent as user text."""
    system, turns = to_anthropic([Message.system("rules"), Message.user("hi"), Message.system("summary")])
    assert system == "rules"
    assert turns == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "summary"}]}
    ]


def test_anthropic_round_trip_keeps_thinking_cache_control_and_block_order() -> None:
    """Thinking blocks, cache_control on tool blocks, text after a tool_use and a bare tool_result survive."""
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "c2ln"},
                {"type": "redacted_thinking", "data": "ZW5j"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "text", "text": "Checking now."},
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_time",
                    "input": {},
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}],
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                },
                {"type": "tool_result", "tool_use_id": "toolu_2"},
            ],
        },
    ]
    messages = from_anthropic(turns)
    assert [c.id for c in messages[1].tool_calls] == ["toolu_1", "toolu_2"]
    assert messages[3].content == ""
    assert to_anthropic(messages) == (None, turns)


def test_a_recorded_block_order_is_dropped_once_the_calls_change() -> None:
    """An assistant message whose calls were replaced renders its content first, then the new calls."""
    parsed = from_anthropic(
        [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                    {"type": "text", "text": "after"},
                ],
            }
        ]
    )[0]
    changed = parsed.model_copy(update={"tool_calls": (call("t9", "g"),)})
    assert to_anthropic([changed])[1][0]["content"] == [
        {"type": "text", "text": "after"},
        {"type": "tool_use", "id": "t9", "name": "g", "input": {}},
    ]


def test_openai_round_trip_keeps_omitted_content_empty_lists_and_tool_call_extras() -> None:
    """An absent content, an empty tool_calls list, a null name and extra tool-call keys survive."""
    payload: list[dict[str, Any]] = [
        {"role": "user", "content": "hi", "name": None},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": "{}", "strict": True},
                    "extra_content": {"google": {"thought_signature": "c2ln"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        {
            "role": "assistant",
            "content": "done",
            "tool_calls": [],
            "refusal": None,
            "audio": {"id": "audio_1"},
        },
    ]
    messages = from_openai(payload)
    assert messages[1].content is None
    assert [(c.id, c.name, c.arguments) for c in messages[1].tool_calls] == [("call_1", "lookup", "{}")]
    assert to_openai(messages) == payload


def test_a_summary_is_sent_as_an_ordinary_message_of_its_role() -> None:
    """A summary's metadata is not sent: it renders like any message of its role and parses back unmarked."""
    mark = {SUMMARY_METADATA_KEY: True}
    as_user = [Message.system("rules"), Message.user("so far", metadata=mark), Message.user("next")]
    assert to_openai(as_user) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "so far"},
        {"role": "user", "content": "next"},
    ]
    assert not any(m.is_summary for m in from_openai(to_openai(as_user)))
    system, turns = to_anthropic(as_user)
    assert (system, turns) == (
        "rules",
        [{"role": "user", "content": [{"type": "text", "text": "so far"}, {"type": "text", "text": "next"}]}],
    )
    as_system = [Message.system("rules"), Message.system("so far", metadata=mark), Message.user("next")]
    assert to_anthropic(as_system) == (
        [{"type": "text", "text": "rules"}, {"type": "text", "text": "so far"}],
        [{"role": "user", "content": "next"}],
    )


def test_editing_a_rendered_payload_leaves_the_messages_as_they_were() -> None:
    """Adding a cache mark to a rendered block, or editing an image, changes no message."""
    messages = from_anthropic(ANTHROPIC, system=ANTHROPIC_SYSTEM)
    before = [m.model_copy(deep=True) for m in messages]
    system, turns = to_anthropic(messages)
    assert isinstance(system, list)
    system[0]["cache_control"] = {"type": "ephemeral"}
    turns[0]["content"][1]["source"]["data"] = "changed"
    turns[2]["content"][0]["cache_control"] = {"type": "ephemeral"}
    for item in to_openai(messages):
        if isinstance(item["content"], list):
            item["content"][0]["text"] = "changed"
            item["content"].clear()
    assert messages == before


def test_editing_a_parsed_payload_leaves_the_messages_as_they_were() -> None:
    """A payload edited after parsing (a cache mark moved, say) changes no parsed message."""
    anthropic_turns = json.loads(json.dumps(ANTHROPIC))
    openai_items = json.loads(json.dumps(OPENAI))
    parsed = (from_anthropic(anthropic_turns), from_openai(openai_items))
    anthropic_turns[0]["content"][1]["source"]["data"] = "changed"
    anthropic_turns[4]["content"][0]["content"].clear()
    openai_items[2]["content"][1]["image_url"]["url"] = "changed"
    openai_items[3]["tool_calls"].clear()
    assert parsed == (from_anthropic(ANTHROPIC), from_openai(OPENAI))


# malformed input ----------------------------------------------------------------------


def _tool_call(call_id: object = "c1", arguments: object = "{}", name: object = "f") -> dict[str, Any]:
    raw: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        raw["id"] = call_id
    return raw


OPENAI_MALFORMED: list[tuple[str, list[Any], str]] = [
    (
        "unknown role",
        [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
        "messages[1].role",
    ),
    ("missing role", [{"content": "a"}], "messages[0].role"),
    ("role of the wrong type", [{"role": ["user"], "content": "a"}], "messages[0].role"),
    (
        "tool without tool_call_id",
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "tool", "content": "c"},
        ],
        "messages[2].tool_call_id",
    ),
    (
        "tool call without id",
        [{"role": "assistant", "content": None, "tool_calls": [_tool_call(call_id=None)]}],
        "messages[0].tool_calls[0].id",
    ),
    (
        "arguments not JSON",
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": None, "tool_calls": [_tool_call(arguments="{city: Paris}")]},
        ],
        "messages[2].tool_calls[0].function.arguments",
    ),
    (
        "arguments not a string",
        [{"role": "assistant", "content": None, "tool_calls": [_tool_call(), _tool_call("c2", {"a": 1})]}],
        "messages[0].tool_calls[1].function.arguments",
    ),
    (
        "tool call without name",
        [{"role": "assistant", "content": None, "tool_calls": [_tool_call(name="")]}],
        "messages[0].tool_calls[0].function.name",
    ),
    (
        "tool call without function",
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}],
        "messages[0].tool_calls[0].function",
    ),
    ("tool call not an object", [{"role": "assistant", "tool_calls": ["c1"]}], "messages[0].tool_calls[0]"),
    ("tool_calls not a list", [{"role": "assistant", "tool_calls": "c1"}], "messages[0].tool_calls"),
    ("tool_calls zero", [{"role": "assistant", "tool_calls": 0}], "messages[0].tool_calls"),
    (
        "NaN in arguments",
        [{"role": "assistant", "content": None, "tool_calls": [_tool_call(arguments='{"x": NaN}')]}],
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("message not an object", [["user", "hi"]], "messages[0]"),
    ("content of the wrong type", [{"role": "user", "content": 42}], "messages[0].content"),
    (
        "tool_call_id on a user",
        [{"role": "user", "content": "a", "tool_call_id": "c"}],
        "messages[0].tool_call_id",
    ),
    (
        "duplicate call ids",
        [{"role": "assistant", "content": None, "tool_calls": [_tool_call(), _tool_call()]}],
        "messages[0].tool_calls",
    ),
]


@pytest.mark.parametrize(
    ("payload", "field"), [c[1:] for c in OPENAI_MALFORMED], ids=[c[0] for c in OPENAI_MALFORMED]
)
def test_malformed_openai_input_names_the_field(payload: list[Any], field: str) -> None:
    """from_openai rejects malformed input with InvalidMessageError whose field is the culprit's path."""
    with pytest.raises(InvalidMessageError) as info:
        from_openai(payload)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


ANTHROPIC_MALFORMED: list[tuple[str, list[Any], str]] = [
    (
        "tool_result content of the wrong type",
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}]}],
        "messages[0].content[0].content",
    ),
    (
        "is_error not a boolean",
        [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "", "is_error": "yes"}],
            }
        ],
        "messages[0].content[0].is_error",
    ),
    (
        "unknown role",
        [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
        "messages[1].role",
    ),
    ("missing content", [{"role": "user"}], "messages[0].content"),
    ("content of the wrong type", [{"role": "user", "content": 3}], "messages[0].content"),
    ("turn not an object", ["hello"], "messages[0]"),
    ("block not an object", [{"role": "user", "content": ["hello"]}], "messages[0].content[0]"),
    (
        "tool_use without id",
        [
            {"role": "user", "content": "a"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "x"}, {"type": "tool_use", "name": "f", "input": {}}],
            },
        ],
        "messages[1].content[1].id",
    ),
    (
        "tool_use without name",
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}],
        "messages[0].content[0].name",
    ),
    (
        "tool_use input not JSON",
        [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"s": {1, 2}}}],
            }
        ],
        "messages[0].content[0].input",
    ),
    (
        "tool_result with a numeric tool_use_id",
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 7, "content": "x"}]}],
        "messages[0].content[0].tool_use_id",
    ),
    (
        "tool_use input with NaN",
        [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"x": NAN}}],
            }
        ],
        "messages[0].content[0].input",
    ),
    (
        "tool_result without tool_use_id",
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "tool_result", "content": "x"}],
            }
        ],
        "messages[0].content[1].tool_use_id",
    ),
]


@pytest.mark.parametrize(
    ("payload", "field"), [c[1:] for c in ANTHROPIC_MALFORMED], ids=[c[0] for c in ANTHROPIC_MALFORMED]
)
def test_malformed_anthropic_input_names_the_field(payload: list[Any], field: str) -> None:
    """from_anthropic rejects malformed input with InvalidMessageError whose field is the culprit's path."""
    with pytest.raises(InvalidMessageError) as info:
        from_anthropic(payload)
    assert info.value.field == field


@pytest.mark.parametrize("payload", [5, "hello", {"role": "user", "content": "hi"}, None])
def test_a_payload_that_is_not_a_list_is_rejected_as_messages(payload: Any) -> None:
    """A number, a string or a single object as payload is rejected as messages, in both formats."""
    for parse in (from_openai, from_anthropic):
        with pytest.raises(InvalidMessageError) as info:
            parse(payload)
        assert info.value.field == "messages"
        assert type(payload).__name__ in info.value.reason


@pytest.mark.parametrize("system", [5, {"type": "text", "text": "be brief"}])
def test_a_system_parameter_of_the_wrong_type_names_the_field(system: Any) -> None:
    """A system parameter that is neither a string nor a list of blocks is rejected as system."""
    with pytest.raises(InvalidMessageError) as info:
        from_anthropic([], system=system)
    assert info.value.field == "system"


def test_a_malformed_anthropic_system_block_names_the_field() -> None:
    """A system block that is not an object is rejected as system[n]."""
    with pytest.raises(InvalidMessageError) as info:
        from_anthropic([], system=[{"type": "text", "text": "ok"}, "loose"])  # type: ignore[list-item]
    assert info.value.field == "system[1]"


# properties -----------------------------------------------------------------------------

texts = st.text(max_size=20)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(ids, json_values, max_size=3)
text_part = st.builds(lambda t: {"type": "text", "text": t}, texts)
image_part = st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, texts)
openai_content = st.none() | texts | st.lists(text_part | image_part, max_size=3)


@st.composite
def openai_calls(draw: st.DrawFn, call_id: str) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "id": call_id,
        "type": "function",
        "function": {"name": draw(ids), "arguments": json.dumps(draw(arguments))},
    }
    if draw(st.integers(0, 3)) == 0:
        raw["extra_content"] = draw(arguments)
    if draw(st.integers(0, 3)) == 0:
        raw["function"]["strict"] = draw(st.booleans())
    return raw


@st.composite
def openai_messages(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    item: dict[str, Any] = {"role": role, "content": draw(openai_content)}
    if draw(st.booleans()):
        item["name"] = draw(ids)
    if role == "assistant" and draw(st.booleans()):
        call_ids = draw(st.lists(ids, min_size=0, max_size=3, unique=True))
        item["tool_calls"] = [draw(openai_calls(call_id)) for call_id in call_ids]
        if call_ids and draw(st.booleans()):
            del item["content"]
    if role == "tool":
        item["tool_call_id"] = draw(ids)
    if draw(st.integers(0, 4)) == 0:
        item["refusal"] = draw(st.none() | texts)
    return item


@settings(max_examples=150, deadline=None)
@given(st.lists(openai_messages(), max_size=8))
def test_any_openai_payload_round_trips(payload: list[dict[str, Any]]) -> None:
    """Every well-formed OpenAI payload survives OpenAI -> Message -> OpenAI unchanged."""
    assert to_openai(from_openai(payload)) == payload


block_text = st.builds(lambda t: {"type": "text", "text": t}, texts)
block_thinking = st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "c2ln"}, texts)
block_image = st.builds(
    lambda d: {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}}, ids
)


@st.composite
def tool_results(draw: st.DrawFn) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": draw(ids),
        "content": draw(texts | st.lists(block_text | block_image, max_size=2)),
    }
    if draw(st.booleans()):
        block["is_error"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        block["cache_control"] = {"type": "ephemeral"}
    if draw(st.integers(0, 3)) == 0:
        del block["content"]
    return block


@st.composite
def anthropic_turn(draw: st.DrawFn, role: str) -> dict[str, Any]:
    if draw(st.integers(0, 3)) == 0:
        return {"role": role, "content": draw(texts)}
    if role == "user":
        blocks = draw(st.lists(block_text | block_image | tool_results(), max_size=4))
    else:
        call_ids = draw(st.lists(ids, max_size=3, unique=True))
        uses: list[dict[str, Any]] = [
            {"type": "tool_use", "id": i, "name": draw(ids), "input": draw(arguments)} for i in call_ids
        ]
        for use in uses:
            if draw(st.integers(0, 3)) == 0:
                use["cache_control"] = {"type": "ephemeral"}
        blocks = draw(st.lists(block_thinking | block_text, max_size=3)) + uses
        if draw(st.integers(0, 2)) == 0:  # thinking and text usually come first, but not always
            blocks = draw(st.permutations(blocks))
    return {"role": role, "content": blocks}


@st.composite
def anthropic_payloads(draw: st.DrawFn) -> tuple[Any, list[dict[str, Any]]]:
    first = draw(st.sampled_from(["user", "assistant"]))
    roles = [first, "assistant" if first == "user" else "user"]
    turns = [draw(anthropic_turn(roles[i % 2])) for i in range(draw(st.integers(0, 6)))]
    system = draw(st.none() | texts | st.lists(block_text, max_size=2))
    return system, turns


@settings(max_examples=150, deadline=None)
@given(anthropic_payloads())
def test_any_anthropic_payload_round_trips(payload: tuple[Any, list[dict[str, Any]]]) -> None:
    """Every well-formed, role-alternating Anthropic payload survives Anthropic -> Message -> Anthropic."""
    system, turns = payload
    assert to_anthropic(from_anthropic(turns, system=system)) == (system, turns)


@settings(max_examples=100, deadline=None)
@given(st.lists(openai_messages(), max_size=8))
def test_any_messages_round_trip_through_openai(payload: list[dict[str, Any]]) -> None:
    """Message -> OpenAI -> Message gives equal messages for every message OpenAI can carry."""
    messages = from_openai(payload)
    assert from_openai(to_openai(messages)) == messages
