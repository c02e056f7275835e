"""The one tool-using session every adapter is run through, and the checks made on what the model saw.

Turn ``n``: the user asks about record ``n``; the model calls ``lookup`` with
``{"n": n}``; the tool answers with the record's code (``code-000n``) and
padding; the model acknowledges. Forty turns under a small budget must fold,
and the codes of early turns must still reach the model through the summary.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint
from werkzeug import Request, Response

from contextfold import (
    Compactor,
    FunctionSummarizer,
    Message,
    Role,
    RunOptions,
    SummarizeOptions,
    ToolCall,
    conversation,
)
from contextfold._messages import from_anthropic, from_openai
from contextfold.episodes import EpisodeRecord, SummaryCheckpoint
from contextfold.stores import ContextWindow, MemoryStore
from contextfold.tokens import ApproximateCounter

TURNS = 40
BUDGET = 1_000
OPTIONS = RunOptions(
    max_history_tokens=4_000,
    compaction=SummarizeOptions(trigger_token_budget=BUDGET, max_summary_tokens=300, min_recent_messages=4),
)
CODE = re.compile(r"code-\d{4}")
COUNTER = ApproximateCounter()


def question(n: int) -> str:
    return f"What does record {n} say?"


def record_text(n: int) -> str:
    return f"record {n}: code-{n:04d}. " + "padding " * 40


def answer(n: int) -> str:
    return f"Noted record {n}."


async def lookup(n: int) -> str:
    """Look a record up by its number."""
    return record_text(n)


def turn_of(text: str) -> int:
    found = re.search(r"record (\d+)", text)
    assert found, f"no record number in {text!r}"
    return int(found.group(1))


def agent(messages: Sequence[Message]) -> Message:
    """The scripted model: look the asked record up, then acknowledge it."""
    last = messages[-1]
    if last.role is Role.TOOL:
        return Message.assistant(answer(turn_of(last.text)))
    n = turn_of(last.text)
    return Message.assistant(
        None, tool_calls=[ToolCall(id=f"call_{n}", name="lookup", arguments=f'{{"n": {n}}}')]
    )


def summary_of(text: str) -> str:
    """What the fake summarizers write: every record code in ``text``, once, in order."""
    return "Codes seen: " + " ".join(dict.fromkeys(CODE.findall(text)))


async def _summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
    return summary_of((previous or "") + " ".join(m.text for m in messages))


def codes_summarizer() -> FunctionSummarizer:
    return FunctionSummarizer(_summarize, model="codes")


def compactor(store: Any, summarizer: Any = None) -> Compactor:
    return Compactor(store, options=OPTIONS, summarizer=summarizer or codes_summarizer(), counter=COUNTER)


def transcript(turns: range) -> list[str]:
    """The texts of the messages turns ``turns`` put in the log, in order (tool calls as their call id)."""
    out: list[str] = []
    for n in turns:
        out += [question(n), f"call_{n}", record_text(n), answer(n)]
    return out


def text_of(message: Message) -> str:
    return message.text or ",".join(call.id for call in message.tool_calls)


async def check_log(c: Compactor, thread: str, turns: range, *, system: str | None = None) -> None:
    """The log holds every message of the session exactly once, in order, and at least one fold."""
    records = [record async for record in c.episodic.replay(thread)]
    texts = [text_of(m) for m in conversation(records)]
    expected = ([system] if system else []) + transcript(turns)
    assert texts == expected, [t[:30] for t in texts]
    assert any(isinstance(r.episode, SummaryCheckpoint) for r in records)


def check_requests(requests: Sequence[Sequence[Message]]) -> None:
    """Every request is whole (no orphaned call or result); the last carries the summary, under budget."""
    assert requests
    for request in requests:
        calls = [call.id for m in request for call in m.tool_calls]
        results = [m.tool_call_id for m in request if m.role is Role.TOOL]
        assert sorted(calls) == sorted(results), f"orphaned call or result in {[text_of(m) for m in request]}"
        for index, message in enumerate(request):
            if message.role is Role.TOOL:
                assert any(message.tool_call_id in {c.id for c in m.tool_calls} for m in request[:index]), (
                    "a tool result comes before its call"
                )
    last = list(requests[-1])
    summaries = [m for m in last if "Codes seen:" in m.text]
    assert len(summaries) == 1, "the last request carries exactly one summary"
    assert "code-0000" in summaries[0].text, "the first turn's fact reaches the model through the summary"
    assert question(0) not in [m.text for m in last], "the first turn itself was folded away"
    assert sum(COUNTER.count(m) for m in last) <= BUDGET


def check_requests_whole(requests: Sequence[Sequence[Message]]) -> None:
    """Every request holds each tool call's result and each result's call, whatever the budget."""
    for request in requests:
        calls = sorted(call.id for m in request for call in m.tool_calls)
        assert calls == sorted(m.tool_call_id for m in request if m.tool_call_id)


@dataclass
class FakeProvider:
    """A chat model served over HTTP on 127.0.0.1, in OpenAI or Anthropic form, playing :func:`agent`.

    Records every request's messages as contextfold messages in ``requests``.
    """

    api: str  # "openai" or "anthropic"
    script: Callable[[Sequence[Message]], Message] = agent
    requests: list[list[Message]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request: Request) -> Response:
        body = json.loads(request.get_data(as_text=True))
        if self.api == "openai":
            messages = from_openai(body["messages"])
        else:
            messages = from_anthropic(body["messages"], system=body.get("system"))
        with self._lock:
            self.requests.append(messages)
            self.bodies.append(body)
        reply = self.script(messages)
        usage = (sum(COUNTER.count(m) for m in messages), COUNTER.count(reply))
        if self.api == "openai":
            chunks = _openai_stream(reply, usage) if body.get("stream") else None
            data: Any = _openai_completion(reply, usage)
        else:
            chunks = _anthropic_stream(reply, usage) if body.get("stream") else None
            data = _anthropic_message(reply, usage)
        if chunks is not None:
            return Response(chunks, content_type="text/event-stream")
        return Response(json.dumps(data), content_type="application/json")


MODEL = "fake-model-1"


def _openai_calls(reply: Message) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in reply.tool_calls
    ]


def _openai_completion(reply: Message, usage: tuple[int, int]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = _openai_calls(reply)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.tool_calls else "stop",
            }
        ],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }


def _sse(events: list[tuple[str | None, dict[str, Any] | str]]) -> Iterator[str]:
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        yield f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _openai_stream(reply: Message, usage: tuple[int, int]) -> Iterator[str]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    events: list[tuple[str | None, dict[str, Any] | str]] = []
    text = reply.text
    for start in range(0, len(text), 5):
        delta = {"content": text[start : start + 5]}
        events.append((None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
    for index, call in enumerate(_openai_calls(reply)):
        delta = {"tool_calls": [{"index": index, **call}]}
        events.append((None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
    finish = "tool_calls" if reply.tool_calls else "stop"
    events.append((None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    counts = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    events.append((None, {**base, "choices": [], "usage": counts}))
    events.append((None, "[DONE]"))
    return _sse(events)


def _anthropic_blocks(reply: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
    blocks += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.parsed_arguments()}
        for c in reply.tool_calls
    ]
    return blocks


def _anthropic_message(reply: Message, usage: tuple[int, int]) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": _anthropic_blocks(reply),
        "stop_reason": "tool_use" if reply.tool_calls else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


def _anthropic_stream(reply: Message, usage: tuple[int, int]) -> Iterator[str]:
    start = _anthropic_message(reply, (usage[0], 0))
    start["content"] = []
    events: list[tuple[str | None, dict[str, Any] | str]] = [
        ("message_start", {"type": "message_start", "message": start})
    ]
    for index, block in enumerate(_anthropic_blocks(reply)):
        if block["type"] == "text":
            events.append(
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            for cut in range(0, len(block["text"]), 5):
                delta = {"type": "text_delta", "text": block["text"][cut : cut + 5]}
                events.append(
                    ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                )
        else:
            opening = {**block, "input": {}}
            events.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": opening},
                )
            )
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    stop = {"stop_reason": start["stop_reason"], "stop_sequence": None}
    events.append(
        ("message_delta", {"type": "message_delta", "delta": stop, "usage": {"output_tokens": usage[1]}})
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return _sse(events)


class CountingStore(MemoryStore):
    """The memory store, counting its reads of the working context and of the log."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    async def tail(self, thread: str, *, after_seq: int) -> ContextWindow:
        self.reads["tail"] += 1
        return await super().tail(thread, after_seq=after_seq)

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        self.reads["load"] += 1
        return await super().load(thread, max_tokens=max_tokens)

    def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        self.reads["replay"] += 1
        return super().replay(thread, from_seq=from_seq)


