"""What contextfold can tell of a callable it will await, before and after calling it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, aclosing, nullcontext
from typing import Any, TypeVar, cast

from ._errors import ConfigError

__all__ = ["awaited", "bind_error", "closing", "returns_awaitable", "unwrapped"]

_T = TypeVar("_T")


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


def awaited(pending: object, fn: object, key: str, shape: str) -> Awaitable[Any]:
    """``pending``, what calling ``fn`` returned, if it can be awaited; else a ``ConfigError`` naming ``key``.

    For the callables :func:`returns_awaitable` cannot tell (a lambda: Python
    has no async one), checked at their first call.
    """
    if not inspect.isawaitable(pending):
        reason = f"returned a {type(pending).__name__} rather than an awaitable; define it as {shape}"
        raise ConfigError(key, reason, value=fn)
    return pending


def closing(stream: AsyncIterator[_T]) -> AbstractAsyncContextManager[AsyncIterator[_T]]:
    """Close an async iterator on the way out when it can be closed.

    An async generator can, and so can any stream with an ``aclose()`` (an SDK's
    stream wrapper, say): leaving it early must not leave it (and a connection
    it holds) to the garbage collector.
    """
    if callable(getattr(stream, "aclose", None)):
        return aclosing(cast("AsyncGenerator[_T, None]", stream))
    return nullcontext(stream)
