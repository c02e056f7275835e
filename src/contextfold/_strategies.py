"""How to compact: atomic units, strategies and the pure cut planner.

A working context is read as ``[pinned head, previous summary?, body...]``.
Before the first fold the pinned head is the run of leading system messages
(and, with ``keep_first``, the first units of the conversation: the task);
once a summary exists, everything before it is the pinned head. The head
always survives. The body is grouped into atomic units — a user message; an
assistant message with every tool result answering its calls; a system
message — and a plan only ever cuts between units, so a tool call is never
parted from its result. A unit still waiting for a result is *pending*: it
and everything after it stay verbatim until the result arrives (or the
compactor declares the call abandoned and closes it with an error result).

Strategies run as a pipeline: each one runs only if the context is still over
the target after the ones before it, so masking (the cheapest) can come first
and summarizing only when masking is not enough.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from string import Formatter
from typing import ClassVar, Literal

from ._errors import ConfigError
from ._messages import Message, Role, ToolCall
from ._policy import TOKEN_REASONS, EpisodicCompactionPressure, Pressure, Reason, Trigger
from ._tokens import ApproximateCounter, json_text

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
    """An assistant step still waiting for some of its tool results."""

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Orphan:
    """A tool result whose call is not in the context, reported rather than raised.

    ``index`` is the message's position in the body: after the pinned head and
    the previous summary.
    """

    index: int
    tool_call_id: str
    problem: Literal["result_without_call"] = "result_without_call"


def _leading_units(messages: Sequence[Message], start: int, count: int) -> int:
    """Index just past the first ``count`` units that begin at ``start``."""
    index = start
    for _ in range(count):
        if index >= len(messages):
            break
        units, _ = group_units(messages[index:])
        index += units[0].stop if units else 1
    return index


def split_head(messages: Sequence[Message], keep_first: int = 0) -> tuple[int, Message | None]:
    """Length of the pinned head, and the previous summary right after it, if any.

    With a summary in the context, everything before it is the head. Without
    one, the head is the leading system messages plus the first ``keep_first``
    units after them.
    """
    for index, message in enumerate(messages):
        if message.is_summary:
            return index, message
    pinned = 0
    while pinned < len(messages) and messages[pinned].role is Role.SYSTEM:
        pinned += 1
    if keep_first:
        pinned = _leading_units(messages, pinned, keep_first)
    return pinned, None


def group_units(body: Sequence[Message]) -> tuple[list[Unit], list[Orphan]]:
    """Group messages into atomic units; report tool results whose call is missing.

    An assistant message and the results of its calls form one unit even when
    other messages sit between them (the unit then spans them all), so a cut
    can never fall between a call and its result. A unit with an unanswered
    call is pending, wherever it is.
    """
    bounds = _bounds(body)
    units = [
        Unit(_UNIT_KINDS[body[start].role], start, stop, pending)
        for start, stop, pending in zip(bounds.starts, bounds.stops, bounds.pending, strict=True)
    ]
    return units, bounds.orphans


@dataclass(slots=True)
class _Bounds:
    """``group_units`` as parallel lists, which is all a plan reads (a ``Unit`` each costs more)."""

    starts: list[int]
    stops: list[int]
    pending: list[bool]
    orphans: list[Orphan]


def _bounds(body: Sequence[Message]) -> _Bounds:
    owner: dict[str, int] = {}
    last_result: dict[int, int] = {}
    answered: dict[int, set[str]] = {}
    orphans: list[Orphan] = []
    assistant, tool = Role.ASSISTANT, Role.TOOL
    roles = [message.role for message in body]
    for index, role in enumerate(roles):
        if role is assistant:
            for call in body[index].tool_calls:
                owner[call.id] = index
        elif role is tool:
            call_id = body[index].tool_call_id or ""
            caller = owner.get(call_id)
            if caller is None:
                orphans.append(Orphan(index, call_id))
            else:
                last_result[caller] = index
                answered.setdefault(caller, set()).add(call_id)

    def waiting(index: int) -> bool:
        calls = body[index].tool_calls
        got = answered.get(index, ())
        # Results only answer their caller's own ids, which a message holds once each: as
        # many answered ids as calls means none is waiting.
        return len(got) < len(calls) and any(call.id not in got for call in calls)

    starts: list[int] = []
    stops: list[int] = []
    pending: list[bool] = []
    index = 0
    end = len(body)
    while index < end:
        starts.append(index)
        if roles[index] is not assistant:
            index += 1
            stops.append(index)
            pending.append(False)
            continue
        stop = last_result.get(index, index) + 1
        waits = waiting(index)
        scan = index + 1
        while scan < stop:  # a spanned assistant's results may reach further still
            if roles[scan] is assistant:
                stop = max(stop, last_result.get(scan, scan) + 1)
                waits = waits or waiting(scan)
            scan += 1
        stops.append(stop)
        pending.append(waits)
        index = stop
    return _Bounds(starts, stops, pending, orphans)


_UNIT_KINDS: dict[Role, UnitKind] = {role: role.value for role in Role}
"""Each role's unit kind (an enum's ``value`` is a descriptor call; a lookup is not)."""


def unanswered_calls(messages: Sequence[Message]) -> list[tuple[int, ToolCall]]:
    """``(index, call)`` of every tool call in ``messages`` that no later message answers.

    A result answers the newest earlier call with its id, so ids that some
    providers reuse across replies ("call_0") pair up by position.
    """
    open_calls: dict[str, list[tuple[int, ToolCall]]] = {}
    tool = Role.TOOL  # a member looked up on its enum class costs more than the rest of the loop
    for index, message in enumerate(messages):
        for call in message.tool_calls:
            open_calls.setdefault(call.id, []).append((index, call))
        if message.role is tool:
            waiting = open_calls.get(message.tool_call_id or "")
            if waiting:
                waiting.pop()
    return sorted((entry for entries in open_calls.values() for entry in entries), key=lambda e: e[0])


def _check_count(key: str, value: int, example: str, *, least: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(key, f"must be a whole number >= {least}, for example {example}", value=value)


class Strategy(ABC):
    """Decides how many of the newest units stay verbatim.

    ``reserved`` is what the request holds besides the kept turns (the pinned
    head, the summary, what the provider adds); ``by_tokens`` says whether a
    token trigger fired (a turn or episodic trigger asks for a fold whatever
    the tokens).
    """

    masks: ClassVar[bool] = False
    """Whether the strategy masks old tool outputs instead of dropping units."""

    @abstractmethod
    def keep(
        self, unit_tokens: Sequence[int], floor: int, *, reserved: int = 0, by_tokens: bool = True
    ) -> int:
        """How many of the newest units to keep, given each unit's tokens and the floor."""

    def target(self) -> int | None:
        """Tokens the whole request aims for after this strategy, if it has a budget."""
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindow(Strategy):
    """Keep the newest ``keep_recent_turns`` units."""

    keep_recent_turns: int

    def __post_init__(self) -> None:
        _check_count("SlidingWindow.keep_recent_turns", self.keep_recent_turns, "SlidingWindow(8)")

    def keep(
        self, unit_tokens: Sequence[int], floor: int, *, reserved: int = 0, by_tokens: bool = True
    ) -> int:
        return max(self.keep_recent_turns, floor)


