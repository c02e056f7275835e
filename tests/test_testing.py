"""contextfold.testing: the scripted agent model is a usable, honest test double."""

from __future__ import annotations

import pytest

from contextfold import Message, ToolCall
from contextfold.testing import ScriptedModel, replies, tool_step


async def test_scripted_model_plays_replies_in_order_and_records_requests() -> None:
    """Each call returns the next scripted reply and keeps a copy of what it was sent."""
    model = ScriptedModel(replies("one", "two"))
    sent = [Message.user("hi")]
    assert (await model(sent)).text == "one"
    sent.append(Message.user("again"))
    assert (await model(sent)).text == "two"
    assert model.calls == 2
    assert [len(r) for r in model.requests] == [1, 2]


async def test_running_out_of_replies_says_how_many_there_were() -> None:
    """A call past the end of the script raises IndexError naming the script's length."""
    model = ScriptedModel(replies("only"))
    await model([])
    with pytest.raises(IndexError, match="after 1 calls"):
        await model([])


async def test_scripted_replies_must_come_from_the_assistant() -> None:
    """A scripted reply with another role is refused."""
    with pytest.raises(ValueError, match="assistant"):
        await ScriptedModel([Message.user("not me")])([])


async def test_stream_yields_text_in_chunks_then_tool_calls() -> None:
    """stream() splits the reply's text into chunk_size pieces and ends with its tool calls."""
    reply = tool_step("search", '{"q": "x"}', call_id="c1", text="abcdefghij")
    chunks = [c async for c in ScriptedModel([reply], chunk_size=4).stream([])]
    assert chunks[:3] == ["abcd", "efgh", "ij"]
    assert chunks[3] == ToolCall(id="c1", name="search", arguments='{"q": "x"}')


async def test_a_function_script_sees_the_request() -> None:
    """A function script decides each reply from the messages it is sent."""
    model = ScriptedModel(lambda messages: Message.assistant(f"{len(messages)} messages"))
    assert (await model([Message.user("a"), Message.user("b")])).text == "2 messages"
