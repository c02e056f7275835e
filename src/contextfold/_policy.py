"""When to compact: the pressure snapshot, composable triggers, the episodic policy.

Everything here is pure. A trigger looks at a :class:`Pressure` and answers
with the stable name of the reason it fires, or ``None``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction

from ._errors import ConfigError

__all__ = [
    "TOKEN_REASONS",
    "AllOf",
    "AnyOf",
    "EpisodicCompactionConfig",
    "EpisodicCompactionPressure",
    "EpisodicCompactionTrigger",
    "EpisodicPolicy",
    "MessageCount",
    "Pressure",
    "Reason",
    "TokenCount",
    "Trigger",
    "TurnCount",
    "episodic_compaction_trigger",
]


class Reason(StrEnum):
    """The stable name of why a fold happened, as results, checkpoints and events carry it.

    Those fields are typed ``Reason | str``: a :class:`Trigger` of your own may
    name its reason with a string of its own, kept as given.
    """

    TOKEN_COUNT = "token_count"
    TURN_COUNT = "turn_count"
    MESSAGE_COUNT = "message_count"
    CONTEXT_PRESSURE = "context_pressure"
    UNFINISHED_TURNS = "unfinished_turns"
    AGE_AND_TURNS = "age_and_turns"
    MANUAL = "manual"
    MANUAL_RECOVERY = "manual_recovery"


def known_reason(value: object) -> object:
    """A built-in reason's name as its :class:`Reason`; anything else as given (a checkpoint's validator)."""
    if type(value) is str:
        try:
            return Reason(value)
        except ValueError:  # a custom trigger's own name
            pass
    return value


TOKEN_REASONS = frozenset({Reason.TOKEN_COUNT, Reason.CONTEXT_PRESSURE})
"""Reasons that mean "too many tokens": a fold then aims for the token target.

Any other reason (turns, messages, unfinished turns, age) asks for a fold
whatever the tokens, and keeps only the protected recent turns.
"""


class EpisodicCompactionTrigger(StrEnum):
    """Durable reason a boundary was written; the values are stable store metadata.

    ``MANUAL_RECOVERY`` is never chosen automatically: it marks an
    operator-owned clean-slate boundary.
    """

    CONTEXT_PRESSURE = "context_pressure"
    UNFINISHED_TURNS = "unfinished_turns"
    AGE_AND_TURNS = "age_and_turns"
    MANUAL_RECOVERY = "manual_recovery"

    def as_str(self) -> str:
        return self.value


def _whole_number(
    key: str, value: int | None, example: str, *, optional: bool = False, least: int = 0
) -> None:
    """Refuse what is not a whole number of at least ``least`` (0 unless the field refuses 0 too)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(key, f"must be a whole number >= {least}, for example {example}", value=value)


@dataclass(frozen=True, slots=True)
class EpisodicCompactionPressure:
    """What a store observed since its latest summary boundary."""

    estimated_context_tokens: int | None = None
    user_messages_since_boundary: int = 0
    run_completed_since_boundary: int = 0
    user_messages_after_latest_run_completed: int = 0
    conversation_age_days: int = 0
    total_user_messages: int = 0


@dataclass(frozen=True, slots=True)
class EpisodicCompactionConfig:
    """Policy for long-lived append-only histories.

    The context-pressure threshold depends on the model and is off by default;
    the unfinished-turn and age rules are safe bounds when it is unknown.
    """

    trigger_context_tokens: int | None = None
    trigger_unfinished_turns: int = 8
    trigger_age_days: int = 30
    trigger_age_turn_count: int = 50

    def __post_init__(self) -> None:
        # 0 is a whole number these two refuse: it gets its own reason, a negative the range >= 1.
        if type(self.trigger_context_tokens) is int and self.trigger_context_tokens == 0:
            raise ConfigError(
                "trigger_context_tokens",
                "0 would fire on every request; use None to disable the context-pressure trigger",
                value=0,
            )
        if type(self.trigger_unfinished_turns) is int and self.trigger_unfinished_turns == 0:
            raise ConfigError(
                "trigger_unfinished_turns",
                "0 would fire on every request, finished or not; use a positive count such as 8",
                value=0,
            )
        _whole_number(
            "trigger_context_tokens",
            self.trigger_context_tokens,
            "100000, or None (the default)",
            optional=True,
            least=1,
        )
        _whole_number("trigger_unfinished_turns", self.trigger_unfinished_turns, "8 (the default)", least=1)
        _whole_number("trigger_age_days", self.trigger_age_days, "30 (the default)")
        _whole_number("trigger_age_turn_count", self.trigger_age_turn_count, "50 (the default)")
        if self.trigger_age_days == 0 and self.trigger_age_turn_count == 0:
            raise ConfigError(
                "trigger_age_turn_count",
                "with trigger_age_days=0 as well, the age rule would fire on every request; "
                "keep one of them positive, for example trigger_age_turn_count=50",
                value=0,
            )

    @classmethod
    def for_context_window(
        cls,
        context_window: int,
        fraction: float = 0.8,
        *,
        trigger_unfinished_turns: int = 8,
        trigger_age_days: int = 30,
        trigger_age_turn_count: int = 50,
    ) -> EpisodicCompactionConfig:
        """A config whose context-pressure threshold is ``fraction`` of the model's window."""
        return cls(
            trigger_context_tokens=fraction_of_window(context_window, fraction),
            trigger_unfinished_turns=trigger_unfinished_turns,
            trigger_age_days=trigger_age_days,
            trigger_age_turn_count=trigger_age_turn_count,
        )


