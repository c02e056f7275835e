"""Fixtures of the summarizer tests: a threaded server on 127.0.0.1, each provider, recorded waits.

``script`` answers each request with the next scripted action and records
what the client sent; ``provider`` runs a test once per HTTP summarizer;
``sleeps`` records every backoff wait instead of waiting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from http_fakes import ANTHROPIC, OPENAI, Provider, Script
from pytest_httpserver import HTTPServer

from contextfold.summarizers import SummarizerRetry
from contextfold.summarizers._http import HTTPSummarizer


@pytest.fixture(params=[OPENAI, ANTHROPIC], ids=lambda p: p.name)
def provider(request: pytest.FixtureRequest) -> Provider:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def server() -> Iterator[HTTPServer]:
    """A threaded server, so a request held open does not block the retry that follows it."""
    instance = HTTPServer(host="127.0.0.1", port=0, threaded=True)
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture
def script(server: HTTPServer, provider: Provider) -> Iterator[Script]:
    scripted = Script()
    server.expect_request(provider.path, method="POST").respond_with_handler(scripted)
    yield scripted
    scripted.release.set()
    server.clear()


@pytest.fixture
def base_url(server: HTTPServer, provider: Provider) -> str:
    """The server's URL as each provider's ``base_url`` expects it."""
    root = server.url_for("/").rstrip("/")
    return f"{root}/v1" if provider is OPENAI else root


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def retry() -> SummarizerRetry:
    return SummarizerRetry(initial_delay=0.5, max_delay=4.0)


@pytest.fixture
async def summarizer(
    provider: Provider, base_url: str, retry: SummarizerRetry, sleeps: list[float]
) -> AsyncIterator[HTTPSummarizer]:
    async with provider.make(base_url, retry=retry, timeout=2.0, sleeps=sleeps) as instance:
        yield instance
