"""Checks that a summarizer, or any callable contextfold will await, is async and takes what it is given.

Misuse is refused where it enters, as a :class:`ConfigError` naming the
argument. Left to the first fold, a plain function passed as a summarizer fails
with an ``AttributeError`` or a ``TypeError``: not a ``SummarizerError``, so it
escapes ``on_summarizer_error="fallback"`` and stops the agent. What tells an
async callable from a plain one is in ``contextfold._callables``, which the step
loop uses for its model and tools too.
"""

from __future__ import annotations

import inspect

from .._callables import bind_error, returns_awaitable, unwrapped
from .._errors import ConfigError

__all__ = [
    "FUNCTION_SHAPE",
    "SUMMARIZE_SHAPE",
    "check_summarizer",
    "check_summarizer_function",
    "check_summarizers",
]

SUMMARIZE_SHAPE = "async def summarize(self, messages, *, previous_summary, max_summary_tokens) -> Summary"
"""What the compactor calls on a summarizer."""

FUNCTION_SHAPE = "async def fn(messages, previous_summary, max_tokens) -> str | Summary"
"""What ``FunctionSummarizer`` calls."""

_ARGUMENT = object()
"""A placeholder argument: only whether a signature accepts the call is checked."""


def _name(fn: object) -> str:
    return str(getattr(unwrapped(fn), "__name__", type(fn).__name__))


def check_summarizer_function(fn: object, *, key: str = "fn") -> None:
    """Refuse a ``FunctionSummarizer`` function that is not async or does not take three arguments."""
    if not callable(fn):
        raise ConfigError(key, f"must be a function, {FUNCTION_SHAPE}, not a {type(fn).__name__}", value=fn)
    if returns_awaitable(fn) is False:
        kind = "an async generator function" if inspect.isasyncgenfunction(unwrapped(fn)) else "not async"
        raise ConfigError(
            key,
            f"{_name(fn)} is {kind}, but FunctionSummarizer awaits its result: "
            f"define it as {FUNCTION_SHAPE} (run blocking work with anyio.to_thread.run_sync inside it)",
            value=fn,
        )
    problem = bind_error(fn, _ARGUMENT, _ARGUMENT, _ARGUMENT)
    if problem is not None:
        raise ConfigError(
            key,
            f"FunctionSummarizer calls {_name(fn)}(messages, previous_summary, max_tokens), but {problem}; "
            f"define it as {FUNCTION_SHAPE}",
            value=fn,
        )


def _not_a_summarizer(value: object) -> str:
    """Why ``value``, which has no ``summarize``, is not a summarizer, and what to pass instead."""
    if isinstance(value, str):
        return (
            "is a string, not a summarizer; to summarize with a model, pass a summarizer for it, "
            f"such as OpenAICompatibleSummarizer({value!r}) (or AnthropicSummarizer for a Claude model), "
            "opened with 'async with'"
        )
    if callable(value):
        name = _name(value)
        if returns_awaitable(value) is False:
            return (
                f"is a plain function, not a summarizer (an object with {SUMMARIZE_SHAPE}); "
                f"make it {FUNCTION_SHAPE.replace('fn', name, 1)} and pass FunctionSummarizer({name})"
            )
        return (
            f"is a function, not a summarizer; wrap it: FunctionSummarizer({name}), "
            f"which calls {FUNCTION_SHAPE.replace('fn', name, 1)}"
        )
    return (
        f"is of type {type(value).__name__}, not a summarizer; pass an object with {SUMMARIZE_SHAPE}, "
        "such as ExtractiveSummarizer(), OpenAICompatibleSummarizer('gpt-4o-mini') or "
        "FunctionSummarizer(async_fn)"
    )


def check_summarizer(value: object, *, key: str = "summarizer") -> None:
    """Refuse what has no async ``summarize(messages, *, previous_summary, max_summary_tokens)``.

    Anything with such a method is accepted, whatever its class.
    """
    if isinstance(value, type):
        raise ConfigError(
            key,
            f"is the class {value.__name__}, not a summarizer: pass an instance, {value.__name__}(...)",
            value=value,
        )
    summarize = getattr(value, "summarize", None)
    if summarize is None:
        raise ConfigError(key, _not_a_summarizer(value), value=value)
    owner = type(value).__name__
    if not callable(summarize):
        raise ConfigError(
            key,
            f"{owner}.summarize is a {type(summarize).__name__}, not a method: define {SUMMARIZE_SHAPE}",
            value=value,
        )
    if returns_awaitable(summarize) is False:
        raise ConfigError(
            key,
            f"{owner}.summarize is not async, but the compactor awaits it: define {SUMMARIZE_SHAPE}",
            value=value,
        )
    problem = bind_error(summarize, _ARGUMENT, previous_summary=_ARGUMENT, max_summary_tokens=_ARGUMENT)
    if problem is not None:
        raise ConfigError(
            key,
            f"the compactor calls {owner}.summarize(messages, previous_summary=..., max_summary_tokens=...), "
            f"but {problem}; define {SUMMARIZE_SHAPE}",
            value=value,
        )


def check_summarizers(**summarizers: object) -> None:
    """:func:`check_summarizer` on each one given (``None`` stands for the default), keyed by its argument."""
    for key, value in summarizers.items():
        if value is not None:
            check_summarizer(value, key=key)
