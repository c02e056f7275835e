"""Checks that a summarizer, or any callable contextfold will await, is async and takes what it is given.

Misuse is refused where it enters, as a :class:`ConfigError` naming the
argument. Left to the first fold, a plain function passed as a summarizer fails
with an ``AttributeError`` or a ``TypeError``: not a ``SummarizerError``, so it
escapes ``on_summarizer_error="fallback"`` and stops the agent. The step loop
uses :func:`returns_awaitable` for its model and tools too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .._errors import ConfigError

__all__ = [
    "FUNCTION_SHAPE",
    "SUMMARIZE_SHAPE",
    "bind_error",
    "check_summarizer",
    "check_summarizer_function",
    "check_summarizers",
    "returns_awaitable",
    "unwrapped",
]

SUMMARIZE_SHAPE = "async def summarize(self, messages, *, previous_summary, max_summary_tokens) -> Summary"
"""What the compactor calls on a summarizer."""

FUNCTION_SHAPE = "async def fn(messages, previous_summary, max_tokens) -> str | Summary"
"""What ``FunctionSummarizer`` calls."""

_ARGUMENT = object()
"""A placeholder argument: only whether a signature accepts the call is checked."""


def unwrapped(fn: object) -> object:
    """``fn`` without its ``functools.partial`` and bound-method layers."""
    for _ in range(64):  # a partial of a bound method of a partial...: a bounded walk
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        else:
            break
    return fn


def returns_awaitable(fn: object) -> bool | None:
    """Whether calling ``fn`` returns an awaitable: ``True``, ``False``, or ``None`` when it cannot be told.

    ``True`` for a coroutine function, a ``functools.partial`` or bound method of
    one, a ``functools.wraps`` wrapper of one, and an object whose ``__call__`` is
    one. ``False`` for any other function written with ``def`` (an async generator
    function included: its call gives an async iterator, not an awaitable), and
    an object whose ``__call__`` is such a function. ``None`` for a lambda
    (Python has no async lambda, so a lambda returning a coroutine is fine; its
    result has to be checked when called), a class, and builtins or C callables.
    """
    fn = unwrapped(fn)
    if isinstance(fn, type):
        return None
    if inspect.iscoroutinefunction(fn):
        return True
    if inspect.isfunction(fn):
        try:
            inner = inspect.unwrap(fn)
        except ValueError:  # a cycle of __wrapped__
            inner = fn
        if inner is not fn:
            return returns_awaitable(inner)
        return None if fn.__name__ == "<lambda>" else False
    call = inspect.getattr_static(type(fn), "__call__", None)
    if inspect.isfunction(call):
        return returns_awaitable(call)
    return None


def bind_error(fn: object, *args: Any, **kwargs: Any) -> str | None:
    """Why ``fn`` cannot take these arguments; ``None`` when it can, or when its signature is unreadable."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin, or a C callable without a text signature
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"its signature {signature} does not accept them ({exc})"
    return None


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