@dataclass(frozen=True, slots=True)
class TokenBudget(Strategy):
    """Keep the newest units that fit, with the head and summary, in ``max_tokens``.

    ``max_tokens`` covers the whole request: the pinned head and the summary
    count against it. At least ``keep_recent_turns`` units stay. When a turn
    or episodic trigger fired, only the protected turns stay.
    """

    max_tokens: int
    keep_recent_turns: int = 0

    def __post_init__(self) -> None:
        # 0 is a whole number this refuses: it gets its own reason, a negative the range >= 1.
        if type(self.max_tokens) is int and self.max_tokens == 0:
            raise ConfigError(
                "TokenBudget.max_tokens",
                "must be non-zero: the target covers the whole request, pinned head included, and no "
                "request fits in 0 tokens, so every fold would stall; use a positive target such as "
                "TokenBudget(4000), or SlidingWindow(0) to keep only the protected turns, instead of "
                "a zero target",
                value=0,
            )
        _check_count("TokenBudget.max_tokens", self.max_tokens, "TokenBudget(4000)", least=1)
        _check_count("TokenBudget.keep_recent_turns", self.keep_recent_turns, "2")

    def keep(
        self, unit_tokens: Sequence[int], floor: int, *, reserved: int = 0, by_tokens: bool = True
    ) -> int:
        minimum = max(self.keep_recent_turns, floor)
        if not by_tokens:
            return minimum
        room = self.max_tokens - reserved
        kept = 0
        kept_tokens = 0
        for tokens in reversed(unit_tokens):
            if kept >= minimum and kept_tokens + tokens > room:
                break
            kept_tokens += tokens
            kept += 1
        return max(kept, minimum)

    def target(self) -> int | None:
        return self.max_tokens


