"""The retry settings of the HTTP summarizers, and the tenacity strategy built from them.

tenacity runs the attempts; the one thing added here is a wait that honours
the server's ``Retry-After`` and otherwise backs off exponentially with jitter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx
from tenacity import RetryCallState, wait_exponential, wait_random_exponential
from tenacity.wait import wait_base

from .._errors import ConfigError

__all__ = ["RetryLater", "SummarizerRetry", "retry_after_seconds", "wait_strategy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SummarizerRetry:
    """How an HTTP summarizer retries: 429, 408, 409, 5xx, timeouts and connection failures.

    ``max_retries`` attempts follow the first (0 disables retrying). Retry n
    waits a random time between half of and the whole of
    ``min(max_delay, initial_delay * 2 ** (n - 1))`` seconds, unless the server
    sent ``Retry-After`` (seconds or an HTTP date) or ``retry-after-ms``,
    which is honoured up to ``max_retry_after`` seconds.
    """

    max_retries: int = 2
    initial_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        retries = self.max_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(
                "SummarizerRetry.max_retries",
                "must be a whole number >= 0 (0 disables retries), for example 2",
                value=retries,
            )
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


class RetryLater(Exception):
    """A failed attempt worth repeating, with what the server said about it."""

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


def retry_after_seconds(headers: httpx.Headers, now: datetime) -> float | None:
    """Seconds the server asked us to wait, from ``retry-after-ms`` or ``Retry-After``, else None."""
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
    return max(0.0, (when - now).total_seconds())


class _RetryAfterOrBackoff(wait_base):
    """The server's ``Retry-After`` (capped) when it sent one, else jittered exponential backoff."""

    def __init__(self, settings: SummarizerRetry) -> None:
        half_initial, half_cap = settings.initial_delay / 2, settings.max_delay / 2
        # Half the ceiling for sure plus up to half again at random: uniform between half and all of it.
        self._backoff = wait_exponential(multiplier=half_initial, max=half_cap) + wait_random_exponential(
            multiplier=half_initial, max=half_cap
        )
        self._cap = settings.max_retry_after

    def __call__(self, retry_state: RetryCallState) -> float:
        outcome = retry_state.outcome
        failure = outcome.exception() if outcome is not None and outcome.failed else None
        if isinstance(failure, RetryLater) and failure.retry_after is not None:
            return min(failure.retry_after, self._cap)
        return float(self._backoff(retry_state))


def wait_strategy(settings: SummarizerRetry) -> wait_base:
    """The tenacity wait for ``settings``."""
    return _RetryAfterOrBackoff(settings)
