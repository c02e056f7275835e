"""Summarizers that call a hosted model over HTTP: shared retry, secrecy and chunking.

A provider subclass says where to send a request, what its body looks like and
how to read the reply; everything else lives here:

* the API key is a :class:`pydantic.SecretStr`, shown as ``'**********'`` in
  reprs and never put in a log record or an exception (a reply body that
  echoes it is redacted);
* 429, 408, 409, 5xx and connect or read failures are retried with
  exponential backoff and jitter, honouring ``Retry-After`` (seconds or an
  HTTP date); other statuses fail at once;
* input larger than the model's own context window is summarized chunk by
  chunk, each chunk's summary becoming the previous summary of the next.
"""

from __future__ import annotations

import logging
import math
import os
import random
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar
from urllib.parse import urlparse

import anyio
import httpx
from pydantic import SecretStr
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._messages import Message
from .._resource import AsyncResource
from .._tokens import TiktokenCounter, TokenCounter
from ._base import Summary
from ._prompt import (
    DEFAULT_MAX_MESSAGE_CHARS,
    SYSTEM_PROMPT,
    cut_middle,
    render_message,
    tool_names_of,
    user_prompt,
)

__all__ = ["SummarizerRetry"]

logger = logging.getLogger("contextfold.summarizers")

_RETRIED_STATUSES = frozenset({408, 409, 429})
_RESERVED_BODY_FIELDS = frozenset(
    {"model", "messages", "system", "max_tokens", "max_completion_tokens", "stream"}
)
_BODY_EXCERPT_CHARS = 300
_REDACTED = "[redacted]"
_MIN_CHUNK_TOKENS = 256
_WINDOW_SAFETY = 0.9
"""Share of the context window used: the local count and the provider's tokenizer may differ."""


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class SummarizerRetry:
    """How an HTTP summarizer waits between attempts.

    The n-th retry waits a random time between half of and the whole of
    ``min(max_delay, initial_delay * 2 ** (n - 1))`` seconds, unless the server
    sent ``Retry-After``, which is honoured up to ``max_retry_after`` seconds.
    ``sleep`` and ``now`` are injectable so tests run without real waiting.
    """

    initial_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 60.0
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep
    now: Callable[[], datetime] = field(default=_now)

    def __post_init__(self) -> None:
        for key in ("initial_delay", "max_delay", "max_retry_after"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ConfigError(
                    f"SummarizerRetry.{key}",
                    "must be a finite number of seconds >= 0, for example 0.5",
                    value=value,
                )
        if self.max_delay < self.initial_delay:
            raise ConfigError(
                "SummarizerRetry.max_delay",
                f"must be at least initial_delay={self.initial_delay}",
                value=self.max_delay,
            )

    def backoff(self, retry_number: int) -> float:
        """Seconds to wait before retry ``retry_number`` (1-based) when the server gave no hint."""
        ceiling = min(self.max_delay, self.initial_delay * 2 ** max(0, retry_number - 1))
        return random.uniform(ceiling / 2, ceiling)

    def retry_after(self, headers: httpx.Headers) -> float | None:
        """Seconds the server asked us to wait, from ``retry-after-ms`` or ``Retry-After``."""
        millis = headers.get("retry-after-ms")
        if millis is not None:
            try:
                return max(0.0, float(millis) / 1000)
            except ValueError:
                pass
        value = headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - self.now()).total_seconds())


def _sendable(key: str) -> bool:
    """Whether ``key`` can travel in an HTTP header as it is."""
    return key.isascii() and key.isprintable() and not any(c.isspace() for c in key)


def _check_number(key: str, value: object, minimum: float, reason: str, whole: bool = False) -> None:
    kinds = int if whole else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not minimum <= value < math.inf:
        raise ConfigError(key, reason, value=value)


