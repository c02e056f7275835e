"""A summarizer over Anthropic's Messages API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from .._episodes import Usage
from ._http import HTTPSummarizer

__all__ = ["AnthropicSummarizer"]

ANTHROPIC_BASE_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"


class AnthropicSummarizer(HTTPSummarizer):
    """Summarizes with a Claude model through the Messages API.

    The key comes from ``api_key`` or ``ANTHROPIC_API_KEY``; it is required for
    api.anthropic.com, optional for a compatible server or proxy given as
    ``base_url``. The other options (``timeout``, ``retry``,
    ``context_window_tokens``, ``summary_prompt``, ...) are those of every
    HTTP summarizer; see ``ChatSummarizer`` and ``SummarizerRetry``.
    """

    provider: ClassVar[str] = "Anthropic"
    env_var: ClassVar[str] = "ANTHROPIC_API_KEY"
    official_host: ClassVar[str] = "api.anthropic.com"
    default_base_url: ClassVar[str] = ANTHROPIC_BASE_URL
    default_context_window_tokens: ClassVar[int] = 200_000

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/messages"

    def _headers(self) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION, **super()._headers()}

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

    def _was_cut(self, data: Mapping[str, Any]) -> bool:
        return data.get("stop_reason") == "max_tokens"

    def _refusal(self, data: Mapping[str, Any]) -> str | None:
        return "stop_reason 'refusal'" if data.get("stop_reason") == "refusal" else None

    def _parse_reply(self, data: Mapping[str, Any]) -> tuple[str, str | None, Usage]:
        content = data.get("content")
        if not isinstance(content, list):
            raise ValueError("'content' is missing or not a list of blocks")
        text = "".join(
            str(block.get("text", ""))
            for block in content
            if isinstance(block, Mapping) and block.get("type") == "text"
        )
        raw_usage = data.get("usage")
        usage = Usage()
        if isinstance(raw_usage, Mapping):
            cached = int(raw_usage.get("cache_creation_input_tokens") or 0) + int(
                raw_usage.get("cache_read_input_tokens") or 0
            )
            usage = Usage(
                input_tokens=int(raw_usage.get("input_tokens") or 0) + cached,
                output_tokens=int(raw_usage.get("output_tokens") or 0),
            )
        model = data.get("model")
        return text, model if isinstance(model, str) and model else None, usage
