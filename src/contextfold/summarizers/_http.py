"""Summarizers that call a hosted model over HTTP: retry, secrecy and error mapping.

A provider subclass says where to send a request, what its body looks like and
how to read the reply; everything else lives here or in :class:`ChatSummarizer`
(the prompt and chunking):

* the API key is a :class:`pydantic.SecretStr`, shown as ``'**********'`` in
  reprs and never put in a log record or an exception (a reply body that
  echoes it is redacted);
* 429, 408, 409, 5xx and connect or read failures are retried by tenacity as
  :class:`SummarizerRetry` says, honouring ``Retry-After``; other statuses
  fail at once;
* every transport, protocol or timeout failure, and every malformed, empty,
  refused or content-filtered reply, ends in a :class:`SummarizerError`.
"""

from __future__ import annotations

import json
import logging
import os
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar
from urllib.parse import urlparse

import anyio
import httpx
from pydantic import SecretStr, ValidationError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._secrets import masked_url
from .._tokens import TokenCounter
from ._chat import ChatSummarizer, check_number
from ._prompt import DEFAULT_MAX_MESSAGE_CHARS
from ._reply import Reply, describe_errors
from ._retry import RetryLater, SummarizerRetry, retry_after_seconds, wait_strategy

__all__ = ["HTTPSummarizer"]

logger = logging.getLogger("contextfold.summarizers")

_RETRIED_STATUSES = frozenset({408, 409, 429})
_RESERVED_BODY_FIELDS = frozenset(
    {"model", "messages", "system", "max_tokens", "max_completion_tokens", "stream"}
)
_BODY_EXCERPT_CHARS = 300
_REDACTED = "[redacted]"
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
"""The characters of an HTTP header name (RFC 9110's ``token``)."""
_NOT_SHOWN = "the value is not shown: a header may carry a secret"


def _now() -> datetime:
    return datetime.now(UTC)


def _sendable(key: str) -> bool:
    """Whether ``key`` can travel in an HTTP header as it is."""
    return key.isascii() and key.isprintable() and not any(c.isspace() for c in key)


def _header_value_fault(value: str) -> str | None:
    """What keeps ``value`` out of an HTTP header, without quoting it; None when it can go as it is."""
    for index, char in enumerate(value):
        if not char.isascii():
            return f"holds a non-ASCII character at position {index}"
        if not char.isprintable() and char != "\t":
            return f"holds a control character (a newline, say) at position {index}"
    if value != value.strip(" \t"):
        return "starts or ends with whitespace"
    return None


