"""Images in CompactingSession's items: counted as images, never cut as text, sent and handed back whole.

The Agents SDK runs against a fake Responses API on 127.0.0.1, whose
requests carry the items as the session gives them.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from contextfold import Compactor, Message, Role, RunOptions, SummarizeOptions
from contextfold.stores import MemoryStore
from contextfold.summarizers._parts import segments

from .scenario import COUNTER, MODEL, codes_summarizer

pytest.importorskip("agents")

from agents import (
    Agent,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    SQLiteSession,
    ToolOutputImage,
    function_tool,
)
from openai import AsyncOpenAI

from contextfold.integrations.openai_agents import CompactingSession, from_items


def png(width: int, height: int, size: int) -> str:
    """A ``data:`` URL of about ``size`` bytes whose PNG header says ``width`` x ``height``."""
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    chunk = (
        struct.pack(">I", len(header)) + b"IHDR" + header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    )
    data = b"\x89PNG\r\n\x1a\n" + chunk + bytes(range(256)) * (size // 256)
    return "data:image/png;base64," + base64.b64encode(data).decode()


SHOT = png(1024, 1024, 200_000)
"""A 200 KB screenshot, 266,000 base64 characters: 765 tokens by OpenAI's tile rule (2 x 2 tiles)."""
OPTIONS = RunOptions(
    max_history_tokens=2_400,
    compaction=SummarizeOptions(trigger_token_budget=600, max_tool_output_tokens=500),
)
"""Every check after the screenshot compacts (nothing is old enough to fold), and a tool output over 500
tokens is cut: the image alone is over that."""


def as_chat_image(url: str) -> Message:
    """The image as a Chat Completions user message: what contextfold counts by the image rule."""
    return Message(role=Role.USER, content=[{"type": "image_url", "image_url": {"url": url}}])


@function_tool
def screenshot() -> ToolOutputImage:
    """Take a screenshot."""
    return ToolOutputImage(image_url=SHOT)


class FakeResponses:
    """A Responses-API model: takes a screenshot when asked to, else says what it was sent last.

    Records each request's ``input``.
    """

    def __init__(self) -> None:
        self.inputs: list[list[dict[str, Any]]] = []

    def __call__(self, request: Request) -> Response:
        body = json.loads(request.get_data(as_text=True))
        given: list[dict[str, Any]] = body["input"]
        self.inputs.append(given)
        last = given[-1]
        n = len(self.inputs)
        output: dict[str, Any]
        if last.get("role") == "user" and last.get("content") == "take a shot":
            output = {
                "type": "function_call",
                "id": f"fc_{n}",
                "call_id": f"call_{n}",
                "name": "screenshot",
                "arguments": "{}",
                "status": "completed",
            }
        else:
            text = f"saw {last.get('type') or last.get('role')}"
            output = {
                "type": "message",
                "id": f"msg_{n}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        response = {
            "id": f"resp_{n}",
            "object": "response",
            "created_at": 1,
            "model": MODEL,
            "status": "completed",
            "output": [output],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 1,
                "output_tokens": 1,
                "total_tokens": 2,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
        return Response(json.dumps(response), content_type="application/json")


def serve(server: HTTPServer) -> FakeResponses:
    server.clear()
    model = FakeResponses()
    server.expect_request("/v1/responses", method="POST").respond_with_handler(model)
    return model


def make_agent(server: HTTPServer) -> Agent[Any]:
    client = AsyncOpenAI(base_url=server.url_for("/v1"), api_key="sk-test", max_retries=0)
    return Agent(
        name="eyes",
        instructions="Look when asked.",
        tools=[screenshot],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
    )


async def run(session: Any, server: HTTPServer, inputs: list[Any]) -> FakeResponses:
    """Each input as a run of its own, the session's filter on when it is a CompactingSession."""
    model = serve(server)
    bot = make_agent(server)
    per_call = session.model_input_filter if isinstance(session, CompactingSession) else None
    config = RunConfig(tracing_disabled=True, call_model_input_filter=per_call)
    for given in inputs:
        await Runner.run(bot, given, session=session, run_config=config)
    return model


def outputs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in items if item.get("type") == "function_call_output"]


