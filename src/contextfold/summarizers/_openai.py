"""A summarizer over any OpenAI-compatible Chat Completions endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, get_args
from urllib.parse import urlparse

import httpx
from pydantic import Field, SecretStr

from .._episodes import Usage
from .._errors import ConfigError
from .._tokens import TokenCounter
from ._http import HTTPSummarizer
from ._prompt import DEFAULT_MAX_MESSAGE_CHARS
from ._reply import Reply, Strict, TokenCount
from ._retry import SummarizerRetry

__all__ = ["OpenAICompatibleSummarizer"]

OPENAI_BASE_URL = "https://api.openai.com/v1"

TokenLimitField = Literal["max_tokens", "max_completion_tokens"]


class _Part(Strict):
    """A content part, as some compatible servers answer; parts without text (an image) add none."""

    text: str | None = None


class _Message(Strict):
    content: str | list[_Part] | None = None
    refusal: str | None = None  # the API sends "refusal": null with every answer


class _Choice(Strict):
    message: _Message
    finish_reason: str | None = None


class _Usage(Strict):
    prompt_tokens: TokenCount = None
    completion_tokens: TokenCount = None


class ChatCompletion(Reply):
    """A Chat Completions reply; only the first choice is read."""

    choices: list[_Choice] = Field(min_length=1)
    usage: _Usage | None = None

    def text(self) -> str:
        content = self.choices[0].message.content
        if isinstance(content, list):
            return "".join(part.text or "" for part in content)
        return content or ""

    def token_usage(self) -> Usage:
        if self.usage is None:
            return Usage()
        return Usage(
            input_tokens=self.usage.prompt_tokens or 0, output_tokens=self.usage.completion_tokens or 0
        )

    def refusal(self) -> str | None:
        choice = self.choices[0]
        if choice.finish_reason == "content_filter":
            return "finish_reason 'content_filter'"
        if choice.message.refusal:
            return "a refusal in choices[0].message.refusal"
        return None

    def was_cut(self) -> bool:
        return self.choices[0].finish_reason == "length"


class OpenAICompatibleSummarizer(HTTPSummarizer):
    """Summarizes with a Chat Completions model: OpenAI, or vLLM, Ollama, LM Studio, OpenRouter, ....

    The key comes from ``api_key`` or ``OPENAI_API_KEY``; a local server given
    as ``base_url`` may need none. ``token_limit_field`` names the output
    limit: by default ``max_completion_tokens`` for api.openai.com (its newer
    models reject ``max_tokens``) and ``max_tokens`` elsewhere, which every
    compatible server accepts. The other options (``timeout``, ``retry``,
    ``context_window_tokens``, ``summary_prompt``, ...) are those of every
    HTTP summarizer; see ``ChatSummarizer`` and ``SummarizerRetry``.
    """

    provider: ClassVar[str] = "OpenAI-compatible"
    reply_type: ClassVar[type[Reply]] = ChatCompletion
    env_var: ClassVar[str] = "OPENAI_API_KEY"
    official_host: ClassVar[str] = "api.openai.com"
    default_base_url: ClassVar[str] = OPENAI_BASE_URL
    default_context_window_tokens: ClassVar[int] = 128_000

    def __init__(
        self,
        model: str,
        *,
        base_url: str = OPENAI_BASE_URL,
        api_key: str | SecretStr | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = 60.0,
        retry: SummarizerRetry | None = None,
        context_window_tokens: int = 128_000,
        max_message_chars: int = DEFAULT_MAX_MESSAGE_CHARS,
        counter: TokenCounter | None = None,
        summary_prompt: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        token_limit_field: TokenLimitField | None = None,
    ) -> None:
        super().__init__(
            model,
            base_url=base_url,
            api_key=api_key,
            client=client,
            timeout=timeout,
            retry=retry,
            context_window_tokens=context_window_tokens,
            max_message_chars=max_message_chars,
            counter=counter,
            summary_prompt=summary_prompt,
            headers=headers,
            extra_body=extra_body,
        )
        if token_limit_field is not None and token_limit_field not in get_args(TokenLimitField):
            raise ConfigError(
                "token_limit_field",
                "must be 'max_tokens' (which every compatible server accepts) or 'max_completion_tokens' "
                "(which api.openai.com's newer models require), or None to choose by base_url",
                value=token_limit_field,
            )
        if token_limit_field is None:
            official = urlparse(self.base_url).hostname == self.official_host
            token_limit_field = "max_completion_tokens" if official else "max_tokens"
        self.token_limit_field: TokenLimitField = token_limit_field

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def _auth_headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def request_body(self, system: str, user: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            self.token_limit_field: max_tokens,
            **self.extra_body,
        }