class _Retryable(Exception):
    """A failed attempt worth repeating."""

    def __init__(
        self,
        reason: str,
        *,
        status: int | None = None,
        body: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.retry_after = retry_after


class ChatSummarizer(AsyncResource):
    """Base of the HTTP summarizers: one system prompt, one user turn, one text reply.

    Options shared by every provider: ``base_url`` (the provider's own by
    default), ``api_key`` (else the provider's environment variable), an
    injectable ``client``, ``timeout`` per attempt in seconds, ``max_retries``
    after the first attempt and ``retry`` timing; ``context_window_tokens`` of
    the summarizer model (input beyond it is summarized in chunks) measured with
    ``counter`` (exact tiktoken by default); ``max_message_chars`` of one
    message's text, tool arguments or result; extra ``headers``; and
    ``extra_body`` fields merged into every request (``temperature``, ...).
    """

    provider: ClassVar[str]
    env_var: ClassVar[str]
    official_host: ClassVar[str]
    default_base_url: ClassVar[str]
    default_context_window_tokens: ClassVar[int]

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | SecretStr | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = 60.0,
        max_retries: int = 2,
        retry: SummarizerRetry | None = None,
        context_window_tokens: int | None = None,
        max_message_chars: int = DEFAULT_MAX_MESSAGE_CHARS,
        counter: TokenCounter | None = None,
        headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if base_url is None:
            base_url = self.default_base_url
        if context_window_tokens is None:
            context_window_tokens = self.default_context_window_tokens
        if not isinstance(model, str) or not model.strip():
            raise ConfigError("model", "must name the model, for example 'gpt-4o-mini'", value=model)
        parsed = urlparse(base_url) if isinstance(base_url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
            hint = "must be an http(s) URL such as 'http://127.0.0.1:11434/v1'"
            raise ConfigError("base_url", hint, value=base_url)
        _check_number("timeout", timeout, 1e-9, "must be a positive number of seconds, for example 60")
        _check_number("max_retries", max_retries, 0, "must be a whole number >= 0 (0 disables retries)", True)
        _check_number(
            "context_window_tokens",
            context_window_tokens,
            2048,
            "must be the summarizer model's context window, at least 2048 tokens",
            True,
        )
        _check_number("max_message_chars", max_message_chars, 100, "must be >= 100, for example 6000", True)
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.retry = retry if retry is not None else SummarizerRetry()
        self.context_window_tokens = context_window_tokens
        self.max_message_chars = max_message_chars
        self._counter = counter
        self._extra_headers = dict(headers or {})
        self.extra_body: dict[str, Any] = dict(extra_body or {})
        clashes = sorted(set(self.extra_body) & _RESERVED_BODY_FIELDS)
        if clashes:
            raise ConfigError(
                "extra_body",
                f"may not set {clashes}: the summarizer sets them itself; pass model to the "
                "constructor and max_summary_tokens to summarize()",
                value=dict(self.extra_body),
            )
        key = api_key if api_key is not None else os.environ.get(self.env_var) or None
        self._api_key: SecretStr | None = SecretStr(key) if isinstance(key, str) else key
        if self._api_key is not None and not _sendable(self._api_key.get_secret_value()):
            # Not shown: httpx and h11 would have put the whole header, key included, into their error.
            raise ConfigError(
                "api_key",
                "holds whitespace, a control or a non-ASCII character, which an HTTP header cannot "
                f"carry; check the key (or {self.env_var}) for a stray newline or quote",
            )
        if self._api_key is None and parsed.hostname == self.official_host:
            raise ConfigError(
                "api_key",
                f"{self.official_host} needs an API key: pass api_key=... or set the {self.env_var} "
                "environment variable (a local server given as base_url may need none)",
            )
        self._client = client
        self._owns_client = client is None

    # provider specifics -------------------------------------------------

    @property
    @abstractmethod
    def url(self) -> str:
        """The endpoint requests are posted to."""

    @abstractmethod
    def _auth_headers(self, key: str) -> dict[str, str]: ...

    @abstractmethod
    def request_body(self, system: str, user: str, max_tokens: int) -> dict[str, Any]:
        """The JSON body of one summarization request."""

    @abstractmethod
    def _parse_reply(self, data: Mapping[str, Any]) -> tuple[str, str | None, Usage]:
        """``(text, model, usage)`` from a reply; raise ``ValueError`` naming what is malformed."""

    @abstractmethod
    def _was_cut(self, data: Mapping[str, Any]) -> bool:
        """Whether the reply stopped at the output token limit rather than where the model ended it."""

    # resource handling ----------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP client this summarizer created; a client passed in is left open."""
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    def __repr__(self) -> str:
        shown = "None" if self._api_key is None else repr(str(self._api_key))
        return f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r}, api_key={shown})"

    # summarizing ---------------------------------------------------------

    @property
    def counter(self) -> TokenCounter:
        if self._counter is None:
            self._counter = TiktokenCounter()
        return self._counter

    async def summarize(
        self,
        messages: Sequence[Message],
        *,
        previous_summary: str | None,
        max_summary_tokens: int,
    ) -> Summary:
        """Fold ``messages`` into ``previous_summary``, in as many requests as the window needs."""
        usable = int(self.context_window_tokens * _WINDOW_SAFETY)
        count = self.counter.count_text
        overhead = count(SYSTEM_PROMPT) + count(user_prompt("", None, max_summary_tokens)) + 32
        if max_summary_tokens <= 0 or overhead + 2 * max_summary_tokens + _MIN_CHUNK_TOKENS > usable:
            most = max(1, (usable - overhead - _MIN_CHUNK_TOKENS) // 2)
            raise ConfigError(
                "max_summary_tokens",
                f"leaves no room for the conversation in context_window_tokens="
                f"{self.context_window_tokens}; use at most {most}",
                value=max_summary_tokens,
            )
        if not messages:
            return Summary(text=previous_summary or "", model=self.model)
        names = tool_names_of(messages)
        rendered = [render_message(m, tool_names=names, max_chars=self.max_message_chars) for m in messages]
        sizes = [count(text) + 2 for text in rendered]

        summary = previous_summary
        usage = Usage()
        model = self.model
        start = 0
        while start < len(rendered):
            room = usable - overhead - max_summary_tokens
            if summary:
                summary_tokens = count(summary)
                if (
                    summary_tokens > room - _MIN_CHUNK_TOKENS
                ):  # an oversized previous summary is cut, not fatal
                    summary = self._fit(summary, room - _MIN_CHUNK_TOKENS)
                    summary_tokens = count(summary)
                room -= summary_tokens
            chunk: list[str] = []
            used = 0
            while start < len(rendered) and used + sizes[start] <= room:
                chunk.append(rendered[start])
                used += sizes[start]
                start += 1
            if not chunk and start < len(rendered):
                chunk.append(self._fit(rendered[start], room))
                start += 1
            text, reply_model, reply_usage = await self._complete(
                user_prompt("\n\n".join(chunk), summary, max_summary_tokens), max_summary_tokens
            )
            summary = text
            usage = usage + reply_usage
            model = reply_model or self.model
        return Summary(text=summary or "", model=model, usage=usage)

    def _fit(self, text: str, room: int) -> str:
        """``text`` cut in the middle until it fits ``room`` tokens (or down to 100 characters)."""
        limit = len(text)
        while limit > 100:
            limit = max(100, limit * 3 // 4)
            cut = cut_middle(text, limit)
            if self.counter.count_text(cut) <= room:
                return cut
        return cut_middle(text, 100)

    async def _complete(self, user: str, max_tokens: int) -> tuple[str, str | None, Usage]:
        response = await self._post(self.request_body(SYSTEM_PROMPT, user, max_tokens))
        try:
            data = response.json()
        except ValueError:
            raise SummarizerError(
                f"{self.provider} summarizer got a reply that is not JSON from {self.url}",
                status=response.status_code,
                body=self._excerpt(response.text),
            ) from None
        try:
            if not isinstance(data, Mapping):
                raise ValueError(f"the reply is a JSON {type(data).__name__}, not an object")
            text, model, usage = self._parse_reply(data)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise SummarizerError(
                f"{self.provider} summarizer got a malformed reply from {self.url}: {exc}",
                status=response.status_code,
                body=self._excerpt(response.text),
            ) from None
        if not text.strip():
            raise SummarizerError(
                f"{self.provider} summarizer got an empty summary from model {self.model!r}",
                status=response.status_code,
                body=self._excerpt(response.text),
            )
        if self._was_cut(data):  # still the best summary there is, but its last sections may be missing
            logger.warning(
                "%s summarizer: model %r stopped at the limit of %d tokens; the summary may lack its "
                "last sections (raise max_summary_tokens or use a model that keeps to it)",
                self.provider,
                self.model,
                max_tokens,
            )
        return text.strip(), model, usage

    # HTTP ---------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = dict(self._extra_headers)
        if self._api_key is not None:
            headers.update(self._auth_headers(self._api_key.get_secret_value()))
        return headers

    def _redact(self, text: str) -> str:
        secret = self._api_key.get_secret_value() if self._api_key is not None else ""
        return text.replace(secret, _REDACTED) if secret else text

    def _excerpt(self, text: str) -> str:
        # Redacted before cutting: a cut through the key would leave its head unredacted.
        text = self._redact(text)
        excerpt = text[:_BODY_EXCERPT_CHARS]
        return excerpt + ("..." if len(text) > _BODY_EXCERPT_CHARS else "")

    async def _attempt(self, body: dict[str, Any]) -> httpx.Response:
        if self._client is None:
            self._client = httpx.AsyncClient()
        try:
            # httpx times each read separately; the deadline also bounds a reply that trickles in.
            with anyio.fail_after(self.timeout):
                response = await self._client.post(
                    self.url, json=body, headers=self._headers(), timeout=self.timeout
                )
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise _Retryable(f"{type(exc).__name__} after {self.timeout:g} s") from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Retryable(type(exc).__name__) from None
        except httpx.HTTPError as exc:  # a proxy, protocol or redirect failure that a retry would repeat
            # Only the kind: the text can quote a header value (a key in ``headers``) or proxy credentials.
            raise SummarizerError(
                f"{self.provider} summarizer: {self.url} failed with {type(exc).__name__} (not retried)"
            ) from None
        status = response.status_code
        if status < 300:
            return response
        excerpt = self._excerpt(response.text)
        if status in _RETRIED_STATUSES or status >= 500:
            raise _Retryable(
                f"HTTP {status}",
                status=status,
                body=excerpt,
                retry_after=self.retry.retry_after(response.headers),
            )
        raise SummarizerError(self._status_message(status), status=status, body=excerpt)

    def _status_message(self, status: int) -> str:
        who = f"{self.provider} summarizer"
        if status == 401:
            return (
                f"{who}: the API key was rejected by {self.base_url}; check api_key "
                f"or the {self.env_var} environment variable (not retried)"
            )
        if status == 403:
            return f"{who}: the API key may not use model {self.model!r} at {self.base_url} (not retried)"
        if status == 404:
            return f"{who}: {self.url} or model {self.model!r} was not found; check base_url and model"
        return f"{who}: {self.url} rejected the request (not retried)"

    def _wait(self, state: RetryCallState) -> float:
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, _Retryable) and exc.retry_after is not None:
            return min(exc.retry_after, self.retry.max_retry_after)
        return self.retry.backoff(state.attempt_number)

    def _log_retry(self, state: RetryCallState) -> None:
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning(
            "%s summarizer: %s from %s, retrying in %.2f s (attempt %d of %d)",
            self.provider,
            exc,
            self.url,
            wait,
            state.attempt_number + 1,
            self.max_retries + 1,
        )

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception_type(_Retryable),
            sleep=self.retry.sleep,
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(body)
        except _Retryable as exc:
            attempts = self.max_retries + 1
            raise SummarizerError(
                f"{self.provider} summarizer: {self.url} failed after {attempts} "
                f"attempt{'s' if attempts > 1 else ''}, last with {exc.reason}",
                status=exc.status,
                body=exc.body,
            ) from None
        raise AssertionError("unreachable: tenacity either returns or raises")
