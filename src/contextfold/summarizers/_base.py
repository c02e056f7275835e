"""The ``Summarizer`` protocol, its result, and a function-backed summarizer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from .._callables import awaited
from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._messages import Message
from ._checks import FUNCTION_SHAPE, check_summarizer_function

__all__ = ["FunctionSummarizer", "Summarizer", "Summary"]


class Summary(BaseModel):
    """A summary and what producing it cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str
    model: str
    usage: Usage = Field(default_factory=Usage)
    degraded: bool = False
    """True when a fallback produced it because the configured summarizer failed."""


@runtime_checkable
class Summarizer(Protocol):
    """Folds newly dropped messages into the previous summary."""

    async def summarize(
        self,
        messages: Sequence[Message],
        *,
        previous_summary: str | None,
        max_summary_tokens: int,
    ) -> Summary:
        """The next summary: ``previous_summary`` updated with ``messages``.

        Only the newly dropped messages are passed, so no original message is
        summarized twice.
        """
        ...


SummarizeFn = Callable[[Sequence[Message], str | None, int], Awaitable[Summary | str]]


class FunctionSummarizer:
    """A summarizer backed by any async callable ``fn(messages, previous_summary, max_tokens)``.

    ``fn`` is checked when the summarizer is built: a function that is not
    async (``def`` rather than ``async def``) or that cannot be called with
    those three arguments is a :class:`ConfigError` naming ``fn``, rather than a
    ``TypeError`` at the first fold. An object whose ``__call__`` is async, and
    a ``functools.partial`` of either, are async callables too.

    Keeps the last ``keep_calls`` calls (32 by default, 0 for none) in
    ``calls``, oldest first, so tests can assert exactly what was sent; a
    long-running agent does not hold every folded message for the life of the
    process. ``fn`` may return a ``Summary`` or a plain string; an empty or blank one
    raises :class:`SummarizerError`, as a summary that says nothing would
    erase the folded turns.
    """

    def __init__(self, fn: SummarizeFn, *, model: str = "function", keep_calls: int = 32) -> None:
        if isinstance(keep_calls, bool) or not isinstance(keep_calls, int) or keep_calls < 0:
            raise ConfigError(
                "keep_calls",
                "must be a whole number >= 0 of recent calls to keep, for example 32, or 0 for none",
                value=keep_calls,
            )
        check_summarizer_function(fn)
        self.fn = fn
        self.model = model
        self.keep_calls = keep_calls
        self.calls: list[tuple[tuple[Message, ...], str | None, int]] = []

    async def summarize(
        self,
        messages: Sequence[Message],
        *,
        previous_summary: str | None,
        max_summary_tokens: int,
    ) -> Summary:
        if self.keep_calls:
            self.calls.append((tuple(messages), previous_summary, max_summary_tokens))
            if len(self.calls) > self.keep_calls:
                del self.calls[0]
        pending = self.fn(messages, previous_summary, max_summary_tokens)
        result = await awaited(pending, self.fn, "fn", FUNCTION_SHAPE)
        summary = result if isinstance(result, Summary) else Summary(text=result, model=self.model)
        if not summary.text.strip():
            raise SummarizerError(
                f"FunctionSummarizer {summary.model!r}: {self.fn!r} returned an empty summary "
                f"({summary.text!r}); return the summary's text"
            )
        return summary
