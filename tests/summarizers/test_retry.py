"""Retry timing: ``Retry-After`` in its forms, exponential backoff with jitter, and option checks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from tenacity import RetryCallState

from contextfold import ConfigError
from contextfold.summarizers import SummarizerRetry
from contextfold.summarizers._retry import RetryLater, retry_after_seconds, wait_strategy

NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
RETRY = SummarizerRetry(initial_delay=1.0, max_delay=10.0, max_retry_after=30.0)


def headers(**values: str) -> httpx.Headers:
    return httpx.Headers({key.replace("_", "-"): value for key, value in values.items()})


def after(headers: httpx.Headers) -> float | None:
    return retry_after_seconds(headers, NOW)


def wait_after(attempt: int, failure: BaseException) -> float:
    """The wait tenacity takes after attempt ``attempt`` failed with ``failure``."""
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    state.set_exception((type(failure), failure, None))
    return wait_strategy(RETRY)(state)


def test_retry_after_in_seconds() -> None:
    """``Retry-After: 12`` and ``Retry-After: 1.5`` are seconds."""
    assert after(headers(retry_after="12")) == 12.0
    assert after(headers(retry_after="1.5")) == 1.5


def test_retry_after_as_an_http_date() -> None:
    """An HTTP date is the time left until then; a date in the past means no wait."""
    assert after(headers(retry_after=format_datetime(NOW + timedelta(seconds=42), usegmt=True))) == 42
    assert after(headers(retry_after=format_datetime(NOW - timedelta(hours=1), usegmt=True))) == 0


def test_retry_after_ms_takes_precedence() -> None:
    """``retry-after-ms`` is the more precise hint and wins."""
    assert after(headers(retry_after_ms="250", retry_after="3")) == 0.25


def test_an_absent_or_garbled_retry_after_gives_no_hint() -> None:
    """Without a readable header the backoff schedule decides."""
    assert after(headers()) is None
    assert after(headers(retry_after="soon")) is None


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    """Retry n waits between half and all of ``initial * 2**(n-1)``, never above ``max_delay``."""
    for number, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (9, 10.0)]:
        waits = [wait_after(number, RetryLater("HTTP 503")) for _ in range(200)]
        assert all(ceiling / 2 <= wait <= ceiling for wait in waits)
        assert len(set(waits)) > 1, "jittered"


def test_a_server_hint_replaces_the_backoff_up_to_its_cap() -> None:
    """A failure carrying ``Retry-After`` waits exactly that, but never past ``max_retry_after``."""
    assert wait_after(1, RetryLater("HTTP 429", retry_after=3.0)) == 3.0
    assert wait_after(4, RetryLater("HTTP 429", retry_after=0.0)) == 0.0
    assert wait_after(1, RetryLater("HTTP 429", retry_after=3600.0)) == 30.0


@pytest.mark.parametrize(
    ("key", "options"),
    [
        ("SummarizerRetry.max_retries", {"max_retries": -1}),
        ("SummarizerRetry.max_retries", {"max_retries": 1.5}),
        ("SummarizerRetry.initial_delay", {"initial_delay": -1.0}),
        ("SummarizerRetry.max_retry_after", {"max_retry_after": float("nan")}),
        ("SummarizerRetry.max_delay", {"initial_delay": 5.0, "max_delay": 1.0}),
    ],
)
def test_bad_settings_are_a_config_error(key: str, options: dict[str, float]) -> None:
    """Negative or inconsistent settings are rejected, naming the setting."""
    with pytest.raises(ConfigError) as caught:
        SummarizerRetry(**options)  # type: ignore[arg-type]
    assert caught.value.key == key


def test_retry_settings_are_one_small_frozen_value() -> None:
    """The settings are four numbers, compared by value and not changeable in place."""
    assert SummarizerRetry() == SummarizerRetry(max_retries=2, initial_delay=0.5, max_delay=8.0)
    with pytest.raises(AttributeError):
        SummarizerRetry().max_retries = 5  # type: ignore[misc]