_PLACEHOLDER_FIELDS = ("tool_call_id", "tokens", "tool")


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
            placeholder.format(tool_call_id="x", tokens=0, tool="t")  # conversions and format specs
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            key,
            f"is not a valid format string ({exc}); use the fields {{tool_call_id}}, {{tool}} and {{tokens}}",
            value=placeholder,
        ) from None
    if unknown:
        raise ConfigError(
            key,
            f"uses {{{unknown[0]}}}; only the fields {{tool_call_id}}, {{tool}} and {{tokens}} are filled in",
            value=placeholder,
        )


def _tool_names(key: str, value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Collection):
        raise ConfigError(key, "must be a collection of tool names, such as ('browser',)", value=value)
    names = frozenset(value)
    if not all(isinstance(name, str) and name for name in names):
        raise ConfigError(key, "must hold non-empty tool names", value=value)
    return names


def _content_size(message: Message) -> int:
    content = message.content
    if content is None:
        return 0
    return len(content) if isinstance(content, str) else len(json_text(content))


CLEARED_ARGUMENTS = "{}"


@dataclass(frozen=True, slots=True)
class ObservationMasking(Strategy):
    """Keep every unit, but replace tool outputs older than the newest turns with a placeholder.

    ``placeholder`` may use ``{tool_call_id}``, ``{tool}`` and ``{tokens}``.
    ``tools`` limits masking to the named tools; ``exclude_tools`` never masks
    those. With ``clear_arguments`` the masked calls' arguments are cleared
    too. An output no longer than its placeholder is left as it is, since
    masking it would not save anything.
    """

    keep_recent_turns: int
    placeholder: str = "[tool output elided by contextfold: {tokens} tokens]"
    tools: Collection[str] | None = None
    exclude_tools: Collection[str] = ()
    clear_arguments: bool = False

    masks: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_count("ObservationMasking.keep_recent_turns", self.keep_recent_turns, "ObservationMasking(2)")
        _check_placeholder(self.placeholder)
        object.__setattr__(self, "tools", _tool_names("ObservationMasking.tools", self.tools))
        excluded = _tool_names("ObservationMasking.exclude_tools", self.exclude_tools)
        object.__setattr__(self, "exclude_tools", excluded or frozenset())
        if not isinstance(self.clear_arguments, bool):
            raise ConfigError(
                "ObservationMasking.clear_arguments", "must be True or False", value=self.clear_arguments
            )

    def keep(
        self, unit_tokens: Sequence[int], floor: int, *, reserved: int = 0, by_tokens: bool = True
    ) -> int:
        return max(self.keep_recent_turns, floor)

    def applies_to(self, tool: str | None) -> bool:
        """Whether outputs of ``tool`` may be masked."""
        if tool is not None and tool in self.exclude_tools:
            return False
        return self.tools is None or tool in self.tools

    def mask(self, message: Message, tokens: int, tool: str | None = None) -> Message | None:
        """The tool result with its output replaced by the placeholder, or ``None`` if that is no shorter."""
        text = self.placeholder.format(tool_call_id=message.tool_call_id, tokens=tokens, tool=tool or "tool")
        if len(text) >= _content_size(message):
            return None
        metadata = {**message.metadata, MASKED_METADATA_KEY: True}
        return message.model_copy(update={"content": text, "metadata": metadata})

    def clear(self, message: Message, masked_ids: set[str]) -> Message | None:
        """The assistant message with the arguments of masked calls cleared, or ``None`` if none changed."""
        if not self.clear_arguments:
            return None
        calls = [
            call.model_copy(update={"arguments": CLEARED_ARGUMENTS})
            if call.id in masked_ids and call.arguments != CLEARED_ARGUMENTS
            else call
            for call in message.tool_calls
        ]
        if all(new is old for new, old in zip(calls, message.tool_calls, strict=True)):
            return None
        return message.model_copy(update={"tool_calls": tuple(calls)})


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """Which messages of a working context stay and which go.

    ``pinned + previous_summary + dropped + kept`` is the input, in order;
    with masking, ``kept`` holds the masked copies, while ``dropped`` holds
    the messages as they were, for the summarizer. ``masked`` counts the
    masked tool outputs in ``kept``. ``kept_tokens`` counts ``kept`` as
    planned (masked copies by the plan's counter).
    """

    pinned: tuple[Message, ...]
    previous_summary: Message | None
    dropped: tuple[Message, ...]
    kept: tuple[Message, ...]
    reason: Reason | str | None = None
    dropped_turns: int = 0
    kept_turns: int = 0
    masked: int = 0
    orphans: tuple[Orphan, ...] = ()
    pinned_tokens: int = 0
    kept_tokens: int = 0

    @property
    def compacts(self) -> bool:
        """Whether carrying out the plan changes anything."""
        return bool(self.dropped) or self.masked > 0

    @property
    def total(self) -> int:
        return len(self.dropped) + len(self.kept)