def fraction_of_window(context_window: int, fraction: float) -> int:
    """``fraction`` of ``context_window`` tokens, validated, rounded down (at least 1).

    The product is taken of the fraction as written (``0.57`` is 57/100): the
    float product of 200,000 and 0.57 is 113,999.99..., a token short of the
    114,000 asked for.
    """
    if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window <= 0:
        raise ConfigError(
            "context_window", "must be a positive token count, for example 128000", value=context_window
        )
    if isinstance(fraction, bool) or not (isinstance(fraction, float | int) and 0 < fraction <= 1):
        raise ConfigError(
            "fraction", "must be in (0, 1], for example 0.8 for 80% of the window", value=fraction
        )
    return max(1, math.floor(context_window * Fraction(str(fraction))))


def episodic_compaction_trigger(
    pressure: EpisodicCompactionPressure, config: EpisodicCompactionConfig
) -> EpisodicCompactionTrigger | None:
    """The highest-priority automatic trigger, or ``None``.

    Context pressure wins because the next request may overflow; unfinished
    turns protect a conversation piling up stalled attempts; age-and-turns
    bounds healthy long conversations without compacting sparse old ones.
    """
    if (
        pressure.estimated_context_tokens is not None
        and config.trigger_context_tokens is not None
        and pressure.estimated_context_tokens >= config.trigger_context_tokens
    ):
        return EpisodicCompactionTrigger.CONTEXT_PRESSURE
    if pressure.user_messages_after_latest_run_completed >= config.trigger_unfinished_turns:
        return EpisodicCompactionTrigger.UNFINISHED_TURNS
    if (
        pressure.conversation_age_days >= config.trigger_age_days
        and pressure.total_user_messages >= config.trigger_age_turn_count
    ):
        return EpisodicCompactionTrigger.AGE_AND_TURNS
    return None


