"""Retry timing: ``Retry-After`` in its forms, exponential backoff with jitter, and option checks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from contextfold import ConfigError
from contextfold.summarizers import SummarizerRetry

NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
RETRY = SummarizerRetry(initial_delay=1.0, max_delay=10.0, now=lambda: NOW)


def headers(**values: str) -> httpx.Headers:
    return httpx.Headers({key.replace("_", "-"): value for key, value in values.items()})


def test_retry_after_in_seconds() -> None:
    """``Retry-After: 12`` and ``Retry-After: 1.5`` are seconds."""
    assert RETRY.retry_after(headers(retry_after="12")) == 12.0
    assert RETRY.retry_after(headers(retry_after="1.5")) == 1.5


def test_retry_after_as_an_http_date() -> None:
    """An HTTP date is the time left until then; a date in the past means no wait."""
    assert (
        RETRY.retry_after(headers(retry_after=format_datetime(NOW + timedelta(seconds=42), usegmt=True)))
        == 42
    )
    assert RETRY.retry_after(headers(retry_after=format_datetime(NOW - timedelta(hours=1), usegmt=True))) == 0


def test_retry_after_ms_takes_precedence() -> None:
    """``retry-after-ms`` is the more precise hint and wins."""
    assert RETRY.retry_after(headers(retry_after_ms="250", retry_after="3")) == 0.25


def test_an_absent_or_garbled_retry_after_gives_no_hint() -> None:
    """Without a readable header the backoff schedule decides."""
    assert RETRY.retry_after(headers()) is None
    assert RETRY.retry_after(headers(retry_after="soon")) is None


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    """Retry n waits between half and all of ``initial * 2**(n-1)``, never above ``max_delay``."""
    for number, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (9, 10.0)]:
        waits = [RETRY.backoff(number) for _ in range(200)]
        assert all(ceiling / 2 <= wait <= ceiling for wait in waits)
        assert len(set(waits)) > 1, "jittered"


@pytest.mark.parametrize(
    ("key", "options"),
    [
        ("SummarizerRetry.initial_delay", {"initial_delay": -1.0}),
        ("SummarizerRetry.max_retry_after", {"max_retry_after": float("nan")}),
        ("SummarizerRetry.max_delay", {"initial_delay": 5.0, "max_delay": 1.0}),
    ],
)
def test_bad_timing_is_a_config_error(key: str, options: dict[str, float]) -> None:
    """Negative or inconsistent delays are rejected, naming the option."""
    with pytest.raises(ConfigError) as caught:
        SummarizerRetry(**options)  # type: ignore[arg-type]
    assert caught.value.key == key