Counter = Callable[[Message], int]


def _strategies(value: Strategy | Sequence[Strategy]) -> tuple[Strategy, ...]:
    items: tuple[object, ...]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):  # "drop" is no list
        items, listed = tuple(value), True
    else:
        items, listed = (value,), False
    if not items:
        raise ConfigError("strategy", "needs at least one Strategy, such as TokenBudget(4000)", value=value)
    strategies: list[Strategy] = []
    for position, item in enumerate(items):
        if not isinstance(item, Strategy):
            key = f"strategy[{position}]" if listed else "strategy"
            raise ConfigError(
                key, "must be a Strategy such as SlidingWindow(8) or TokenBudget(4000)", value=item
            )
        strategies.append(item)
    return tuple(strategies)


@dataclass(frozen=True, slots=True)
class CompactionConfig:
    """Trigger, strategies and safety floors; ``plan`` is pure.

    ``strategy`` is one strategy or a pipeline run in order, each only while
    the context is over the target. ``min_recent_turns`` units and
    ``min_recent_messages`` messages always survive, whatever the strategies
    say; so do the pinned head and, with ``keep_first``, the conversation's
    first units. ``summary_tokens`` is what a summary of the dropped turns
    is allowed (0 when dropped turns are not summarized); it counts against
    the target with the pinned head.
    """

    trigger: Trigger
    strategy: Strategy | Sequence[Strategy]
    min_recent_turns: int = 2
    min_recent_messages: int = 0
    keep_first: int = 0
    summary_tokens: int = 0
    strategies: tuple[Strategy, ...] = field(init=False, repr=False, compare=False)
    _counter: ApproximateCounter = field(
        default_factory=ApproximateCounter, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.trigger, Trigger):
            raise ConfigError("trigger", "must be a Trigger such as TokenCount(8000)", value=self.trigger)
        object.__setattr__(self, "strategies", _strategies(self.strategy))
        _check_count("min_recent_turns", self.min_recent_turns, "2 (the default)")
        _check_count("min_recent_messages", self.min_recent_messages, "0 (the default)")
        _check_count("keep_first", self.keep_first, "0 (the default), or 1 to pin the task")
        _check_count("summary_tokens", self.summary_tokens, "0 (the default)")

    @property
    def target(self) -> int | None:
        """The whole request's token target: the last budgeted strategy's."""
        targets = [t for t in (s.target() for s in self.strategies) if t is not None]
        return targets[-1] if targets else None

    def with_min_recent_turns(self, min_recent_turns: int) -> CompactionConfig:
        return replace(self, min_recent_turns=min_recent_turns)

    def plan(
        self,
        messages: Sequence[Message],
        tokens: int = 0,
        *,
        message_tokens: Sequence[int] | None = None,
        episodic: EpisodicCompactionPressure | None = None,
        force_reason: str | None = None,
        by_tokens: bool | None = None,
        overhead: int = 0,
        count: Counter | None = None,
    ) -> CompactionPlan:
        """Plan a cut of ``messages`` at ``tokens`` of pressure.

        ``message_tokens`` gives each message's tokens (the ~4-bytes estimate is
        used without it, and ``count`` measures masked copies); ``episodic`` is
        the store's view for an episodic policy; ``force_reason`` plans a cut
        without asking the trigger; ``by_tokens`` says whether to aim for the
        token target (by default: when the reason is a token reason) or to
        keep only the protected turns; ``overhead`` is what the provider adds
        to every request beyond these messages (tool schemas, instructions).
        """
        if message_tokens is not None and len(message_tokens) != len(messages):
            raise ConfigError(
                "message_tokens",
                f"needs one count per message: got {len(message_tokens)} for {len(messages)} messages",
            )
        counter: Counter = count if count is not None else self._counter.count
        pinned_len, previous = split_head(messages, self.keep_first)
        body_start = pinned_len + (previous is not None)
        body = messages[body_start:]
        bounds = _bounds(body)
        starts, orphans = bounds.starts, bounds.orphans
        units = len(starts)
        pinned = tuple(messages[:pinned_len])
        counts = (
            [counter(m) for m in messages] if message_tokens is None else [int(n) for n in message_tokens]
        )
        pinned_tokens = sum(counts[:pinned_len])
        body_counts = counts[body_start:]

        def unchanged(reason: str | None) -> CompactionPlan:
            return CompactionPlan(
                pinned,
                previous,
                (),
                tuple(body),
                reason,
                0,
                units,
                0,
                tuple(orphans),
                pinned_tokens,
                sum(body_counts),
            )

        reason = force_reason or self.trigger.reason(
            Pressure(
                units,
                tokens,
                messages=len(messages),
                episodic=episodic,
            )
        )
        if reason is None or not units:
            return unchanged(reason)

        if by_tokens is None:
            by_tokens = reason in TOKEN_REASONS
        floor = min(self.min_recent_turns, units)
        if self.min_recent_messages:
            covered = 0
            while covered < units and len(body) - starts[-1 - covered] < self.min_recent_messages:
                covered += 1
            floor = max(floor, min(covered + 1, units))
        first_pending = bounds.pending.index(True) if True in bounds.pending else units
        floor = max(floor, units - first_pending)

        target = self.target
        kept_body = list(body)  # masked copies replace originals here, as the strategies go
        kept_counts = list(body_counts)
        masked: set[int] = set()
        previous_tokens = counts[pinned_len] if previous is not None else 0
        for strategy in self.strategies:
            current = pinned_tokens + overhead + previous_tokens + sum(kept_counts)
            if target is not None and by_tokens and current <= target and masked:
                break  # an earlier strategy already brought the request under the target
            upto = [0, *itertools.accumulate(kept_counts)]
            unit_tokens = [upto[stop] - upto[start] for start, stop in zip(starts, bounds.stops, strict=True)]
            if isinstance(strategy, ObservationMasking):
                keep = min(max(strategy.keep(unit_tokens, floor), floor), units)
                cut = starts[units - keep] if keep else len(body)
                masked |= _mask(strategy, kept_body, kept_counts, cut, counter)
                continue
            reserve = self.summary_tokens if self.summary_tokens else previous_tokens
            keep = strategy.keep(
                unit_tokens, floor, reserved=pinned_tokens + overhead + reserve, by_tokens=by_tokens
            )
            keep = min(max(keep, floor), units)
            cut_unit = units - keep
            if cut_unit == 0:
                continue
            cut = starts[cut_unit] if cut_unit < units else len(body)
            # The summarizer reads what is dropped as it was, not the placeholders of a mask
            # applied before the cut; only the masked outputs that stay count as masked.
            return CompactionPlan(
                pinned,
                previous,
                tuple(body[:cut]),
                tuple(kept_body[cut:]),
                reason,
                cut_unit,
                keep,
                sum(position >= cut for position in masked),
                tuple(orphans),
                pinned_tokens,
                sum(kept_counts[cut:]),
            )
        if not masked:
            return unchanged(reason)
        return CompactionPlan(
            pinned,
            previous,
            (),
            tuple(kept_body),
            reason,
            0,
            units,
            len(masked),
            tuple(orphans),
            pinned_tokens,
            sum(kept_counts),
        )


def _mask(
    strategy: ObservationMasking, body: list[Message], counts: list[int], cut: int, counter: Counter
) -> set[int]:
    """Mask tool outputs of ``body[:cut]`` in place; return the positions of those masked."""
    names = {call.id: call.name for message in body[:cut] for call in message.tool_calls}
    masked_ids: set[str] = set()
    masked: set[int] = set()
    for position in range(cut):
        message = body[position]
        if message.role is not Role.TOOL or message.metadata.get(MASKED_METADATA_KEY):
            continue
        tool = names.get(message.tool_call_id or "")
        if not strategy.applies_to(tool):
            continue
        replacement = strategy.mask(message, counts[position], tool)
        if replacement is not None:
            body[position] = replacement
            counts[position] = counter(replacement)
            masked_ids.add(message.tool_call_id or "")
            masked.add(position)
    if masked_ids:
        for position in range(cut):
            cleared = strategy.clear(body[position], masked_ids) if body[position].tool_calls else None
            if cleared is not None:
                body[position] = cleared
                counts[position] = counter(cleared)
    return masked