@dataclass(frozen=True, slots=True)
class Pressure:
    """The load on a working context: turns and tokens, and optionally messages and the episodic view.

    ``messages`` defaults to ``turns`` (a turn holds at least one message).
    A field of the wrong type is a :class:`ConfigError` when the snapshot is
    built, not a ``TypeError`` when a trigger compares it.
    """

    turns: int = 0
    tokens: int = 0
    messages: int | None = field(default=None, kw_only=True)
    episodic: EpisodicCompactionPressure | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("turns", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(
                    f"Pressure.{name}",
                    f"must be a whole number (int), not {type(value).__name__}, "
                    "for example Pressure(3, 4000)",
                    value=value,
                )
        messages = self.messages
        if messages is not None and (isinstance(messages, bool) or not isinstance(messages, int)):
            raise ConfigError(
                "Pressure.messages",
                "must be a whole number (int) or None (the default: as many as turns), "
                f"not {type(messages).__name__}, for example Pressure(3, 4000, messages=5)",
                value=messages,
            )
        episodic = self.episodic
        if episodic is not None and not isinstance(episodic, EpisodicCompactionPressure):
            options = (
                ", ".join(f"{key}={value!r}" for key, value in episodic.items())
                if isinstance(episodic, Mapping)
                else "user_messages_after_latest_run_completed=8"
            )
            raise ConfigError(
                "Pressure.episodic",
                "must be an EpisodicCompactionPressure or None (the default), "
                f"not {type(episodic).__name__}, for example "
                f"Pressure(3, 4000, episodic=EpisodicCompactionPressure({options}))",
                value=episodic,
            )

    @property
    def message_count(self) -> int:
        return self.turns if self.messages is None else self.messages


_new = object.__new__
_set_turns, _set_tokens, _set_messages, _set_episodic = (
    Pressure.__dict__[name].__set__ for name in ("turns", "tokens", "messages", "episodic")
)


def unchecked_pressure(
    turns: int, tokens: int, messages: int | None, episodic: EpisodicCompactionPressure | None
) -> Pressure:
    """A :class:`Pressure` of values already known to be of the right types, built without checking them.

    For the compactor's per-step check, which builds one from the store's own
    counts on every step: checking the fields cost about a fifth of a check
    that folds nothing, and building it through the slots' descriptors (as
    ``trusted`` does for models) costs less than the dataclass's own
    ``__init__``. Every field is set, so it equals the checked ``Pressure``.
    """
    pressure = _new(Pressure)
    _set_turns(pressure, turns)
    _set_tokens(pressure, tokens)
    _set_messages(pressure, messages)
    _set_episodic(pressure, episodic)
    return pressure


class Trigger(ABC):
    """Decides whether a :class:`Pressure` warrants compaction."""

    @abstractmethod
    def reason(self, pressure: Pressure) -> Reason | str | None:
        """Why this trigger fires, or ``None`` when it does not.

        A :class:`Reason` for every built-in trigger; a trigger of your own may
        name its reason with any string (it is written to the checkpoint as given).
        """

    def fires(self, pressure: Pressure) -> bool:
        return self.reason(pressure) is not None

    def should_compact(self, turns: int, tokens: int) -> bool:
        """Whether the trigger fires at ``(turns, tokens)``."""
        return self.fires(Pressure(turns, tokens))

    def __or__(self, other: Trigger) -> AnyOf:
        return AnyOf(self, other)

    def __and__(self, other: Trigger) -> AllOf:
        return AllOf(self, other)


@dataclass(frozen=True, slots=True)
class TurnCount(Trigger):
    """Fires when there are strictly more than ``limit`` turns."""

    limit: int

    def __post_init__(self) -> None:
        _whole_number("TurnCount.limit", self.limit, "TurnCount(50)")

    def reason(self, pressure: Pressure) -> Reason | str | None:
        return Reason.TURN_COUNT if pressure.turns > self.limit else None


@dataclass(frozen=True, slots=True)
class MessageCount(Trigger):
    """Fires when the working context holds strictly more than ``limit`` messages."""

    limit: int

    def __post_init__(self) -> None:
        _whole_number("MessageCount.limit", self.limit, "MessageCount(100)")

    def reason(self, pressure: Pressure) -> Reason | str | None:
        return Reason.MESSAGE_COUNT if pressure.message_count > self.limit else None


@dataclass(frozen=True, slots=True)
class TokenCount(Trigger):
    """Fires when tokens are strictly above ``limit``; never when tokens are unknown (0)."""

    limit: int

    def __post_init__(self) -> None:
        _whole_number("TokenCount.limit", self.limit, "TokenCount(8000)")

    @classmethod
    def fraction_of(cls, context_window: int, fraction: float = 0.8) -> TokenCount:
        """Fire above ``fraction`` of a model's ``context_window``."""
        return cls(fraction_of_window(context_window, fraction))

    def reason(self, pressure: Pressure) -> Reason | str | None:
        if pressure.tokens <= 0:
            return None
        return Reason.TOKEN_COUNT if pressure.tokens > self.limit else None


class _Combined(Trigger):
    __slots__ = ("triggers",)

    def __init__(self, *triggers: Trigger) -> None:
        if len(triggers) < 2:
            raise ConfigError(type(self).__name__, "combines at least two triggers", value=triggers)
        for t in triggers:
            if not isinstance(t, Trigger):
                raise ConfigError(type(self).__name__, "takes Trigger instances", value=t)
        self.triggers = triggers

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.triggers == self.triggers

    def __hash__(self) -> int:
        return hash((type(self), self.triggers))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.triggers))})"


class AnyOf(_Combined):
    """Fires when any trigger fires; the reason is the first one's that fires."""

    def reason(self, pressure: Pressure) -> Reason | str | None:
        for trigger in self.triggers:
            found = trigger.reason(pressure)
            if found is not None:
                return found
        return None


class AllOf(_Combined):
    """Fires when every trigger fires; the reason is the first one's."""

    def reason(self, pressure: Pressure) -> Reason | str | None:
        reasons = [trigger.reason(pressure) for trigger in self.triggers]
        if any(r is None for r in reasons):
            return None
        return reasons[0]


@dataclass(frozen=True, slots=True)
class EpisodicPolicy(Trigger):
    """The episodic policy as a trigger; the runtime's token count is the context estimate.

    At run time the age rule counts the user messages since the latest
    applied checkpoint, as all pressure is measured from that boundary: once
    a fold has written one, the rule waits for ``trigger_age_turn_count`` new
    user messages instead of firing on every check.
    """

    config: EpisodicCompactionConfig = field(default_factory=EpisodicCompactionConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.config, EpisodicCompactionConfig):
            given = self.config
            options = (
                ", ".join(f"{key}={value!r}" for key, value in given.items())
                if isinstance(given, Mapping)
                else "trigger_unfinished_turns=8"
            )
            example = f"EpisodicPolicy(EpisodicCompactionConfig({options}))"
            raise ConfigError(
                "EpisodicPolicy.config",
                f"must be an EpisodicCompactionConfig, not {type(given).__name__}; pass {example}",
                value=given,
            )

    def reason(self, pressure: Pressure) -> Reason | str | None:
        base = pressure.episodic or EpisodicCompactionPressure()
        observed = EpisodicCompactionPressure(
            estimated_context_tokens=pressure.tokens or base.estimated_context_tokens,
            user_messages_since_boundary=base.user_messages_since_boundary,
            run_completed_since_boundary=base.run_completed_since_boundary,
            user_messages_after_latest_run_completed=base.user_messages_after_latest_run_completed,
            conversation_age_days=base.conversation_age_days,
            total_user_messages=base.user_messages_since_boundary,
        )
        found = episodic_compaction_trigger(observed, self.config)
        return None if found is None else found.value