async def reference_run(server: HTTPServer) -> tuple[FakeResponses, list[dict[str, Any]]]:
    """Two runs with the SDK's own SQLiteSession: the requests it sends and the items it keeps."""
    reference = SQLiteSession("reference")
    model = await run(reference, server, ["take a shot", "and now?"])
    return model, await reference.get_items()


def compacting(store: MemoryStore) -> CompactingSession:
    return CompactingSession(
        "s", Compactor(store, options=OPTIONS, summarizer=codes_summarizer(), counter=COUNTER)
    )


async def test_an_image_a_tool_returns_is_counted_by_the_image_rule(httpserver: HTTPServer) -> None:
    """A ToolOutputImage's output costs what its image costs, not its base64 as text, and is shown as one."""
    _, given = await reference_run(httpserver)
    [tool] = [m for m in from_items(given)[0] if m.role is Role.TOOL]
    assert COUNTER.count(tool) == COUNTER.count(as_chat_image(SHOT)) == 765
    assert segments(tool) == [(False, "[image: inline image/png, 1024x1024, 195 KB]")]
    async with MemoryStore() as store:
        await run(compacting(store), httpserver, ["take a shot", "and now?"])
        assert 765 < (await store.stats("s")).total_tokens < 900  # not the 66,000 tokens of its base64


async def test_an_image_a_tool_returns_is_sent_and_handed_back_whole(httpserver: HTTPServer) -> None:
    """Over max_tool_output_tokens, an image output is not cut: requests and get_items() hold it as given."""
    expected, given = await reference_run(httpserver)
    [shot] = outputs(given)
    assert shot["output"] == [{"type": "input_image", "image_url": SHOT}]
    async with MemoryStore() as store:
        session = compacting(store)
        model = await run(session, httpserver, ["take a shot", "and now?"])
        items = await session.get_items()
    assert "cut by contextfold" not in json.dumps(model.inputs)
    assert items == given
    assert len(model.inputs) == len(expected.inputs) == 3
    for request, reference_request in zip(model.inputs[1:], expected.inputs[1:], strict=True):
        assert outputs(request) == outputs(reference_request) == [shot]


async def test_an_image_in_a_user_message_is_counted_and_the_item_kept_whole(
    httpserver: HTTPServer,
) -> None:
    """A user item's input_image costs what the same image costs in a Chat Completions message."""
    question = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "what is this"},
            {"type": "input_image", "image_url": SHOT, "detail": "high"},
        ],
    }
    [message], _ = from_items([question])
    image_only = COUNTER.count(as_chat_image(SHOT))
    assert COUNTER.count(message) >= image_only == 765
    assert segments(message) == [
        (True, "what is this"),
        (False, "[image: inline image/png, 1024x1024, 195 KB]"),
    ]

    async with MemoryStore() as store:
        never_folds = RunOptions(compaction=SummarizeOptions(trigger_token_budget=100_000))
        session = CompactingSession("s", Compactor(store, options=never_folds, counter=COUNTER))
        model = await run(session, httpserver, [[question]])
        assert (await store.stats("s")).total_tokens >= image_only
        items = await session.get_items()
    assert items[0] == question
    assert model.inputs[0][0]["content"] == question["content"]


async def test_a_tool_output_cut_to_fit_keeps_its_image() -> None:
    """Text and an image over max_tool_output_tokens come back with the text cut and the image whole."""
    image = {"type": "input_image", "image_url": SHOT}
    items = [
        {"role": "user", "content": "take a shot"},
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "log line\n" * 400}, image],
        },
    ]
    async with MemoryStore() as store:
        session = compacting(store)
        await session.add_items(items)
        [*_, output] = await session.get_items()
    assert output["type"] == "function_call_output" and output["call_id"] == "c1"
    text, kept = output["output"]
    assert kept == image
    assert text["type"] == "input_text" and "cut by contextfold" in text["text"]
    assert len(text["text"]) < len("log line\n" * 400)
