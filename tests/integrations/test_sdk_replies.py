"""Replies the SDK wrappers record as they came and send back as the provider accepts (127.0.0.1)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from contextfold import Compactor, Message, StepLoop, conversation
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
