"""Tool schemas for the SDK adapters: from functions, from provider dicts, and refused otherwise."""

from __future__ import annotations

import pytest

from contextfold import ConfigError
from contextfold.integrations._tools import tool_specs


async def search(query: str, limit: int = 5) -> str:
    """Search the notes."""
    return query * limit


def test_functions_and_raw_schemas_become_specs() -> None:
    """A function gets its name, docstring and argument schema; a dict is sent as given."""
    raw = {"type": "function", "function": {"name": "raw"}}
    [fn, given] = tool_specs([search, raw])
    assert (fn.name, fn.description, fn.parameters["required"]) == ("search", "Search the notes.", ["query"])
    assert given.raw == raw
    assert tool_specs({"find": search})[0].name == "find"
    assert tool_specs(None) == []


def test_something_else_is_refused() -> None:
    """A tool that is neither a function nor a schema dict fails with a ConfigError naming it."""
    with pytest.raises(ConfigError, match=r"tools\[0\]"):
        tool_specs([42])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="tools"):
        tool_specs({"x": 42})  # type: ignore[dict-item]
