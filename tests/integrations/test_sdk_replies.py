"""Replies the SDK wrappers record as they came and send back as the provider accepts (127.0.0.1)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from contextfold import Compactor, Message, StepLoop, conversation
from contextfold._messages import to_openai
from contextfold.loop import TextDelta
from contextfold.stores import MemoryStore

from .scenario import MODEL, FakeProvider

pytest.importorskip("openai")
pytest.importorskip("anthropic")


def silent_once(messages: Sequence[Message]) -> Message:
    """Ends its first turn with no content at all, as Claude can after tool results; answers after."""
    return Message.assistant("" if messages[-1].text == "hi" else "Still here.")


class StrictAnthropic(FakeProvider):
    """The fake Anthropic provider, refusing an empty turn before the last as the Messages API does."""

    def __call__(self, request: Request) -> Response:
        body = json.loads(request.get_data(as_text=True))
        for index, turn in enumerate(body["messages"][:-1]):
            if not turn["content"]:
                error = {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "message": f"messages.{index}: all messages must have non-empty content except "
                        "for the optional final assistant message",
                    },
                }
                return Response(json.dumps(error), status=400, content_type="application/json")
        return super().__call__(request)


@pytest.mark.parametrize("streaming", [False, True], ids=["create", "stream"])
async def test_an_empty_anthropic_reply_is_logged_and_left_out_of_later_requests(
    streaming: bool, httpserver: HTTPServer
) -> None:
    """A reply with no content blocks stays in the log, and the next request goes through without it.

    Before, it was sent back as ``{"role": "assistant", "content": []}``, which the API refuses, so the
    thread could not go on.
    """
    from anthropic import AsyncAnthropic

    from contextfold.integrations.anthropic import chat_llm

    provider = StrictAnthropic("anthropic", script=silent_once)
    httpserver.expect_request("/v1/messages", method="POST").respond_with_handler(provider)
    client = AsyncAnthropic(base_url=httpserver.url_for("/"), api_key="sk-test", max_retries=0)
    llm = chat_llm(client, MODEL)
    async with MemoryStore() as store:
        compactor = Compactor(store)
        loop = StepLoop(compactor)
        for question in ("hi", "are you there?"):
            if streaming:
                async for _ in loop.stream("t", question, llm=llm.stream):
                    pass
            else:
                await loop.run("t", question, llm=llm)
        logged = conversation([r async for r in compactor.episodic.replay("t")])
    assert [(m.role.value, m.text) for m in logged] == [
        ("user", "hi"),
        ("assistant", ""),
        ("user", "are you there?"),
        ("assistant", "Still here."),
    ]
    assert provider.bodies[1]["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "are you there?"}],
        }
    ]


REFUSAL = "I can't help with that."


class RefusingOpenAI:
    """Chat Completions on 127.0.0.1: refuses ``hi``, answers anything else, blocking or streamed.

    Replies carry ``annotations`` as OpenAI's do. Like a strict server, it answers 400 to a request
    whose assistant message has a key ``ChatCompletionAssistantMessageParam`` lacks, or no
    ``content`` without tool calls.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: Request) -> Response:
        from openai.types.chat import ChatCompletionAssistantMessageParam

        body = json.loads(request.get_data(as_text=True))
        self.bodies.append(body)
        allowed = ChatCompletionAssistantMessageParam.__annotations__.keys()
        for index, message in enumerate(body["messages"]):
            if message["role"] != "assistant":
                continue
            unknown = message.keys() - allowed
            if unknown or ("content" not in message and "tool_calls" not in message):
                error = {
                    "message": f"messages[{index}]: unknown {sorted(unknown)} or no content",
                    "code": None,
                }
                return Response(json.dumps({"error": error}), status=400, content_type="application/json")
        refuse = body["messages"][-1]["content"] == "hi"
        answer = {"refusal": REFUSAL} if refuse else {"content": "Hello."}
        base = {"id": "chatcmpl-1", "created": 1, "model": MODEL}
        if not body.get("stream"):
            message = {"role": "assistant", "content": None, "refusal": None, "annotations": [], **answer}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            completion = {**base, "object": "chat.completion", "choices": [choice]}
            return Response(json.dumps(completion), content_type="application/json")
        first = {"role": "assistant", "content": None if refuse else "", "refusal": "" if refuse else None}
        deltas = [first, answer, {}]
        chunks = [
            {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None if delta else "stop"}],
            }
            for delta in deltas
        ]
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return Response(events, content_type="text/event-stream")


