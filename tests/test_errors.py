"""The exception tree: one root, misuse apart from run-time failures, messages that name what failed."""

from __future__ import annotations

import pytest

import contextfold
from contextfold import (
    ConfigError,
    ConflictError,
    ContextfoldError,
    InvalidMessageError,
    StoreClosedError,
    StoreError,
    SummarizerError,
)


@pytest.mark.parametrize(
    "kind", [ConfigError, InvalidMessageError, StoreError, ConflictError, StoreClosedError, SummarizerError]
)
def test_every_error_derives_from_the_one_root(kind: type[Exception]) -> None:
    """Catching ContextfoldError catches every error contextfold raises."""
    assert issubclass(kind, ContextfoldError)


def test_store_failures_share_a_branch_and_misuse_does_not() -> None:
    """ConflictError and StoreClosedError are StoreErrors; misuse errors are not run-time failures."""
    assert issubclass(ConflictError, StoreError)
    assert issubclass(StoreClosedError, StoreError)
    assert not issubclass(ConfigError, StoreError | SummarizerError)
    assert not issubclass(InvalidMessageError, StoreError | SummarizerError)


def test_the_module_docstring_draws_the_whole_tree() -> None:
    """Every exception exported by contextfold is drawn in the tree of the errors module's docstring."""
    doc = contextfold._errors.__doc__ or ""
    exported = [
        name
        for name in contextfold.__all__
        if isinstance(getattr(contextfold, name), type) and issubclass(getattr(contextfold, name), Exception)
    ]
    assert exported
    for name in exported:
        assert name in doc, name


def test_config_error_is_not_a_value_error_so_pydantic_never_wraps_it() -> None:
    """ConfigError is no ValueError: raised inside a pydantic validator it reaches the caller as it is."""
    assert not issubclass(ConfigError, ValueError)


def test_config_error_carries_key_reason_and_value() -> None:
    """ConfigError keeps key, reason and value, and its message reads key=value: reason."""
    error = ConfigError("compaction.trigger_token_budget", "must be positive, for example 8000", value=-3)
    assert (error.key, error.reason, error.value) == (
        "compaction.trigger_token_budget",
        "must be positive, for example 8000",
        -3,
    )
    assert str(error) == "compaction.trigger_token_budget=-3: must be positive, for example 8000"


def test_config_error_without_a_value_shows_only_the_key() -> None:
    """Without a value the message is key: reason, and value is None."""
    error = ConfigError("trigger", "must be a Trigger")
    assert error.value is None
    assert str(error) == "trigger: must be a Trigger"


def test_config_error_can_be_placed_under_a_nested_key() -> None:
    """under(prefix) prefixes the key once, keeping value and reason."""
    error = ConfigError("trigger_age_days", "must be a whole number >= 0", value=-1)
    nested = error.under("compaction.episodic")
    assert nested.key == "compaction.episodic.trigger_age_days"
    assert str(nested) == "compaction.episodic.trigger_age_days=-1: must be a whole number >= 0"
    assert nested.under("compaction.episodic") is nested
    assert error.under("") is error
    assert str(ConfigError("x", "bad").under("a")) == "a.x: bad"


def test_invalid_message_error_names_its_field() -> None:
    """InvalidMessageError keeps the field and reason and reads field: reason."""
    error = InvalidMessageError("messages[2].tool_call_id", "is required")
    assert (error.field, error.reason) == ("messages[2].tool_call_id", "is required")
    assert str(error) == "messages[2].tool_call_id: is required"


def test_summarizer_error_shows_status_and_body_when_known() -> None:
    """SummarizerError appends the HTTP status and the provider's body to its message."""
    error = SummarizerError("the summarizer failed", status=429, body='{"error": "rate limited"}')
    assert (error.status, error.body) == (429, '{"error": "rate limited"}')
    assert str(error) == 'the summarizer failed (HTTP 429): {"error": "rate limited"}'
    bare = SummarizerError("no reply")
    assert (bare.status, bare.body, str(bare)) == (None, None, "no reply")
