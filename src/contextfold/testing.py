"""Test doubles that ship with contextfold: a scripted agent model and a realistic session.

``ScriptedModel`` plays a list of assistant replies, one per call, and records
exactly what it was sent, so a test (or an example) can drive a ``StepLoop``
without a provider and assert on the requests the agent made.
``agent_session`` makes the messages of a long tool-using session, to try
compaction settings (or measure them) on traffic shaped like a real agent's.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable, Sequence

from ._messages import Message, Role, ToolCall

__all__ = ["ScriptedModel", "agent_session", "replies", "tool_step"]

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


_AREAS = ("billing", "auth", "search", "ingest", "export", "scheduler", "gateway", "ledger")


def _tool_output(rng: random.Random, name: str, area: str, size: int) -> str:
    """About ``size`` characters of what the tool would print: source, search hits or a test log."""
    lines: list[str] = []
    while sum(len(line) + 1 for line in lines) < size:
        n = len(lines)
        if name == "read_file":
            lines.append(
                f"def {area}_step_{n}(ctx, retries={rng.randint(1, 5)}):  # id {rng.getrandbits(32):08x}"
            )
        elif name == "search":
            lines.append(
                f"src/{area}/core.py:{rng.randint(1, 900)}: {area}_handler(ctx, item_{rng.randint(1, 999)})"
            )
        else:
            lines.append(f"tests/test_{area}.py::test_case_{n} PASSED in 0.{rng.randint(10, 99)}s")
    return "\n".join(lines)[:size]


def agent_session(
    count: int, *, seed: int = 0, min_output: int = 200, max_output: int = 4_000
) -> list[Message]:
    """The first ``count`` messages of a coding agent's session: tasks, tool calls, tool results, answers.

    Deterministic for a seed. Tool results are ``min_output``..``max_output``
    characters; each task takes one to four tool calls and ends with an answer.
    """
    rng = random.Random(seed)
    messages = [Message.system("You are a careful coding agent. Use the tools; never guess file contents.")]
    task = 0
    while len(messages) < count:
        task += 1
        area = rng.choice(_AREAS)
        messages.append(
            Message.user(f"CF-{task:04d}: please fix the flaky retry logic in src/{area}/core.py.")
        )
        for call_number in range(rng.randint(1, 4)):
            name = rng.choice(("read_file", "search", "run_tests"))
            call = ToolCall(
                id=f"call_{task}_{call_number}", name=name, arguments=json.dumps({"path": f"src/{area}"})
            )
            messages.append(Message.assistant(f"Next I will {name.replace('_', ' ')}.", tool_calls=[call]))
            output = _tool_output(rng, name, area, rng.randint(min_output, max_output))
            messages.append(Message.tool(call.id, output))
        messages.append(
            Message.assistant(
                f"Done with CF-{task:04d}: the retry in src/{area}/core.py now backs off; tests pass."
            )
        )
    return messages[:count]
