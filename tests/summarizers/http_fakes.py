"""Scripted provider replies for a real HTTP server, and what differs between the two providers.

A :class:`Script` answers each request with its next action and records what
the client sent. The request bodies are checked against the official SDKs'
request types.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from anthropic.types.message_create_params import MessageCreateParamsNonStreaming
from openai.types.chat import ChatCompletionSystemMessageParam, ChatCompletionUserMessageParam
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from pydantic import TypeAdapter
from werkzeug import Request, Response

from contextfold.summarizers import AnthropicSummarizer, OpenAICompatibleSummarizer
from contextfold.summarizers._http import HTTPSummarizer

API_KEY = "sk-test-0123456789abcdefSECRET"
FIXED_NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

Action = Callable[[Request, "Script"], Response]


@dataclass
class Captured:
    """One request as the server received it."""

    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Script:
    """Answers request n with action n; a request past the script gets a 500 and fails the test."""

    actions: list[Action] = field(default_factory=list)
    requests: list[Captured] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def then(self, *actions: Action) -> Script:
        self.actions.extend(actions)
        return self

    def __call__(self, request: Request) -> Response:
        raw = request.get_data(as_text=True)
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw
        with self._lock:
            index = len(self.requests)
            self.requests.append(Captured(request.path, {k.lower(): v for k, v in request.headers}, body))
        if index >= len(self.actions):
            return Response("unexpected request", status=500)
        return self.actions[index](request, self)

    @property
    def bodies(self) -> list[Any]:
        return [captured.body for captured in self.requests]


def reply_json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Action:
    def action(request: Request, script: Script) -> Response:
        return Response(json.dumps(data), status=status, headers=headers, content_type="application/json")

    return action


def reply_raw(body: str, status: int = 200, headers: dict[str, str] | None = None) -> Action:
    def action(request: Request, script: Script) -> Response:
        return Response(body, status=status, headers=headers, content_type="application/json")

    return action


def input_tokens_written_as(provider: Provider, number: str) -> Action:
    """A good reply whose input token count is ``number`` in the JSON text: ``1e400``, ``NaN``, ``true``."""
    mark = 918273645  # a count json.dumps writes as it is, then replaced by what it cannot write
    text = json.dumps(provider.reply("## Decisions\n- keep ids", mark, 5)).replace(str(mark), number, 1)
    return reply_raw(text)


def hang_then(data: Any) -> Action:
    """Hold the request until the test releases it (after the client gave up), then answer."""

    def action(request: Request, script: Script) -> Response:
        script.release.wait(10)
        return Response(json.dumps(data), status=200, content_type="application/json")

    return action


def trickle_then(data: Any) -> Action:
    """Send a space every 50 ms (valid JSON padding) until the test releases it, then the reply."""

    def action(request: Request, script: Script) -> Response:
        def body() -> Iterator[str]:
            for _ in range(200):
                if script.release.wait(0.05):
                    break
                yield " "
            yield json.dumps(data)

        return Response(body(), status=200, content_type="application/json")

    return action


def redirect_to(path: str) -> Action:
    def action(request: Request, script: Script) -> Response:
        return Response("", status=307, headers={"Location": path})

    return action


def record_waits(summarizer: HTTPSummarizer, sleeps: list[float]) -> None:
    """Make ``summarizer`` record each retry wait in ``sleeps`` instead of waiting, on a fixed clock."""

    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    summarizer._sleep = record
    summarizer._now = lambda: FIXED_NOW


def _drain(value: Any) -> None:
    """Walk a validated value; pydantic validates ``Iterable`` fields only as they are consumed."""
    if isinstance(value, dict):
        for inner in value.values():
            _drain(inner)
    elif isinstance(value, str | bytes | int | float | bool) or value is None:
        return
    else:
        for inner in value:
            _drain(inner)


def _keys(typed_dict: Any) -> frozenset[str]:
    return frozenset(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def validate_openai_body(body: Any) -> None:
    """Raise unless ``body`` is a Chat Completions request the official SDK types accept."""
    _drain(TypeAdapter(CompletionCreateParamsNonStreaming).validate_python(body))
    unknown = set(body) - _keys(CompletionCreateParamsNonStreaming)
    assert not unknown, f"fields the Chat Completions API does not define: {unknown}"
    allowed = {"system": ChatCompletionSystemMessageParam, "user": ChatCompletionUserMessageParam}
    for message in body["messages"]:
        extra = set(message) - _keys(allowed[message["role"]])
        assert not extra, f"fields a {message['role']} message does not define: {extra}"


def validate_anthropic_body(body: Any) -> None:
    """Raise unless ``body`` is a Messages API request the official SDK types accept."""
    _drain(TypeAdapter(MessageCreateParamsNonStreaming).validate_python(body))
    unknown = set(body) - _keys(MessageCreateParamsNonStreaming)
    assert not unknown, f"fields the Messages API does not define: {unknown}"
    for message in body["messages"]:
        assert set(message) <= {"role", "content"}, message.keys()


@dataclass(frozen=True)
class Provider:
    """What differs between the two HTTP summarizers, as the tests see it."""

    name: str
    path: str
    cls: type[HTTPSummarizer]
    env_var: str
    key_header: str
    reply: Callable[[str, int, int], dict[str, Any]]
    validate: Callable[[Any], None]
    user_prompt: Callable[[Any], str]
    system_prompt: Callable[[Any], str]

    def make(self, base_url: str, *, sleeps: list[float] | None = None, **options: Any) -> HTTPSummarizer:
        """The provider's summarizer; with ``sleeps``, retry waits are recorded there instead of waited."""
        options.setdefault("api_key", API_KEY)
        summarizer = self.cls("test-model", base_url=base_url, **options)
        if sleeps is not None:
            record_waits(summarizer, sleeps)
        return summarizer

    def key_sent(self, captured: Captured) -> str | None:
        value = captured.headers.get(self.key_header)
        if value is not None and self.key_header == "authorization":
            return value.removeprefix("Bearer ")
        return value


def _openai_reply(text: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "test-model-2025",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _anthropic_reply(text: str, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "test-model-2025",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


OPENAI = Provider(
    name="openai",
    path="/v1/chat/completions",
    cls=OpenAICompatibleSummarizer,
    env_var="OPENAI_API_KEY",
    key_header="authorization",
    reply=_openai_reply,
    validate=validate_openai_body,
    user_prompt=lambda body: body["messages"][1]["content"],
    system_prompt=lambda body: body["messages"][0]["content"],
)
ANTHROPIC = Provider(
    name="anthropic",
    path="/v1/messages",
    cls=AnthropicSummarizer,
    env_var="ANTHROPIC_API_KEY",
    key_header="x-api-key",
    reply=_anthropic_reply,
    validate=validate_anthropic_body,
    user_prompt=lambda body: body["messages"][0]["content"],
    system_prompt=lambda body: body["system"],
)
