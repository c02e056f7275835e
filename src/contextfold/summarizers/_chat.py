"""``ChatSummarizer``: the base of every summarizer that asks a chat model for the summary."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import anyio.to_thread

from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._messages import Message
from .._resource import AsyncResource
from .._tokens import TiktokenCounter, TokenCounter, check_counter
from ._base import Summary
from ._prompt import (
    DEFAULT_MAX_MESSAGE_CHARS,
    SYSTEM_PROMPT,
    check_summary_prompt,
    cut_middle,
    fill_summary_prompt,
    render_message,
    tool_names_of,
    user_prompt,
)
from ._threads import Breather

__all__ = ["ChatSummarizer", "check_number"]

_MIN_CHUNK_TOKENS = 256
_WINDOW_SAFETY = 0.9
"""Share of the context window used: the local count and the provider's tokenizer may differ."""
_REQUEST_OVERHEAD_TOKENS = 32
"""Room left for the chat framing of the two messages sent."""


def check_number(key: str, value: object, minimum: float, reason: str, whole: bool = False) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is a finite number >= ``minimum``."""
    kinds = int if whole else int | float
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or value != value
        or value in (float("inf"), float("-inf"))
        or value < minimum
    ):
        raise ConfigError(key, reason, value=value)


@dataclass(frozen=True, slots=True)
class _Rendered:
    """The messages rendered for the prompt, each with its token count, and what every request costs."""

    texts: list[str]
    sizes: list[int]
    overhead: int
    usable: int


class ChatSummarizer(AsyncResource):
    """The base class of every chat-model summarizer: contextfold's prompt, chunking and checks.

    A subclass implements one method, :meth:`complete`, which sends one
    system and one user message to its model and returns the reply's text,
    the model's name (or None) and the token usage. Everything else is done
    here: the messages are rendered as quoted data (tool calls with their
    arguments, tool results naming their call, non-text parts as placeholders
    keeping their URL or id), the previous summary is updated rather than
    rewritten, input larger than the model's window is summarized chunk by
    chunk (each chunk's summary the previous summary of the next), and an
    empty reply is a :class:`SummarizerError`. Rendering and local token
    counting run in a worker thread.

    Options: ``model``, the name reported when a reply names none;
    ``context_window_tokens`` of the summarizer model, measured with
    ``counter`` (exact tiktoken by default); ``max_message_chars`` of one
    message's text, tool arguments or result; and ``summary_prompt``, a
    ``str.format`` template for the user message that must name
    ``{conversation}``, ``{previous_summary}`` and ``{max_summary_tokens}``
    (checked here; by default contextfold's own request is used)::

        class MyModelSummarizer(ChatSummarizer):
            async def complete(self, system, user, max_tokens):
                reply = await my_client.chat(system=system, user=user, max_tokens=max_tokens)
                return reply.text, reply.model, Usage(input_tokens=reply.input, output_tokens=reply.output)

    ``aclose()`` does nothing here; a subclass that holds a connection closes it.
    """

    default_context_window_tokens: ClassVar[int] = 128_000

    def __init__(
        self,
        model: str,
        *,
        context_window_tokens: int | None = None,
        max_message_chars: int = DEFAULT_MAX_MESSAGE_CHARS,
        counter: TokenCounter | None = None,
        summary_prompt: str | None = None,
    ) -> None:
        if context_window_tokens is None:
            context_window_tokens = self.default_context_window_tokens
        if not isinstance(model, str) or not model.strip():
            raise ConfigError("model", "must name the model, for example 'gpt-4o-mini'", value=model)
        check_number(
            "context_window_tokens",
            context_window_tokens,
            2048,
            "must be the summarizer model's context window, at least 2048 tokens",
            True,
        )
        check_number("max_message_chars", max_message_chars, 100, "must be >= 100, for example 6000", True)
        self.model = model
        self.context_window_tokens = context_window_tokens
        self.max_message_chars = max_message_chars
        if counter is not None:
            check_counter(counter)
        self.counter: TokenCounter = counter if counter is not None else TiktokenCounter()
        self.summary_prompt = check_summary_prompt(summary_prompt) if summary_prompt is not None else None

    def check_summary_room(self, max_summary_tokens: int, *, key: str = "max_summary_tokens") -> None:
        """Refuse a summary size that leaves this model's window no room for the conversation.

        Checked when the ``Compactor`` is built, without a tokenizer: the
        request's own text is estimated at four characters a token, and only a
        size that cannot fit even so is refused here. A size near the edge is
        measured exactly at the first fold, with the same error.
        """
        usable = int(self.context_window_tokens * _WINDOW_SAFETY)
        if _REQUEST_OVERHEAD_TOKENS + 2 * max_summary_tokens + _MIN_CHUNK_TOKENS <= usable:
            return
        prompt = len(SYSTEM_PROMPT) + len(self._request("", None, max_summary_tokens))
        most = max(1, (usable - prompt // 4 - _REQUEST_OVERHEAD_TOKENS - _MIN_CHUNK_TOKENS) // 2)
        raise ConfigError(
            key,
            f"leaves no room for the conversation in the summarizer's context_window_tokens="
            f"{self.context_window_tokens}; use at most about {most}, or a summarizer model "
            "with a larger window",
            value=max_summary_tokens,
        )

    @abstractmethod
    async def complete(self, system: str, user: str, max_tokens: int) -> tuple[str, str | None, Usage]:
        """Ask the model once: ``(text, model name or None, usage)`` of its reply to ``system`` and ``user``.

        ``max_tokens`` bounds the reply. Raise :class:`SummarizerError` when
        the model cannot be reached or fails; the compactor applies its
        ``on_summarizer_error`` policy to it.
        """

    async def aclose(self) -> None:
        """Release what the summarizer holds; this base holds nothing."""

    async def summarize(
        self,
        messages: Sequence[Message],
        *,
        previous_summary: str | None,
        max_summary_tokens: int,
    ) -> Summary:
        """Fold ``messages`` into ``previous_summary``, in as many requests as the window needs."""
        if not messages:
            if previous_summary and previous_summary.strip():
                return Summary(text=previous_summary, model=self.model)
            raise SummarizerError(
                f"{type(self).__name__}: nothing to summarize, no messages and no previous summary"
            )
        rendered = await anyio.to_thread.run_sync(self._render, messages, max_summary_tokens)
        summary = previous_summary
        usage = Usage()
        model = self.model
        start = 0
        while start < len(rendered.texts):
            user, start = await anyio.to_thread.run_sync(
                self._next_request, rendered, start, summary, max_summary_tokens
            )
            text, reply_model, reply_usage = await self.complete(SYSTEM_PROMPT, user, max_summary_tokens)
            if not isinstance(text, str) or not text.strip():
                raise SummarizerError(
                    f"{type(self).__name__}: model {reply_model or self.model!r} returned an empty summary"
                )
            summary = text.strip()
            usage = usage + reply_usage
            model = reply_model or self.model
        assert summary is not None  # at least one request was made
        return Summary(text=summary, model=model, usage=usage)

    def _request(self, conversation: str, previous_summary: str | None, max_summary_tokens: int) -> str:
        template = self.summary_prompt
        if template is not None:
            return fill_summary_prompt(template, conversation, previous_summary, max_summary_tokens)
        return user_prompt(conversation, previous_summary, max_summary_tokens)

    def _render(self, messages: Sequence[Message], max_summary_tokens: int) -> _Rendered:
        """Every message rendered and counted; runs in a worker thread."""
        usable = int(self.context_window_tokens * _WINDOW_SAFETY)
        count = self.counter.count_text
        empty_request = self._request("", None, max_summary_tokens)
        overhead = count(SYSTEM_PROMPT) + count(empty_request) + _REQUEST_OVERHEAD_TOKENS
        if max_summary_tokens <= 0 or overhead + 2 * max_summary_tokens + _MIN_CHUNK_TOKENS > usable:
            most = max(1, (usable - overhead - _MIN_CHUNK_TOKENS) // 2)
            raise ConfigError(
                "max_summary_tokens",
                f"leaves no room for the conversation in context_window_tokens="
                f"{self.context_window_tokens}; use at most {most}",
                value=max_summary_tokens,
            )
        names = tool_names_of(messages)
        texts: list[str] = []
        sizes: list[int] = []
        breathe = Breather()
        for message in messages:
            breathe()
            texts.append(render_message(message, tool_names=names, max_chars=self.max_message_chars))
            sizes.append(count(texts[-1]) + 2)
        return _Rendered(texts, sizes, overhead, usable)

    def _next_request(
        self, rendered: _Rendered, start: int, summary: str | None, max_summary_tokens: int
    ) -> tuple[str, int]:
        """The next request's user message and where the one after it starts; runs in a worker thread."""
        room = rendered.usable - rendered.overhead - max_summary_tokens
        if summary:
            summary_tokens = self.counter.count_text(summary)
            if summary_tokens > room - _MIN_CHUNK_TOKENS:  # an oversized previous summary is cut, not fatal
                summary = self._fit(summary, room - _MIN_CHUNK_TOKENS)
                summary_tokens = self.counter.count_text(summary)
            room -= summary_tokens
        chunk: list[str] = []
        used = 0
        while start < len(rendered.texts) and used + rendered.sizes[start] <= room:
            chunk.append(rendered.texts[start])
            used += rendered.sizes[start]
            start += 1
        if not chunk:
            chunk.append(self._fit(rendered.texts[start], room))
            start += 1
        return self._request("\n\n".join(chunk), summary, max_summary_tokens), start

    def _fit(self, text: str, room: int) -> str:
        """``text`` cut in the middle until it fits ``room`` tokens (or down to 100 characters)."""
        limit = len(text)
        while limit > 100:
            limit = max(100, limit * 3 // 4)
            cut = cut_middle(text, limit)
            if self.counter.count_text(cut) <= room:
                return cut
        return cut_middle(text, 100)
