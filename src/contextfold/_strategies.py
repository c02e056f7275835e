"""How to compact: atomic units, strategies and the pure cut planner.

A working context is read as ``[pinned head, previous summary?, body...]``.
The pinned head is the run of leading system messages that are not
summaries; it always survives. The body is grouped into atomic units — a
user message; an assistant message with every tool result answering its
calls; a system message — and a plan only ever cuts between units, so a tool
call is never parted from its result.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from string import Formatter
from typing import ClassVar, Literal

from ._errors import ConfigError
from ._messages import Message, Role
from ._policy import EpisodicCompactionPressure, Pressure, Trigger
from ._tokens import ApproximateCounter

__all__ = [
    "MASKED_METADATA_KEY",
    "CompactionConfig",
    "CompactionPlan",
    "ObservationMasking",
    "Orphan",
    "SlidingWindow",
    "Strategy",
    "TokenBudget",
    "Unit",
    "group_units",
    "split_head",
]

MASKED_METADATA_KEY = "contextfold.masked"
"""Metadata key on a tool result whose output was replaced by a placeholder."""

UnitKind = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Unit:
    """Messages ``[start, stop)`` of the body that must stay or go together."""

    kind: UnitKind
    start: int
    stop: int
    pending: bool = False
    """An assistant step at the tail still waiting for some tool results."""

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Orphan:
    """A structural defect found while grouping, reported rather than raised.

    ``index`` is the message's position in the body: after the pinned head and
    the previous summary.
    """

    index: int
    tool_call_id: str
    problem: Literal["result_without_call", "call_without_result"]


def split_head(messages: Sequence[Message]) -> tuple[int, Message | None]:
    """Length of the pinned head, and the previous summary right after it, if any."""
    pinned = 0
    while pinned < len(messages) and messages[pinned].role is Role.SYSTEM and not messages[pinned].is_summary:
        pinned += 1
    if pinned < len(messages) and messages[pinned].is_summary:
        return pinned, messages[pinned]
    return pinned, None


def group_units(body: Sequence[Message]) -> tuple[list[Unit], list[Orphan]]:
    """Group messages into atomic units; report results without calls and unanswered calls.

    An assistant message and the results of its calls form one unit even when
    other messages sit between them (the unit then spans them all), so a cut
    can never fall between a call and its result.
    """
    owner: dict[str, int] = {}
    last_result: dict[int, int] = {}
    answered: dict[int, set[str]] = {}
    orphans: list[Orphan] = []
    for index, message in enumerate(body):
        if message.role is Role.ASSISTANT:
            for call in message.tool_calls:
                owner[call.id] = index
        elif message.role is Role.TOOL:
            call_id = message.tool_call_id or ""
            caller = owner.get(call_id)
            if caller is None:
                orphans.append(Orphan(index, call_id, "result_without_call"))
            else:
                last_result[caller] = index
                answered.setdefault(caller, set()).add(call_id)

    units: list[Unit] = []
    index = 0
    while index < len(body):
        message = body[index]
        if message.role is Role.ASSISTANT:
            stop = last_result.get(index, index) + 1
            scan = index + 1
            while scan < stop:  # a spanned assistant's results may reach further still
                if body[scan].role is Role.ASSISTANT:
                    stop = max(stop, last_result.get(scan, scan) + 1)
                scan += 1
            unanswered = [
                (owner_index, call.id)
                for owner_index in range(index, stop)
                if body[owner_index].role is Role.ASSISTANT
                for call in body[owner_index].tool_calls
                if call.id not in answered.get(owner_index, set())
            ]
            at_tail = stop == len(body)
            pending = bool(unanswered) and at_tail
            if unanswered and not at_tail:
                orphans.extend(Orphan(i, cid, "call_without_result") for i, cid in unanswered)
            units.append(Unit("assistant", index, stop, pending))
            index = stop
            continue
        kind: UnitKind = message.role.value  # type: ignore[assignment]
        units.append(Unit(kind, index, index + 1))
        index += 1
    orphans.sort(key=lambda o: o.index)
    return units, orphans


def _check_count(key: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, "must be a whole number >= 0", value=value)


class Strategy(ABC):
    """Decides how many of the newest units stay."""

    masks: ClassVar[bool] = False
    """Whether the strategy masks old tool outputs instead of dropping units."""

    @abstractmethod
    def keep(self, unit_tokens: Sequence[int], floor: int) -> int:
        """How many of the newest units to keep, given each unit's tokens and the floor."""