def _checked_headers(headers: object) -> dict[str, str]:
    """``headers`` as a dict, once every name and value is one HTTP can carry; values are never shown."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise ConfigError(
            "headers",
            f"must be a mapping of header names to values, such as {{'X-Team': 'search'}}, "
            f"not a {type(headers).__name__}",
        )
    checked: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not name or not _TOKEN_CHARS.issuperset(name):
            raise ConfigError(
                "headers",
                f"header name {name!r} is not one HTTP can carry: use ASCII letters, digits and "
                "!#$%&'*+-.^_`|~ only, such as 'X-Team'",
            )
        if not isinstance(value, str):
            raise ConfigError(
                "headers", f"header {name!r} must have a str value, not a {type(value).__name__}"
            )
        fault = _header_value_fault(value)
        if fault is not None:
            raise ConfigError(
                "headers",
                f"header {name!r} {fault}, which an HTTP header cannot carry ({_NOT_SHOWN}); "
                "check it for a stray newline or space, and percent-encode any non-ASCII text",
            )
        twin = next((given for given in checked if given.lower() == name.lower()), None)
        if twin is not None:
            raise ConfigError(
                "headers",
                f"header {name!r} is given twice, also as {twin!r}: header names are the same in any "
                "letter case; keep one of them",
            )
        checked[name] = value
    return checked


def merged_headers(*layers: Mapping[str, str]) -> dict[str, str]:
    """The headers of ``layers``: a later layer's header replaces an earlier one's of that name in any case.

    HTTP header names are case-insensitive; merged as plain dicts, ``Authorization``
    and ``authorization`` would both be sent, and which one a server reads is undefined.
    """
    merged: dict[str, tuple[str, str]] = {}
    for layer in layers:
        for name, value in layer.items():
            merged[name.lower()] = (name, value)
    return dict(merged.values())


def _checked_body(extra_body: object) -> dict[str, Any]:
    """A copy of ``extra_body`` as it will be sent, once every field is one JSON can carry."""
    if extra_body is None:
        return {}
    if not isinstance(extra_body, Mapping):
        raise ConfigError(
            "extra_body",
            f"must be a mapping of request fields to values, such as {{'temperature': 0.2}}, "
            f"not a {type(extra_body).__name__}",
        )
    for field, value in extra_body.items():
        try:
            json.dumps({field: value}, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(
                "extra_body",
                f"field {field!r} cannot be sent as JSON ({exc}); use str, int, float, bool, None, "
                "lists and dicts with str keys: a date as its isoformat() string, a set as a list, "
                "no NaN or infinity",
                value=dict(extra_body),
            ) from None
    # The copy is what is sent: a nested value changed later cannot make a request unsendable.
    copied: dict[str, Any] = json.loads(json.dumps(dict(extra_body)))
    return copied


class HTTPSummarizer(ChatSummarizer):
    """Base of the HTTP summarizers: one request per :meth:`complete`, retried, with the key kept secret.

    Options shared by every provider: ``base_url`` (the provider's own by
    default), ``api_key`` (else the provider's environment variable), an
    injectable ``client``, ``timeout`` per attempt in seconds, ``retry``
    (a :class:`SummarizerRetry`: how often and how long to wait); extra
    ``headers``; ``extra_body`` fields merged into every request
    (``temperature``, ...); and those of :class:`ChatSummarizer`:
    ``context_window_tokens``, ``max_message_chars``, ``counter`` and
    ``summary_prompt``.
    """

    provider: ClassVar[str]
    env_var: ClassVar[str]
    official_host: ClassVar[str]
    default_base_url: ClassVar[str]
    default_context_window_tokens: ClassVar[int]
    reply_type: ClassVar[type[Reply]]
    """The shape of the provider's reply, checked in full before any of it is read."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | SecretStr | None = None,
        client: httpx.AsyncClient | None = None,
        timeout: float = 60.0,
        retry: SummarizerRetry | None = None,
        context_window_tokens: int | None = None,
        max_message_chars: int = DEFAULT_MAX_MESSAGE_CHARS,
        counter: TokenCounter | None = None,
        summary_prompt: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            model,
            context_window_tokens=context_window_tokens,
            max_message_chars=max_message_chars,
            counter=counter,
            summary_prompt=summary_prompt,
        )
        if base_url is None:
            base_url = self.default_base_url
        parsed = urlparse(base_url) if isinstance(base_url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
            hint = "must be an http(s) URL such as 'http://127.0.0.1:11434/v1'"
            raise ConfigError(
                "base_url", hint, value=masked_url(base_url) if isinstance(base_url, str) else base_url
            )
        if "?" in base_url or "#" in base_url:
            # Not shown: a query string is where a key is most often put.
            root = masked_url(f"{parsed.scheme}://{parsed.netloc}{parsed.path}")
            raise ConfigError(
                "base_url",
                "has a query string or a fragment (not shown: it may hold a key), after which the "
                f"endpoint's path would be appended; give the API root alone, {root!r}, and any "
                "query parameters as client=httpx.AsyncClient(params={...})",
            )
        check_number("timeout", timeout, 1e-9, "must be a positive number of seconds, for example 60")
        if retry is not None and not isinstance(retry, SummarizerRetry):
            raise ConfigError(
                "retry", "must be a SummarizerRetry, for example SummarizerRetry(max_retries=0)", value=retry
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.retry = retry if retry is not None else SummarizerRetry()
        # Injectable so tests run the retry schedule without waiting and read dates on a fixed clock.
        self._sleep: Callable[[float], Awaitable[None]] = anyio.sleep
        self._now: Callable[[], datetime] = _now
        if client is not None and not isinstance(client, httpx.AsyncClient):
            # Only the type: a string here is often a proxy URL, which can hold credentials.
            raise ConfigError(
                "client",
                f"must be an httpx.AsyncClient, not a {type(client).__name__}; for a proxy pass "
                "client=httpx.AsyncClient(proxy='http://proxy:8080'), or leave it out and the "
                "summarizer makes its own",
            )
        self._extra_headers = _checked_headers(headers)
        self.extra_body: dict[str, Any] = _checked_body(extra_body)
        clashes = sorted(set(self.extra_body) & _RESERVED_BODY_FIELDS)
        if clashes:
            raise ConfigError(
                "extra_body",
                f"may not set {clashes}: the summarizer sets them itself; pass model to the "
                "constructor and max_summary_tokens to summarize()",
                value=dict(self.extra_body),
            )
        if api_key is not None and not isinstance(api_key, str | SecretStr):
            raise ConfigError(
                "api_key", f"must be a str or a pydantic SecretStr, not a {type(api_key).__name__}"
            )
        key = api_key if api_key is not None else os.environ.get(self.env_var) or None
        self._api_key: SecretStr | None = SecretStr(key) if isinstance(key, str) else key
        if self._api_key is not None and not self._api_key.get_secret_value():
            raise ConfigError(
                "api_key",
                "is empty, and would be sent as an empty key; leave it out or pass None: the key then "
                f"comes from {self.env_var}, and without one a server given as base_url is called "
                "with no key",
            )
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

    @property
    def _shown_url(self) -> str:
        """``url`` as errors, logs and ``repr`` show it: a password in it masked, as in store URLs."""
        return masked_url(self.url)

    @abstractmethod
    def _auth_headers(self, key: str) -> dict[str, str]: ...

    @abstractmethod
    def request_body(self, system: str, user: str, max_tokens: int) -> dict[str, Any]:
        """The JSON body of one summarization request."""

    # resource handling ----------------------------------------------------

    async def aclose(self) -> None:
        """Close the HTTP client this summarizer created; a client passed in is left open."""
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    def __repr__(self) -> str:
        shown = "None" if self._api_key is None else repr(str(self._api_key))
        base_url = masked_url(self.base_url)
        return f"{type(self).__name__}(model={self.model!r}, base_url={base_url!r}, api_key={shown})"

    # one request -------------------------------------------------------

    async def complete(self, system: str, user: str, max_tokens: int) -> tuple[str, str | None, Usage]:
        """Post one summarization request and read its reply, retrying what a retry can fix."""
        response = await self._post(self.request_body(system, user, max_tokens))
        reply = self._read(response)
        text = reply.text()
        if not text.strip():
            raise self._reply_error(f"got an empty summary from model {self.model!r}", response)
        if reply.was_cut():  # still the best summary there is, but its last sections may be missing
            logger.warning(
                "%s summarizer: model %r stopped at the limit of %d tokens; the summary may lack its "
                "last sections (raise max_summary_tokens or use a model that keeps to it)",
                self.provider,
                self.model,
                max_tokens,
            )
        return text.strip(), reply.model_name(), reply.token_usage()

    def _read(self, response: httpx.Response) -> Reply:
        """The reply, once its whole shape is checked; any fault is a SummarizerError naming it."""
        try:
            data = response.json()
        except ValueError:
            raise self._reply_error(
                f"got a reply that is not JSON from {self._shown_url}", response
            ) from None
        except RecursionError:  # the parser recurses once per level of nesting
            raise self._reply_error(
                f"got a malformed reply from {self._shown_url}: it is nested deeper than JSON can be read",
                response,
            ) from None
        try:
            reply = self.reply_type.model_validate(data)
        except ValidationError as exc:
            fault = describe_errors(data, exc)
            raise self._reply_error(
                f"got a malformed reply from {self._shown_url}: {fault}", response
            ) from None
        refusal = reply.refusal()
        if refusal is not None:
            raise self._reply_error(
                f"got no summary from model {self.model!r}: the reply ended with {refusal}, a refusal "
                "or a content filter (not retried)",
                response,
            )
        return reply

    def _reply_error(self, problem: str, response: httpx.Response) -> SummarizerError:
        return SummarizerError(
            self._redact(f"{self.provider} summarizer {problem}"),
            status=response.status_code,
            body=self._excerpt(response.text),
        )

    # HTTP ---------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        """The request's headers: ``headers=``, then the API key's, which replaces one of its name."""
        if self._api_key is None:
            return dict(self._extra_headers)
        return merged_headers(self._extra_headers, self._auth_headers(self._api_key.get_secret_value()))

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
        url, basic = _without_userinfo(httpx.URL(self.url), has_auth=self._client.auth is not None)
        try:
            # httpx times each read separately; the deadline also bounds a reply that trickles in.
            with anyio.fail_after(self.timeout):
                response = await self._client.post(
                    url,
                    json=body,
                    headers=self._headers(),
                    timeout=self.timeout,
                    auth=basic if basic is not None else httpx.USE_CLIENT_DEFAULT,
                )
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise RetryLater(f"{type(exc).__name__} after {self.timeout:g} s") from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise RetryLater(type(exc).__name__) from None
        except httpx.HTTPError as exc:  # a proxy, protocol or redirect failure that a retry would repeat
            # Only the kind: the text can quote a header value (a key in ``headers``) or proxy credentials.
            raise SummarizerError(
                f"{self.provider} summarizer: {self._shown_url} failed with {type(exc).__name__} "
                "(not retried)"
            ) from None
        status = response.status_code
        if status < 300:
            return response
        excerpt = self._excerpt(response.text)
        if status in _RETRIED_STATUSES or status >= 500:
            raise RetryLater(
                f"HTTP {status}",
                status=status,
                body=excerpt,
                retry_after=retry_after_seconds(response.headers, self._now()),
            )
        raise SummarizerError(self._status_message(status), status=status, body=excerpt)

    def _status_message(self, status: int) -> str:
        who = f"{self.provider} summarizer"
        if status == 401:
            return (
                f"{who}: the API key was rejected by {masked_url(self.base_url)}; check api_key "
                f"or the {self.env_var} environment variable (not retried)"
            )
        if status == 403:
            return (
                f"{who}: the API key may not use model {self.model!r} at {masked_url(self.base_url)} "
                "(not retried)"
            )
        if status == 404:
            return f"{who}: {self._shown_url} or model {self.model!r} was not found; check base_url and model"
        return f"{who}: {self._shown_url} rejected the request (not retried)"

    def _log_retry(self, state: RetryCallState) -> None:
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning(
            "%s summarizer: %s from %s, retrying in %.2f s (attempt %d of %d)",
            self.provider,
            exc,
            self._shown_url,
            wait,
            state.attempt_number + 1,
            self.retry.max_retries + 1,
        )

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retry.max_retries + 1),
            wait=wait_strategy(self.retry),
            retry=retry_if_exception_type(RetryLater),
            sleep=self._sleep,
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(body)
        except RetryLater as exc:
            attempts = self.retry.max_retries + 1
            raise SummarizerError(
                f"{self.provider} summarizer: {self._shown_url} failed after {attempts} "
                f"attempt{'s' if attempts > 1 else ''}, last with {exc.reason}",
                status=exc.status,
                body=exc.body,
            ) from None
        raise AssertionError("unreachable: tenacity either returns or raises")


def _without_userinfo(url: httpx.URL, *, has_auth: bool) -> tuple[httpx.URL, httpx.BasicAuth | None]:
    """``url`` without a user and password, and the Basic auth httpx would have made of them.

    httpx turns a URL's userinfo into Basic auth unless the client has an
    auth of its own (``has_auth``); sent that way instead, the request is the
    same, and the password is not in the URL that httpx's own INFO log line
    quotes whole.
    """
    if not url.userinfo:
        return url, None
    # Only a user or a password makes auth in httpx: an empty ``:@`` makes none.
    make = not has_auth and bool(url.username or url.password)
    return url.copy_with(userinfo=b""), httpx.BasicAuth(url.username, url.password) if make else None
