"""The exception tree of contextfold.

Every error contextfold raises derives from one root::

    ContextfoldError
    ├── ConfigError            misuse: a rejected option, named by its key
    ├── InvalidMessageError    a message or wire payload that fails validation
    ├── StoreError             a storage backend failed or holds bad data
    │   ├── ConflictError      the guarded part of a thread changed underneath
    │   └── StoreClosedError   the store was used after ``aclose()``
    └── SummarizerError        a summarizer could not produce a summary

Misuse (``ConfigError``, ``InvalidMessageError``) is raised where the bad value
enters; run-time failures carry what is needed to diagnose them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "ConflictError",
    "ContextfoldError",
    "InvalidMessageError",
    "StoreClosedError",
    "StoreError",
    "SummarizerError",
]

_MISSING: Any = object()


class ContextfoldError(Exception):
    """Root of every exception contextfold raises."""


class ConfigError(ContextfoldError):
    """An option was rejected; ``key`` names it, ``reason`` says why and how to fix it."""

    def __init__(self, key: str, reason: str, *, value: Any = _MISSING) -> None:
        self.key = key
        self.reason = reason
        self.value = None if value is _MISSING else value
        self._given = value
        shown = "" if value is _MISSING else f"={value!r}"
        super().__init__(f"{key}{shown}: {reason}")

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key placed under ``prefix`` (a nested option's path)."""
        if not prefix or self.key == prefix or self.key.startswith(f"{prefix}."):
            return self
        return ConfigError(f"{prefix}.{self.key}", self.reason, value=self._given)


class InvalidMessageError(ContextfoldError, ValueError):
    """A message, or a wire-format payload, failed validation at ``field``."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class StoreError(ContextfoldError):
    """A storage backend failed, or holds data it cannot read back."""


class ConflictError(StoreError):
    """The part of a thread a caller read changed before its guarded write."""


class StoreClosedError(StoreError):
    """A store was used after ``aclose()``."""


class SummarizerError(ContextfoldError):
    """A summarizer failed; ``status`` and ``body`` come from the provider when known."""

    def __init__(self, message: str, *, status: int | None = None, body: str | None = None) -> None:
        self.status = status
        self.body = body
        detail = message
        if status is not None:
            detail += f" (HTTP {status})"
        if body:
            detail += f": {body}"
        super().__init__(detail)