async def openai_session(httpserver: HTTPServer, streaming: bool) -> tuple[list[Message], RefusingOpenAI]:
    """The log of ``hi`` (refused) then ``again``, over chat_llm's blocking call or its stream."""
    from openai import AsyncOpenAI

    from contextfold.integrations.openai import chat_llm

    server = RefusingOpenAI()
    httpserver.expect_request("/v1/chat/completions", method="POST").respond_with_handler(server)
    client = AsyncOpenAI(base_url=httpserver.url_for("/v1"), api_key="sk-test", max_retries=0)
    llm = chat_llm(client, MODEL)
    async with MemoryStore() as store:
        compactor = Compactor(store)
        loop = StepLoop(compactor)
        for question in ("hi", "again"):
            if streaming:
                async for _ in loop.stream("t", question, llm=llm.stream):
                    pass
            else:
                await loop.run("t", question, llm=llm)
        return conversation([r async for r in compactor.episodic.replay("t")]), server


async def test_a_streamed_refusal_is_logged_as_a_blocking_one(httpserver: HTTPServer) -> None:
    """A refusal that arrives as ``delta.refusal`` is recorded as the blocking call records it.

    Before, the stream ignored it and recorded ``{"role": "assistant"}``: neither content nor refusal.
    """
    blocking, blocking_server = await openai_session(httpserver, streaming=False)
    httpserver.clear()
    streamed, server = await openai_session(httpserver, streaming=True)
    assert to_openai(blocking[1:2]) == [{"role": "assistant", "refusal": REFUSAL, "annotations": []}]
    assert to_openai(streamed[1:2]) == [{"role": "assistant", "refusal": REFUSAL}]
    sent = server.bodies[1]["messages"][1]
    assert (
        sent
        == blocking_server.bodies[1]["messages"][1]
        == {"role": "assistant", "refusal": REFUSAL, "content": ""}
    )


async def test_openai_replies_go_back_without_response_only_fields(httpserver: HTTPServer) -> None:
    """A reply's ``annotations`` stay in the log and out of later requests, which a strict server refuses.

    Before, every later request sent ``"annotations": []`` back in the assistant message, a key the
    Chat Completions request schema does not have.
    """
    logged, server = await openai_session(httpserver, streaming=False)
    assert [m.text for m in logged] == ["hi", "", "again", "Hello."]
    assert to_openai(logged[3:]) == [{"role": "assistant", "content": "Hello.", "annotations": []}]
    assert [m.get("annotations") for m in server.bodies[1]["messages"]] == [None] * 3


async def test_an_audio_reply_goes_back_as_its_id(httpserver: HTTPServer) -> None:
    """A reply's audio is sent back as ``{"id": ...}``, the request's form, and kept whole in the message."""
    from openai import AsyncOpenAI

    from contextfold._messages import from_openai
    from contextfold.integrations.openai import chat_llm

    provider = FakeProvider("openai", script=lambda _: Message.assistant("ok"))
    httpserver.expect_request("/v1/chat/completions", method="POST").respond_with_handler(provider)
    audio = {"id": "audio_1", "data": "UklGRg==", "expires_at": 1, "transcript": "Hello."}
    [reply] = from_openai([{"role": "assistant", "content": None, "audio": audio, "annotations": []}])
    client = AsyncOpenAI(base_url=httpserver.url_for("/v1"), api_key="sk-test", max_retries=0)
    await chat_llm(client, MODEL)([Message.user("hi"), reply, Message.user("again")])
    assert provider.bodies[0]["messages"][1] == {"role": "assistant", "audio": {"id": "audio_1"}}
    assert to_openai([reply])[0]["audio"] == audio