@dataclass(frozen=True, slots=True)
class SlidingWindow(Strategy):
    """Keep the newest ``keep_recent_turns`` units."""

    keep_recent_turns: int

    def __post_init__(self) -> None:
        _check_count("SlidingWindow.keep_recent_turns", self.keep_recent_turns)

    def keep(self, unit_tokens: Sequence[int], floor: int) -> int:
        return max(self.keep_recent_turns, floor)


@dataclass(frozen=True, slots=True)
class TokenBudget(Strategy):
    """Drop the oldest units until the rest fit ``max_tokens``, keeping at least ``keep_recent_turns``."""

    max_tokens: int
    keep_recent_turns: int = 0

    def __post_init__(self) -> None:
        _check_count("TokenBudget.max_tokens", self.max_tokens)
        _check_count("TokenBudget.keep_recent_turns", self.keep_recent_turns)

    def keep(self, unit_tokens: Sequence[int], floor: int) -> int:
        minimum = max(self.keep_recent_turns, floor)
        kept = 0
        kept_tokens = 0
        for tokens in reversed(unit_tokens):
            if kept >= minimum and kept_tokens + tokens > self.max_tokens:
                break
            kept_tokens += tokens
            kept += 1
        return max(kept, minimum)


_PLACEHOLDER_FIELDS = ("tool_call_id", "tokens")


def _check_placeholder(placeholder: object) -> None:
    key = "ObservationMasking.placeholder"
    if not isinstance(placeholder, str):
        raise ConfigError(
            key, "must be a string such as '[output elided: {tokens} tokens]'", value=placeholder
        )
    try:
        names = [name for _, name, _, _ in Formatter().parse(placeholder) if name is not None]
        # Attribute and index lookups ({tokens.real}, {tool_call_id[0]}) would reach into objects.
        unknown = [name for name in names if name not in _PLACEHOLDER_FIELDS]
        if not unknown:
            placeholder.format(tool_call_id="x", tokens=0)  # conversions and format specs
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            key,
            f"is not a valid format string ({exc}); use the fields {{tool_call_id}} and {{tokens}}",
            value=placeholder,
        ) from None
    if unknown:
        raise ConfigError(
            key,
            f"uses {{{unknown[0]}}}; only the fields {{tool_call_id}} and {{tokens}} are filled in",
            value=placeholder,
        )


def _content_size(message: Message) -> int:
    content = message.content
    if content is None:
        return 0
    return len(content) if isinstance(content, str) else len(json.dumps(content, ensure_ascii=False))


@dataclass(frozen=True, slots=True)
class ObservationMasking(Strategy):
    """Keep every unit, but replace tool outputs older than the newest turns with a placeholder.

    ``placeholder`` may use ``{tool_call_id}`` and ``{tokens}``. An output no
    longer than its placeholder is left as it is, since masking it would not
    save anything.
    """

    keep_recent_turns: int
    placeholder: str = "[tool output elided by contextfold: {tokens} tokens]"

    masks: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_count("ObservationMasking.keep_recent_turns", self.keep_recent_turns)
        _check_placeholder(self.placeholder)

    def keep(self, unit_tokens: Sequence[int], floor: int) -> int:
        return max(self.keep_recent_turns, floor)

    def mask(self, message: Message, tokens: int) -> Message | None:
        """The tool result with its output replaced by the placeholder, or ``None`` if that is no shorter."""
        text = self.placeholder.format(tool_call_id=message.tool_call_id, tokens=tokens)
        if len(text) >= _content_size(message):
            return None
        metadata = {**message.metadata, MASKED_METADATA_KEY: True}
        return message.model_copy(update={"content": text, "metadata": metadata})


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """Which messages of a working context stay and which go.

    ``pinned + previous_summary + dropped + kept`` is the input, in order;
    with masking, ``kept`` holds the masked copies.
    """

    pinned: tuple[Message, ...]
    previous_summary: Message | None
    dropped: tuple[Message, ...]
    kept: tuple[Message, ...]
    reason: str | None = None
    dropped_turns: int = 0
    kept_turns: int = 0
    masked: int = 0
    orphans: tuple[Orphan, ...] = ()

    @property
    def compacts(self) -> bool:
        """Whether carrying out the plan changes anything."""
        return bool(self.dropped) or self.masked > 0

    @property
    def total(self) -> int:
        return len(self.dropped) + len(self.kept)


