"""Test doubles that ship with contextfold: a scripted agent model.

``ScriptedModel`` plays a list of assistant replies, one per call, and records
exactly what it was sent, so a test (or an example) can drive a ``StepLoop``
without a provider and assert on the requests the agent made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from ._messages import Message, Role, ToolCall

__all__ = ["ScriptedModel", "replies", "tool_step"]

Script = Sequence[Message] | Callable[[list[Message]], Message]


class ScriptedModel:
    """A fake agent model: replies from a script, records every request.

    ``script`` is either a list of replies played in order, or a function from
    the request's messages to the reply. Use the instance itself as the
    blocking ``llm`` and :meth:`stream` as the streaming one.
    """

    def __init__(self, script: Script, *, chunk_size: int = 8) -> None:
        self._script = script
        self._position = 0
        self.chunk_size = chunk_size
        self.requests: list[list[Message]] = []

    def _next(self, messages: list[Message]) -> Message:
        self.requests.append(list(messages))
        if callable(self._script):
            reply = self._script(list(messages))
        else:
            if self._position >= len(self._script):
                raise IndexError(
                    f"ScriptedModel ran out of replies after {len(self._script)} calls; add more"
                )
            reply = self._script[self._position]
            self._position += 1
        if reply.role is not Role.ASSISTANT:
            raise ValueError(f"scripted replies must be assistant messages, got {reply.role}")
        return reply

    async def __call__(self, messages: list[Message]) -> Message:
        return self._next(messages)

    async def stream(self, messages: list[Message]) -> AsyncIterator[str | ToolCall]:
        """The next reply as text deltas of ``chunk_size`` characters, then its tool calls."""
        reply = self._next(messages)
        text = reply.text
        for start in range(0, len(text), self.chunk_size):
            yield text[start : start + self.chunk_size]
        for call in reply.tool_calls:
            yield call

    @property
    def calls(self) -> int:
        return len(self.requests)


def tool_step(name: str, arguments: str, call_id: str, text: str = "") -> Message:
    """An assistant reply that calls one tool."""
    return Message.assistant(text or None, tool_calls=[ToolCall(id=call_id, name=name, arguments=arguments)])


def replies(*texts: str) -> list[Message]:
    """Plain assistant replies."""
    return [Message.assistant(text) for text in texts]