def test_sdk_objects_inside_a_turn_built_by_hand_are_read_as_their_data() -> None:
    """Anthropic's ``{"role": "assistant", "content": response.content}``, an OpenAI reply's ``tool_calls``.

    Whole SDK messages were read, but their parts inside a dict were refused
    ("must be an object, got TextBlock"), although that is how Anthropic's
    own tool-use example builds the next request.
    """
    from anthropic.types import Message as AnthropicMessage
    from openai.types.chat import ChatCompletionMessage

    from contextfold import from_anthropic, from_openai

    response = AnthropicMessage.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "stop_reason": "tool_use",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}},
            ],
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    )
    blocks = [block.model_dump(mode="json", exclude_none=True) for block in response.content]
    nested = from_anthropic([{"role": "assistant", "content": response.content}])
    assert nested == from_anthropic([{"role": "assistant", "content": blocks}])
    assert nested[0].text == "Let me look."
    assert [(c.id, c.name, c.parsed_arguments()) for c in nested[0].tool_calls] == [
        ("toolu_1", "read_file", {"path": "a.py"})
    ]

    reply = ChatCompletionMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
            ],
        }
    )
    assert reply.tool_calls is not None
    calls = [call.model_dump(mode="json", exclude_none=True) for call in reply.tool_calls]
    built = from_openai([{"role": "assistant", "content": None, "tool_calls": reply.tool_calls}])
    assert built == from_openai([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert [(c.id, c.name) for c in built[0].tool_calls] == [("call_1", "read_file")]


ANSWER = "The answer is forty-two."


class CuttingProvider(FakeProvider):
    """The fake provider, whose first stream ends cleanly right before its end marker: a cut reply."""

    cut = False

    def __call__(self, request: Request) -> Response:
        response = super().__call__(request)
        if self.cut or response.mimetype != "text/event-stream":
            return response
        self.cut = True
        marker = '"finish_reason": "' if self.api == "openai" else "event: message_delta"
        events = response.get_data(as_text=True).split("\n\n")
        end = next(index for index, event in enumerate(events) if marker in event)
        return Response("".join(f"{event}\n\n" for event in events[:end]), content_type="text/event-stream")


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_stream_cut_before_its_end_raises_and_records_no_reply(
    api: str, httpserver: HTTPServer
) -> None:
    """A stream that ends before its finish_reason or message_stop raises, and no part of its reply is logged.

    Before, the text received was recorded as the whole reply and the run ended clean. The next, whole
    stream on the thread records as it always did.
    """
    provider = CuttingProvider(api, script=lambda messages: Message.assistant(ANSWER))
    if api == "openai":
        from openai import APIConnectionError, AsyncOpenAI

        from contextfold.integrations.openai import chat_llm

        path, marker = "/v1/chat/completions", "finish_reason"
        client = AsyncOpenAI(base_url=httpserver.url_for("/v1"), api_key="sk-test", max_retries=0)
        llm: Any = chat_llm(client, MODEL)
    else:
        from anthropic import APIConnectionError, AsyncAnthropic

        from contextfold.integrations.anthropic import chat_llm as anthropic_llm

        path, marker = "/v1/messages", "message_stop"
        llm = anthropic_llm(
            AsyncAnthropic(base_url=httpserver.url_for("/"), api_key="sk-test", max_retries=0), MODEL
        )
    httpserver.expect_request(path, method="POST").respond_with_handler(provider)
    async with MemoryStore() as store:
        compactor = Compactor(store)
        loop = StepLoop(compactor)
        events: list[Any] = []
        with pytest.raises(APIConnectionError, match=f"{marker}.*cut short"):
            async for event in loop.stream("t", "question", llm=llm.stream):
                events.append(event)
        assert all(isinstance(event, TextDelta) for event in events)
        assert "".join(event.text for event in events) == ANSWER
        kinds = [r.episode.kind async for r in compactor.episodic.replay("t")]
        assert kinds == ["user_message"]
        assert await compactor.context("t") == [Message.user("question")]
        async for _ in loop.stream("t", "again", llm=llm.stream):
            pass
        logged = conversation([r async for r in compactor.episodic.replay("t")])
    assert [(m.role.value, m.text) for m in logged] == [
        ("user", "question"),
        ("user", "again"),
        ("assistant", ANSWER),
    ]
    assert {m.role.value for m in provider.requests[1]} == {"user"}
