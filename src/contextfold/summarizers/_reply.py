"""The shape of a provider's reply, checked in full before any of it is read.

Each HTTP summarizer describes its reply as a :class:`Reply` model. Validation
is strict: a token count must be a whole JSON number within
``0..MAX_REPLY_TOKENS`` (not a bool, a float, ``1e400`` or ``Infinity``),
text must be a string, and so on. Whatever does not fit is described by
:func:`describe_errors` in one line naming the field, what it held and what
was expected, so every malformed reply ends in the same ``SummarizerError``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._episodes import Usage

__all__ = ["MAX_REPLY_TOKENS", "Reply", "Strict", "TokenCount", "describe_errors"]

MAX_REPLY_TOKENS = 2**31 - 1
"""The most tokens one reply may report: far past any model's window; a larger count is garbage."""

TokenCount = Annotated[int, Field(ge=0, le=MAX_REPLY_TOKENS)] | None
"""A token count as a reply reports it; null or absent counts as none."""

_EXPECTED = {
    "int_type": "a whole number",
    "string_type": "a string",
    "list_type": "an array",
    "model_type": "an object",
    "dict_type": "an object",
    "none_required": "null",
}


class Strict(BaseModel):
    """A part of a reply: types are not coerced, fields the model does not name are ignored."""

    model_config = ConfigDict(strict=True, frozen=True)


class Reply(Strict):
    """A provider's whole reply; a subclass says where its text, usage and stop reason are."""

    model: str | None = None

    @abstractmethod
    def text(self) -> str:
        """The summary's text, ``""`` when the reply holds none."""

    @abstractmethod
    def token_usage(self) -> Usage:
        """The tokens the reply reports, none when it reports none."""

    @abstractmethod
    def refusal(self) -> str | None:
        """The provider's own words when the model declined or a filter withheld the reply, else None.

        Such a reply's text is an apology or a fragment, never a summary.
        """

    @abstractmethod
    def was_cut(self) -> bool:
        """Whether the reply stopped at the output token limit rather than where the model ended it."""

    def model_name(self) -> str | None:
        return self.model or None


def _path(data: object, error: Mapping[str, Any]) -> str:
    """Where ``error`` is in the reply (``choices[0].message``), without pydantic's union member tags."""
    loc = list(error["loc"])
    missing = loc.pop() if error["type"] == "missing" else None
    path = ""
    for step in loc:
        if isinstance(data, Mapping) and isinstance(step, str) and step in data:
            path += f".{step}" if path else step
            data = data[step]
        elif isinstance(data, list) and isinstance(step, int) and 0 <= step < len(data):
            path += f"[{step}]"
            data = data[step]
        # else: a union member's tag, such as 'str' in ('content', 'str'): the value failed as that member
    if missing is not None:
        path += f".{missing}" if path else str(missing)
    return repr(path) if path else "the reply"


def _what(value: object) -> str:
    """What a JSON value is, without quoting text (which may be anything, a key included)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        shown = repr(value)
        return shown if len(shown) <= 24 else f"a number of {len(shown)} digits"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return "an object"


def _expected(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind == "greater_than_equal":
        return f"at least {context['ge']}"
    if kind == "less_than_equal":
        return f"at most {context['le']}"
    if kind == "too_short":
        return f"an array of at least {context['min_length']} item"
    return _EXPECTED.get(kind, str(error["msg"]).removeprefix("Input should be "))


def describe_errors(data: object, exc: ValidationError) -> str:
    """The most specific fault ``exc`` found in ``data``, in one line: where, what it held, what was expected.

    Of a union, each member reports the same value; their expectations are
    joined (``a string or an array``). The deepest fault is named, so an
    array whose item is wrong is not reported as the wrong kind of array.
    """
    errors = exc.errors(include_url=False)
    paths = [_path(data, error) for error in errors]
    deepest = max(paths, key=lambda path: path.count(".") + path.count("["))
    faults = [error for error, path in zip(errors, paths, strict=True) if path == deepest]
    if faults[0]["type"] == "missing":
        return f"{deepest} is missing"
    expected = " or ".join(dict.fromkeys(_expected(error) for error in faults))
    return f"{deepest} is {_what(faults[0]['input'])}; expected {expected}"
