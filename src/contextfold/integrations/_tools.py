"""Tool schemas for the SDK adapters, from plain async functions or from provider-format dicts."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from pydantic import TypeAdapter

from .._errors import ConfigError

__all__ = ["ToolSpec", "Tools", "tool_specs"]

Tools: TypeAlias = Mapping[str, Callable[..., Any]] | Sequence[Callable[..., Any] | Mapping[str, Any]]
"""The tools a model may call: ``{name: fn}`` (as given to ``StepLoop.run``), functions, or schemas."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool as a model sees it: a function's name, description and JSON schema, or a raw schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    raw: Mapping[str, Any] | None = None
    """A schema given in the provider's own format, sent as it is."""


def _from_function(name: str, fn: Callable[..., Any]) -> ToolSpec:
    try:
        parameters = TypeAdapter(cast(Any, fn)).json_schema()
    except Exception as exc:
        raise ConfigError(
            f"tools[{name!r}]",
            f"has no JSON schema for its arguments ({exc}); annotate its parameters or pass a schema dict",
            value=fn,
        ) from exc
    return ToolSpec(name, inspect.getdoc(fn) or "", parameters)


def tool_specs(tools: Tools | None) -> list[ToolSpec]:
    """The tools as specs, in order; a dict that is not ``{name: fn}`` is a provider-format schema."""
    if tools is None:
        return []
    if isinstance(tools, Mapping):
        if not all(callable(fn) for fn in tools.values()):
            raise ConfigError("tools", "a mapping must be {name: async function}", value=tools)
        return [_from_function(name, fn) for name, fn in tools.items()]
    specs: list[ToolSpec] = []
    for index, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            specs.append(ToolSpec(str(tool.get("name", index)), "", {}, raw=tool))
        elif callable(tool):
            specs.append(_from_function(getattr(tool, "__name__", str(index)), tool))
        else:
            raise ConfigError(f"tools[{index}]", "must be an async function or a schema dict", value=tool)
    return specs
