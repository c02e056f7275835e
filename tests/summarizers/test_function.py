"""FunctionSummarizer: any async callable as a summarizer, recording what it was sent."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from contextfold import ConfigError, Message, SummarizerError, Usage
from contextfold.summarizers import FunctionSummarizer, Summarizer, Summary


async def test_records_each_call_and_wraps_a_plain_string() -> None:
    """Every call is recorded with its arguments, and a returned string becomes a Summary."""

    async def fn(messages: Sequence[Message], previous: str | None, budget: int) -> str:
        return f"{previous or ''}+{len(messages)}@{budget}"

    summarizer = FunctionSummarizer(fn, model="scripted")
    batch = [Message.user("a"), Message.user("b")]
    summary = await summarizer.summarize(batch, previous_summary="s0", max_summary_tokens=64)
    assert summary == Summary(text="s0+2@64", model="scripted")
    assert summarizer.calls == [(tuple(batch), "s0", 64)]
    assert isinstance(summarizer, Summarizer)


async def test_a_returned_summary_is_passed_through() -> None:
    """A Summary returned by the function keeps its own model, usage and degraded flag."""
    made = Summary(text="t", model="m", usage=Usage(input_tokens=3, output_tokens=1), degraded=True)

    async def fn(messages: Sequence[Message], previous: str | None, budget: int) -> Summary:
        return made

    assert await FunctionSummarizer(fn).summarize([], previous_summary=None, max_summary_tokens=1) is made


@pytest.mark.parametrize(
    "empty", ["", "  \n\t", Summary(text=" ", model="m")], ids=["empty", "blank", "blank-summary"]
)
async def test_an_empty_or_blank_summary_is_a_summarizer_error(empty: str | Summary) -> None:
    """A function returning "" or whitespace raises SummarizerError rather than erasing the folded turns."""

    async def fn(messages: Sequence[Message], previous: str | None, budget: int) -> str | Summary:
        return empty

    with pytest.raises(SummarizerError, match="empty summary"):
        await FunctionSummarizer(fn).summarize(
            [Message.user("a")], previous_summary=None, max_summary_tokens=64
        )


async def test_a_compactor_given_an_empty_summary_falls_back_instead_of_writing_it() -> None:
    """Through a Compactor, an empty summary follows on_summarizer_error: the fold uses the fallback."""
    from contextfold import Compactor, RunOptions, SummarizeOptions
    from contextfold.stores import MemoryStore
    from contextfold.tokens import ApproximateCounter

    async def fn(messages: Sequence[Message], previous: str | None, budget: int) -> str:
        return ""

    options = RunOptions(
        max_history_tokens=4000,
        compaction=SummarizeOptions(trigger_token_budget=1000, max_summary_tokens=200),
    )
    async with MemoryStore() as store:
        compactor = Compactor(
            store, options=options, summarizer=FunctionSummarizer(fn), counter=ApproximateCounter()
        )
        for n in range(14):
            await compactor.append("t", [Message.user(f"step {n}: read /srv/f{n}.txt " + "please " * 40)])
        result = await compactor.maybe_compact("t")
        context = await compactor.context("t")
    assert result is not None and result.compacted and result.degraded
    assert context[0].is_summary
    assert "## Facts and identifiers" in context[0].text and "/srv/f0.txt" in context[0].text


async def test_only_the_last_calls_are_kept() -> None:
    """A long run keeps the last keep_calls calls, not every folded message for the life of the process.

    Every call used to stay in ``calls``: 50 agents of 200 steps held all 10,000
    messages they folded, which every full garbage collection then walked.
    """

    async def fn(messages: Sequence[Message], previous: str | None, budget: int) -> str:
        return f"summary of {len(messages)}"

    default = FunctionSummarizer(fn)
    for n in range(100):
        await default.summarize([Message.user(f"m{n}")], previous_summary=None, max_summary_tokens=8)
    assert [call[0][0].text for call in default.calls] == [f"m{n}" for n in range(68, 100)]
    none = FunctionSummarizer(fn, keep_calls=0)
    await none.summarize([Message.user("x")], previous_summary=None, max_summary_tokens=8)
    assert none.calls == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "32"])
def test_keep_calls_must_be_a_whole_number(bad: object) -> None:
    """A keep_calls that is not a whole number >= 0 is a ConfigError naming it."""

    async def fn(messages: Sequence[Message], previous: str | None, budget: int) -> str:
        return "s"

    with pytest.raises(ConfigError) as info:
        FunctionSummarizer(fn, keep_calls=bad)  # type: ignore[arg-type]
    assert info.value.key == "keep_calls" and info.value.value == bad
    assert "for example 32" in info.value.reason


def synchronous(messages: Sequence[Message], previous: str | None, budget: int) -> str:
    return "summary"


async def one_argument(messages: Sequence[Message]) -> str:
    return "summary"


def test_a_function_that_is_not_async_is_refused_when_built() -> None:
    """A plain def is a ConfigError naming fn, its value and the fix, not a TypeError at the first fold."""
    with pytest.raises(ConfigError) as info:
        FunctionSummarizer(synchronous)  # type: ignore[arg-type]
    assert info.value.key == "fn" and info.value.value is synchronous
    assert "synchronous is not async" in info.value.reason
    assert "async def fn(messages, previous_summary, max_tokens)" in info.value.reason


def test_an_async_generator_function_is_refused_when_built() -> None:
    """An async generator is not awaitable either; the error says what it is."""

    async def streams(messages: Sequence[Message], previous: str | None, budget: int) -> AsyncIterator[str]:
        yield "summary"

    with pytest.raises(ConfigError) as info:
        FunctionSummarizer(streams)  # type: ignore[arg-type]
    assert info.value.key == "fn" and info.value.value is streams
    assert "async generator function" in info.value.reason


def test_a_function_that_cannot_take_the_three_arguments_is_refused_when_built() -> None:
    """fn(messages, previous_summary, max_tokens) is checked against the signature, naming fn and the fix."""
    with pytest.raises(ConfigError) as info:
        FunctionSummarizer(one_argument)  # type: ignore[arg-type]
    assert info.value.key == "fn" and info.value.value is one_argument
    assert "one_argument(messages, previous_summary, max_tokens)" in info.value.reason
    assert "(messages: 'Sequence[Message]') -> 'str'" in info.value.reason
    assert "too many positional arguments" in info.value.reason


class AsyncCallable:
    """An object whose __call__ is async: an async callable as much as a function."""

    async def __call__(self, messages: Sequence[Message], previous: str | None, budget: int) -> str:
        return f"object summary of {len(messages)}"


class OpaqueSignature(AsyncCallable):
    """An async callable whose signature cannot be read (as a builtin's may not be): accepted."""

    __signature__ = "unreadable"


async def four_arguments(style: str, messages: Sequence[Message], previous: str | None, budget: int) -> str:
    return f"{style} summary of {len(messages)}"


def wrapped(fn: Any) -> Any:
    """A sync functools.wraps wrapper around an async function, as decorators make them."""

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        return fn(*args)

    return wrapper


async def plain(messages: Sequence[Message], previous: str | None, budget: int) -> str:
    return f"summary of {len(messages)}"


@pytest.mark.parametrize(
    "fn",
    [
        plain,
        AsyncCallable(),
        OpaqueSignature(),
        functools.partial(four_arguments, "terse"),
        functools.partial(AsyncCallable()),
        wrapped(plain),
        lambda messages, previous, budget: plain(messages, previous, budget),
    ],
    ids=[
        "async-def",
        "async-call",
        "unreadable-signature",
        "partial",
        "partial-of-object",
        "wraps",
        "lambda",
    ],
)
async def test_async_callables_of_every_kind_are_accepted(fn: Any) -> None:
    """Coroutine functions, async __call__, partials, wrappers and lambdas returning a coroutine all work."""
    summary = await FunctionSummarizer(fn).summarize(
        [Message.user("a")], previous_summary=None, max_summary_tokens=8
    )
    assert summary.text.endswith("summary of 1")


async def test_a_lambda_that_returns_no_awaitable_is_a_config_error_when_called() -> None:
    """A lambda cannot be async, so it passes the build; a result that cannot be awaited names fn."""
    fn = lambda messages, previous, budget: "summary"  # noqa: E731
    summarizer = FunctionSummarizer(fn)
    with pytest.raises(ConfigError) as info:
        await summarizer.summarize([Message.user("a")], previous_summary=None, max_summary_tokens=8)
    assert info.value.key == "fn" and info.value.value is fn
    assert "returned a str rather than an awaitable" in info.value.reason
