"""An ``AsyncOpenAI`` client as a contextfold model callable (``StepLoop.run`` and ``stream``).

::

    llm = chat_llm(AsyncOpenAI(), "gpt-4o-mini", tools=tools)
    await loop.run(thread, "hi", llm=llm, tools=tools)          # blocking
    async for event in loop.stream(thread, "hi", llm=llm.stream, tools=tools): ...

Each reply is a :class:`~contextfold._loop.Reply` carrying the model that
answered and its token usage, which the step loop records in the log, as
the API returned it (a streamed reply as the blocking call would have). Later
requests send it back as the request schema has it, without ``annotations``.

A stream that ends before its ``finish_reason`` (the server closed it early)
raises ``openai.APIConnectionError``, as a blocking call whose body is cut
does, so the step loop records no part of the reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from .._episodes import Usage
from .._loop import Reply
from .._messages import Message, ToolCall, from_openai, to_openai
from ._tools import Tools, ToolSpec, tool_specs

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["OpenAIChatLLM", "chat_llm"]


def _schema(spec: ToolSpec) -> dict[str, Any]:
    if spec.raw is not None:
        return dict(spec.raw)
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": spec.parameters},
    }


def _usage(usage: Any) -> Usage | None:
    if usage is None:
        return None
    return Usage(input_tokens=usage.prompt_tokens or 0, output_tokens=usage.completion_tokens or 0)


def _sendable(item: dict[str, Any]) -> dict[str, Any]:
    """A message as Chat Completions takes it back; the log keeps the reply as it came.

    A reply's response-only fields are left out (``annotations``, the
    ``audio`` fields but its ``id``): strict servers refuse keys the request
    schema does not have. An assistant message needs ``content`` unless it
    calls tools (or refers to earlier audio), so a refusal or an empty reply
    is sent with ``""``.
    """
    if item.get("role") != "assistant":
        return item
    item = {key: value for key, value in item.items() if key != "annotations"}
    audio = item.get("audio")
    if isinstance(audio, dict) and "id" in audio:
        item["audio"] = {"id": audio["id"]}
    if "content" not in item and not any(item.get(key) for key in ("tool_calls", "function_call", "audio")):
        item["content"] = ""
    return item


class OpenAIChatLLM:
    """Calls Chat Completions with the request's messages and the tool schemas.

    Use the instance as ``llm=`` of ``StepLoop.run`` and :meth:`stream` as
    ``llm=`` of ``StepLoop.stream``.
    """

    def __init__(
        self, client: AsyncOpenAI, model: str, *, tools: Tools | None, create_kwargs: Mapping[str, Any]
    ) -> None:
        self.client = client
        self.model = model
        self.tools = [_schema(spec) for spec in tool_specs(tools)]
        self.create_kwargs = dict(create_kwargs)

    def _request(self, messages: list[Message]) -> dict[str, Any]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": [_sendable(item) for item in to_openai(messages, omit_nulls=True)],
            **self.create_kwargs,
        }
        if self.tools:
            request["tools"] = self.tools
        return request

    async def __call__(self, messages: list[Message]) -> Reply:
        completion = await self.client.chat.completions.create(**self._request(messages))
        [reply] = from_openai([completion.choices[0].message])
        return Reply(reply, model=completion.model, usage=_usage(completion.usage))

    async def stream(self, messages: list[Message]) -> AsyncIterator[str | ToolCall | Reply]:
        """The reply as text deltas, then the whole reply with its model and usage."""
        request = self._request(messages)
        request["stream"] = True
        request.setdefault("stream_options", {"include_usage": True})
        text: list[str] = []
        refusal: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        model: str | None = None
        usage: Usage | None = None
        finished = False
        chunks = await self.client.chat.completions.create(**request)
        async with chunks:
            async for chunk in chunks:
                model = chunk.model or model
                usage = _usage(chunk.usage) or usage
                for choice in chunk.choices:
                    finished = finished or choice.finish_reason is not None
                    delta = choice.delta
                    if delta.content:
                        text.append(delta.content)
                        yield delta.content
                    if delta.refusal:
                        refusal.append(delta.refusal)
                    for part in delta.tool_calls or ():
                        call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] = part.id or call["id"]
                        if part.function is not None:
                            call["name"] += part.function.name or ""
                            call["arguments"] += part.function.arguments or ""
        if not finished:
            from openai import APIConnectionError

            raise APIConnectionError(
                message="the Chat Completions stream ended before a chunk with a finish_reason: the reply "
                f"was cut short ({sum(map(len, text))} characters of text, {len(calls)} tool calls received)",
                request=chunks.response.request,
            )
        # The message a blocking call would have returned, without its unset fields, parsed as that one is.
        message: dict[str, Any] = {"role": "assistant"}
        if text:
            message["content"] = "".join(text)
        if refusal:
            message["refusal"] = "".join(refusal)
        if calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"] or "{}"},
                }
                for _, call in sorted(calls.items())
            ]
        [reply] = from_openai([message])
        yield Reply(reply, model=model, usage=usage)


def chat_llm(
    client: AsyncOpenAI, model: str, *, tools: Tools | None = None, **create_kwargs: Any
) -> OpenAIChatLLM:
    """A model callable over ``client.chat.completions.create``; extra keywords go to every request.

    ``tools`` is the ``{name: fn}`` mapping you give ``StepLoop.run`` (schemas
    are made from the functions' signatures and docstrings), a list of
    functions, or a list of Chat Completions tool dicts sent as they are.
    """
    return OpenAIChatLLM(client, model, tools=tools, create_kwargs=create_kwargs)
