"""An ``AsyncAnthropic`` client as a contextfold model callable (``StepLoop.run`` and ``stream``).

::

    llm = chat_llm(AsyncAnthropic(), "claude-sonnet-4-5", tools=tools)
    await loop.run(thread, "hi", llm=llm, tools=tools)          # blocking
    async for event in loop.stream(thread, "hi", llm=llm.stream, tools=tools): ...

Each reply is a :class:`~contextfold._loop.Reply` carrying the model that
answered and its token usage, which the step loop records in the log. A
reply with no content (an empty ``end_turn``) is recorded, and left out of
later requests, which the Messages API would refuse with it.

A stream that ends before its ``message_stop`` (the server closed it early)
raises ``anthropic.APIConnectionError``, as a blocking call whose body is cut
does, so the step loop records no part of the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from .._episodes import Usage
from .._loop import Reply
from .._messages import Message, Role, ToolCall, from_anthropic, to_anthropic
from ._tools import Tools, ToolSpec, tool_specs

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

__all__ = ["DEFAULT_MAX_TOKENS", "AnthropicChatLLM", "chat_llm"]

DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` of each request unless given (the Messages API requires one)."""


def _schema(spec: ToolSpec) -> dict[str, Any]:
    if spec.raw is not None:
        return dict(spec.raw)
    return {"name": spec.name, "description": spec.description, "input_schema": spec.parameters}


def _usage(usage: Any) -> Usage | None:
    if usage is None:
        return None
    return Usage(input_tokens=usage.input_tokens or 0, output_tokens=usage.output_tokens or 0)


def _is_empty_reply(message: Message) -> bool:
    """An assistant turn with nothing in it: Claude can end a turn so, right after tool results.

    The log keeps it, as it happened; a request leaves it out, as the Messages
    API refuses an empty assistant turn anywhere but last ("all messages must
    have non-empty content").
    """
    return message.role is Role.ASSISTANT and not message.tool_calls and not message.content


class AnthropicChatLLM:
    """Calls the Messages API with the request's messages and the tool schemas.

    Use the instance as ``llm=`` of ``StepLoop.run`` and :meth:`stream` as
    ``llm=`` of ``StepLoop.stream``.
    """

    def __init__(
        self, client: AsyncAnthropic, model: str, *, tools: Tools | None, create_kwargs: Mapping[str, Any]
    ) -> None:
        self.client = client
        self.model = model
        self.tools = [_schema(spec) for spec in tool_specs(tools)]
        self.create_kwargs = {"max_tokens": DEFAULT_MAX_TOKENS, **create_kwargs}

    def _request(self, messages: list[Message]) -> dict[str, Any]:
        system, turns = to_anthropic(message for message in messages if not _is_empty_reply(message))
        request: dict[str, Any] = {"model": self.model, "messages": turns, **self.create_kwargs}
        if system is not None:
            request["system"] = system
        if self.tools:
            request["tools"] = self.tools
        return request

    def _reply(self, response: Any) -> Reply:
        [reply] = from_anthropic([response])
        return Reply(reply, model=response.model, usage=_usage(response.usage))

    async def __call__(self, messages: list[Message]) -> Reply:
        return self._reply(await self.client.messages.create(**self._request(messages)))

    async def stream(self, messages: list[Message]) -> AsyncIterator[str | ToolCall | Reply]:
        """The reply as text deltas, then the whole reply with its model and usage."""
        stopped = False
        text = 0
        async with self.client.messages.stream(**self._request(messages)) as events:
            async for event in events:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += len(event.delta.text)
                    yield event.delta.text
                stopped = stopped or event.type == "message_stop"
            if not stopped:
                from anthropic import APIConnectionError

                raise APIConnectionError(
                    message="the Messages stream ended before its message_stop event: the reply was cut "
                    f"short ({text} characters of text received)",
                    request=events.response.request,
                )
            final = await events.get_final_message()
        yield self._reply(final)


def chat_llm(
    client: AsyncAnthropic, model: str, *, tools: Tools | None = None, **create_kwargs: Any
) -> AnthropicChatLLM:
    """A model callable over ``client.messages.create``; extra keywords go to every request.

    ``tools`` is the ``{name: fn}`` mapping you give ``StepLoop.run`` (schemas
    are made from the functions' signatures and docstrings), a list of
    functions, or a list of Messages API tool dicts sent as they are.
    ``max_tokens`` defaults to :data:`DEFAULT_MAX_TOKENS`.
    """
    return AnthropicChatLLM(client, model, tools=tools, create_kwargs=create_kwargs)