@dataclass(frozen=True, slots=True)
class CompactionConfig:
    """Trigger, strategy and safety floors; ``plan`` is pure.

    ``min_recent_turns`` units and ``min_recent_messages`` messages always
    survive, whatever the strategy says.
    """

    trigger: Trigger
    strategy: Strategy
    min_recent_turns: int = 2
    min_recent_messages: int = 0
    _counter: ApproximateCounter = field(
        default_factory=ApproximateCounter, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.trigger, Trigger):
            raise ConfigError("trigger", "must be a Trigger such as TokenCount(8000)", value=self.trigger)
        if not isinstance(self.strategy, Strategy):
            raise ConfigError("strategy", "must be a Strategy such as SlidingWindow(8)", value=self.strategy)
        _check_count("min_recent_turns", self.min_recent_turns)
        _check_count("min_recent_messages", self.min_recent_messages)

    def with_min_recent_turns(self, min_recent_turns: int) -> CompactionConfig:
        return CompactionConfig(self.trigger, self.strategy, min_recent_turns, self.min_recent_messages)

    def plan(
        self,
        messages: Sequence[Message],
        tokens: int = 0,
        *,
        message_tokens: Sequence[int] | None = None,
        episodic: EpisodicCompactionPressure | None = None,
        force_reason: str | None = None,
    ) -> CompactionPlan:
        """Plan a cut of ``messages`` at ``tokens`` of pressure.

        ``message_tokens`` gives each message's tokens (the ~4-bytes estimate is
        used without it); ``episodic`` is the store's view for an episodic
        policy; ``force_reason`` plans a cut without asking the trigger.
        """
        if message_tokens is not None and len(message_tokens) != len(messages):
            raise ConfigError(
                "message_tokens",
                f"needs one count per message: got {len(message_tokens)} for {len(messages)} messages",
            )
        pinned_len, previous = split_head(messages)
        body_start = pinned_len + (previous is not None)
        body = messages[body_start:]
        units, orphans = group_units(body)
        pinned = tuple(messages[:pinned_len])

        def unchanged(reason: str | None) -> CompactionPlan:
            return CompactionPlan(pinned, previous, (), tuple(body), reason, 0, len(units), 0, tuple(orphans))

        reason = force_reason or self.trigger.reason(Pressure(len(units), tokens, episodic=episodic))
        if reason is None or not units:
            return unchanged(reason)

        if message_tokens is None:
            counts = [self._counter.count(m) for m in body]
        else:
            counts = list(message_tokens[body_start:])
        unit_tokens = [sum(counts[u.start : u.stop]) for u in units]

        floor = min(self.min_recent_turns, len(units))
        keep = max(self.strategy.keep(unit_tokens, floor), floor)
        if self.min_recent_messages:
            covered = 0
            while covered < len(units) and len(body) - units[-1 - covered].start < self.min_recent_messages:
                covered += 1
            keep = max(keep, min(covered + 1, len(units)))
        first_pending = next((i for i, u in enumerate(units) if u.pending), len(units))
        keep = min(max(keep, len(units) - first_pending), len(units))
        cut_unit = len(units) - keep
        if cut_unit == 0:
            return unchanged(reason)
        cut = units[cut_unit].start if cut_unit < len(units) else len(body)

        if isinstance(self.strategy, ObservationMasking):
            kept = list(body)
            masked = 0
            for position in range(cut):
                message = kept[position]
                if message.role is Role.TOOL and not message.metadata.get(MASKED_METADATA_KEY):
                    replacement = self.strategy.mask(message, counts[position])
                    if replacement is not None:
                        kept[position] = replacement
                        masked += 1
            if not masked:
                return unchanged(reason)
            return CompactionPlan(
                pinned, previous, (), tuple(kept), reason, 0, len(units), masked, tuple(orphans)
            )

        return CompactionPlan(
            pinned,
            previous,
            tuple(body[:cut]),
            tuple(body[cut:]),
            reason,
            cut_unit,
            keep,
            0,
            tuple(orphans),
        )
