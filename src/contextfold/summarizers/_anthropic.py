"""A summarizer over Anthropic's Messages API."""

from __future__ import annotations

from typing import Any, ClassVar

from .._episodes import Usage
from ._http import HTTPSummarizer, merged_headers
from ._reply import Reply, Strict, TokenCount

__all__ = ["AnthropicSummarizer"]

ANTHROPIC_BASE_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"


class _Block(Strict):
    """A content block; only ``text`` blocks hold the summary (``thinking`` and others are skipped)."""

    type: str
    text: str | None = None


class _Usage(Strict):
    input_tokens: TokenCount = None
    output_tokens: TokenCount = None
    cache_creation_input_tokens: TokenCount = None
    cache_read_input_tokens: TokenCount = None


class MessageReply(Reply):
    """A Messages API reply."""

    content: list[_Block]
    stop_reason: str | None = None
    usage: _Usage | None = None

    def text(self) -> str:
        return "".join(block.text or "" for block in self.content if block.type == "text")

    def token_usage(self) -> Usage:
        if self.usage is None:
            return Usage()
        usage = self.usage
        # Cache reads and writes are input too: they are part of what the model was sent.
        parts = (usage.input_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens)
        return Usage(input_tokens=sum(n or 0 for n in parts), output_tokens=usage.output_tokens or 0)

    def refusal(self) -> str | None:
        return "stop_reason 'refusal'" if self.stop_reason == "refusal" else None

    def was_cut(self) -> bool:
        return self.stop_reason == "max_tokens"


class AnthropicSummarizer(HTTPSummarizer):
    """Summarizes with a Claude model through the Messages API.

    The key comes from ``api_key`` or ``ANTHROPIC_API_KEY``; it is required for
    api.anthropic.com, optional for a compatible server or proxy given as
    ``base_url``. The other options (``timeout``, ``retry``,
    ``context_window_tokens``, ``summary_prompt``, ...) are those of every
    HTTP summarizer; see ``ChatSummarizer`` and ``SummarizerRetry``.
    """

    provider: ClassVar[str] = "Anthropic"
    reply_type: ClassVar[type[Reply]] = MessageReply
    env_var: ClassVar[str] = "ANTHROPIC_API_KEY"
    official_host: ClassVar[str] = "api.anthropic.com"
    default_base_url: ClassVar[str] = ANTHROPIC_BASE_URL
    default_context_window_tokens: ClassVar[int] = 200_000

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/messages"

    def _headers(self) -> dict[str, str]:
        return merged_headers({"anthropic-version": ANTHROPIC_VERSION}, super()._headers())

    def _auth_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key}

    def request_body(self, system: str, user: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "max_tokens": max_tokens,
            "system": system,
            "messages": [{"role": "user", "content": user}],
            **self.extra_body,
        }
