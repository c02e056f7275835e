"""FunctionSummarizer: any async callable as a summarizer, recording what it was sent."""

from __future__ import annotations

from collections.abc import Sequence

from contextfold import Message, Usage
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
