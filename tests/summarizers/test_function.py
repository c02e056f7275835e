"""FunctionSummarizer: any async callable as a summarizer, recording what it was sent."""

from __future__ import annotations

from collections.abc import Sequence

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