class RacingStore(MemoryStore):
    """The memory store, running ``meanwhile`` once after a read of a whole log, before its reader goes on.

    Following an edit reads the conversation between its load of the working
    context and its write: the worst moment for another step of the thread.
    """

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: Callable[[], Awaitable[None]] | None = None

    async def replay(self, thread: str, *, from_seq: int = 0) -> AsyncIterator[EpisodeRecord]:
        async for record in super().replay(thread, from_seq=from_seq):
            yield record
        meanwhile = self.meanwhile
        if from_seq == 0 and meanwhile is not None:
            self.meanwhile = None
            await meanwhile()


def meddle(store: Any, work: Callable[[], Awaitable[None]], group: TaskGroup) -> anyio.Event:
    """Make ``store`` start ``work`` in ``group`` at its ``meanwhile`` point; the event is set once done.

    The store's reader waits for it up to 1,000 turns of the event loop:
    plenty for it to finish on a memory store, unless the thread's lock holds
    it back.
    """
    done = anyio.Event()

    async def run() -> None:
        await work()
        done.set()

    async def meanwhile() -> None:
        group.start_soon(run)
        for _ in range(1_000):
            if done.is_set():
                return
            await checkpoint()

    store.meanwhile = meanwhile
    return done


def race(store: RacingStore, c: Compactor, thread: str, group: TaskGroup) -> anyio.Event:
    """Make ``store`` start a step of ``thread`` (a sync adding "meanwhile") in ``group`` at a whole read."""

    async def step() -> None:
        await c.sync(thread, [Message.user("meanwhile")], ids=["meanwhile"])

    return meddle(store, step, group)


async def agreeing(store: Any, thread: str) -> list[str]:
    """The working context's texts, once known to be the conversation a replay of the log gives."""
    replayed = [text_of(m) for m in conversation([r async for r in store.replay(thread)])]
    context = [text_of(m) for m in (await store.load(thread)).plain]
    assert replayed == context, f"the log replays {replayed}, the context holds {context}"
    return context


@contextmanager
def refusing_withdrawals(path: Path) -> Iterator[None]:
    """For the block, the SQLite file at ``path`` refuses each episode withdrawing part of a conversation.

    That is what an edit's log half records: a failure injected between its two halves.
    """
    _execute(
        path,
        "CREATE TRIGGER fail_withdrawal BEFORE INSERT ON episodes "
        "WHEN NEW.kind IN ('messages_retracted', 'history_cleared') "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
    )
    try:
        yield
    finally:
        _execute(path, "DROP TRIGGER fail_withdrawal")


def _execute(path: Path, statement: str) -> None:
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute(statement)
    finally:
        conn.close()
