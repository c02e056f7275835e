"""Shared fixtures: the PostgreSQL server the SQL tests use, and a guard on the network."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _reachable(url: str) -> str | None:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 5432
    try:
        with socket.create_connection((host, port), timeout=2):
            return None
    except OSError as exc:
        return f"PostgreSQL at {host}:{port} is unreachable ({exc})"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The test server's URL; skips without one, except under CI where that fails."""
    url = os.environ.get("CONTEXTFOLD_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    problem = _reachable(url)
    if problem:
        hint = "set CONTEXTFOLD_TEST_POSTGRES_URL to a server you can reach"
        if os.environ.get("CI"):
            pytest.fail(f"{problem}; CI needs a real server: {hint}", pytrace=False)
        pytest.skip(f"{problem}; {hint}")
    yield url
