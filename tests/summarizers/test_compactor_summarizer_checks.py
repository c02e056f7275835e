"""A Compactor refuses a summarizer that cannot summarize when it is built, not at the first fold.

At the fold such a summarizer failed with an AttributeError or a TypeError: not a
SummarizerError, so even on_summarizer_error="fallback" let it stop the agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest.mock import AsyncMock

import pytest

from contextfold import Compactor, ConfigError, Message, RunOptions, SummarizeOptions, Usage
from contextfold.stores import MemoryStore
from contextfold.summarizers import ChatSummarizer, ExtractiveSummarizer, FunctionSummarizer, Summary
from contextfold.tokens import ApproximateCounter

OPTIONS = RunOptions(
    max_history_tokens=4000,
    compaction=SummarizeOptions(trigger_token_budget=1000, max_summary_tokens=200),
)


def sync_fn(messages: Sequence[Message], previous: str | None, budget: int) -> str:
    return "summary"


async def async_fn(messages: Sequence[Message], previous: str | None, budget: int) -> str:
    return f"summary of {len(messages)}"


class SyncSummarize:
    def summarize(
        self, messages: Sequence[Message], *, previous_summary: str | None, max_summary_tokens: int
    ) -> str:
        return "summary"


class PositionalOnly:
    """summarize(messages, previous_summary, max_tokens) positionally: the compactor passes keywords."""

    async def summarize(self, messages: Sequence[Message], previous: str | None, budget: int, /) -> Summary:
        return Summary(text="summary", model="m")


class NotCallable:
    summarize = "later"


def refused(summarizer: Any, key: str = "summarizer") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Compactor(MemoryStore(), options=OPTIONS, **{key: summarizer})
    assert info.value.key == key and info.value.value is summarizer
    assert repr(summarizer) in str(info.value)
    return info.value


def test_a_bare_async_function_is_told_to_wrap_it_in_function_summarizer() -> None:
    """summarizer=async_fn names the function and the fix, FunctionSummarizer(async_fn)."""
    error = refused(async_fn)
    assert "is a function, not a summarizer; wrap it: FunctionSummarizer(async_fn)" in error.reason


def test_a_plain_function_is_told_to_become_async_and_be_wrapped() -> None:
    error = refused(sync_fn)
    assert "is a plain function" in error.reason
    assert "async def sync_fn(messages, previous_summary, max_tokens)" in error.reason
    assert "FunctionSummarizer(sync_fn)" in error.reason


def test_a_model_name_is_told_which_summarizer_takes_it() -> None:
    error = refused("gpt-4o-mini")
    assert "is a string, not a summarizer" in error.reason
    assert "OpenAICompatibleSummarizer('gpt-4o-mini')" in error.reason


def test_a_class_is_told_to_be_instantiated() -> None:
    error = refused(ExtractiveSummarizer)
    assert "pass an instance, ExtractiveSummarizer(...)" in error.reason


@pytest.mark.parametrize(
    ("summarizer", "why"),
    [
        (SyncSummarize(), "SyncSummarize.summarize is not async"),
        (PositionalOnly(), "the compactor calls PositionalOnly.summarize(messages, previous_summary=..."),
        (NotCallable(), "NotCallable.summarize is a str, not a method"),
        (object(), "is of type object, not a summarizer"),
    ],
    ids=["sync-summarize", "wrong-signature", "not-a-method", "object"],
)
def test_an_object_without_an_async_summarize_of_the_protocols_shape_is_refused(
    summarizer: object, why: str
) -> None:
    error = refused(summarizer)
    assert why in error.reason
    assert "async def summarize(self, messages, *, previous_summary, max_summary_tokens)" in error.reason


def test_the_fallback_is_checked_too() -> None:
    error = refused(async_fn, key="fallback")
    assert "FunctionSummarizer(async_fn)" in error.reason


class KeywordSummarizer:
    """A user's own summarizer: any class with an async summarize of the protocol's shape."""

    async def summarize(
        self, messages: Sequence[Message], *, previous_summary: str | None, max_summary_tokens: int
    ) -> Summary:
        return Summary(text=f"{previous_summary or ''} +{len(messages)}", model="own")


class LooseSummarizer:
    async def summarize(self, messages: Sequence[Message], **options: Any) -> Summary:
        return Summary(text=f"loose +{len(messages)}", model="loose")


def mocked() -> AsyncMock:
    mock = AsyncMock()
    mock.summarize.return_value = Summary(text="mocked", model="mock")
    return mock


@pytest.mark.parametrize(
    "make",
    [KeywordSummarizer, LooseSummarizer, mocked, lambda: FunctionSummarizer(async_fn)],
    ids=["keyword", "kwargs", "async-mock", "function"],
)
async def test_valid_summarizers_are_accepted_and_fold(make: Any) -> None:
    """Whatever its class, an object with an async summarize folds, with no degraded fallback."""
    async with MemoryStore() as store:
        compactor = Compactor(store, options=OPTIONS, summarizer=make(), counter=ApproximateCounter())
        for n in range(14):
            await compactor.append("t", [Message.user(f"step {n}: " + "please " * 40)])
        result = await compactor.maybe_compact("t")
    assert result is not None and result.compacted and not result.degraded


class _Windowed(ChatSummarizer):
    """A chat summarizer whose model has a small window; never asked here."""

    async def complete(self, system: str, user: str, max_tokens: int) -> tuple[str, str | None, Usage]:
        raise AssertionError("not called")


@pytest.mark.parametrize("role", ["summarizer", "fallback"])
def test_a_summary_size_the_summarizers_window_cannot_hold_is_refused_when_built(role: str) -> None:
    """Before, the first fold raised it: a ConfigError, past the fallback policy, stopping the agent."""
    small = _Windowed("small", context_window_tokens=2048, counter=ApproximateCounter())
    options = RunOptions(max_history_tokens=8_000, compaction=SummarizeOptions(trigger_token_budget=4_000))
    with pytest.raises(ConfigError, match=r"context_window_tokens=2048; use at most about \d+") as caught:
        Compactor(MemoryStore(), options=options, **{role: small})
    assert caught.value.key == "compaction.max_summary_tokens"
    assert "max_summary_tokens=1000:" in str(caught.value)  # the default: 1024 or half the target
    fitting = RunOptions(
        max_history_tokens=8_000,
        compaction=SummarizeOptions(trigger_token_budget=4_000, max_summary_tokens=400),
    )
    Compactor(MemoryStore(), options=fitting, **{role: small})


def test_a_budget_the_default_summarizer_cannot_serve_is_refused_when_built() -> None:
    """trigger_token_budget=100 leaves max_summary_tokens=25, below the extractive headings: refused."""
    options = RunOptions(max_history_tokens=400, compaction=SummarizeOptions(trigger_token_budget=100))
    with pytest.raises(ConfigError) as caught:
        Compactor(MemoryStore(), options=options)
    assert caught.value.key == "compaction.max_summary_tokens" and caught.value.value == 25
    assert "needs for its section headings alone, so every fold would fail" in caught.value.reason
    assert "such as a FunctionSummarizer" in caught.value.reason


def test_the_extractive_fallback_is_checked_when_the_policy_may_ask_it() -> None:
    """Beside a summarizer writing short summaries, the extractive one is checked under "fallback" only."""
    short = FunctionSummarizer(async_fn)

    def options(policy: Any) -> SummarizeOptions:
        return SummarizeOptions(trigger_token_budget=100, on_summarizer_error=policy)

    Compactor(MemoryStore(), options=options("raise"), summarizer=short)
    Compactor(MemoryStore(), options=options("skip"), summarizer=short)
    with pytest.raises(ConfigError, match="section headings") as caught:
        Compactor(MemoryStore(), options=options("fallback"), summarizer=short)
    assert caught.value.key == "max_summary_tokens" and caught.value.value == 25
