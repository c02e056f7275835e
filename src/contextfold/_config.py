"""Run and compaction options, validated when they are built.

Options are frozen pydantic models. A rejected option raises
:class:`ConfigError` (never pydantic's ``ValidationError``) naming the key, the
bad value and a value that would work.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from ._errors import ConfigError
from ._messages import Role
from ._policy import AllOf, AnyOf, EpisodicCompactionConfig, EpisodicPolicy, TokenCount, Trigger
from ._strategies import CompactionConfig, ObservationMasking, Strategy, TokenBudget

if TYPE_CHECKING:
    from pydantic.config import ExtraValues

    from .summarizers import ChatSummarizer, ExtractiveSummarizer, Summarizer

__all__ = [
    "WINDOW_MULTIPLE_OF_TRIGGER",
    "CompactionMode",
    "OnSummarizerError",
    "RunOptions",
    "Settings",
    "SummarizeOptions",
    "check_summary_room",
    "resolve_settings",
]

WINDOW_MULTIPLE_OF_TRIGGER = 4
"""How many trigger budgets of history compaction loads and can summarize."""

DEFAULT_MAX_SUMMARY_TOKENS = 1024

_SUMMARY_ROLES = "'user' (the default), 'system' or 'assistant'"
"""The roles a summary may take: any but ``tool``, since a summary answers no tool call."""

_SMALLEST_BUDGET = 4
"""The smallest budget whose default target (half of it) leaves room for a summary."""

CompactionMode = Literal["summarize", "drop", "mask", "mask_then_summarize"]
OnSummarizerError = Literal["raise", "skip", "fallback"]


class _Options(BaseModel):
    """Frozen options whose validation failures surface as ``ConfigError``.

    ``ConfigError`` is not a ``ValueError``, so pydantic lets it through
    unwrapped; pydantic's own field errors are turned into one here. This
    holds for the constructor, ``model_validate``, ``model_validate_json``
    (malformed JSON included), ``model_copy(update=...)`` and options nested
    in other options alike.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    _key_prefix: ClassVar[str] = ""
    _examples: ClassVar[dict[str, str]] = {}
    """A value that works, for the options whose default does not show one."""

    @model_validator(mode="wrap")
    @classmethod
    def _validate(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        try:
            options = handler(data)
        except ValidationError as exc:
            raise _config_error(exc, cls) from None
        options._check()
        return options

    @classmethod
    def model_validate_json(
        cls,
        json_data: str | bytes | bytearray,
        *,
        strict: bool | None = None,
        extra: ExtraValues | None = None,
        context: Any | None = None,
        by_alias: bool | None = None,
        by_name: bool | None = None,
    ) -> Self:
        # Text that is not JSON fails before any validator runs.
        given: dict[str, Any] = {
            "strict": strict,
            "extra": extra,
            "context": context,
            "by_alias": by_alias,
            "by_name": by_name,
        }
        try:  # only the options given, so older pydantic releases without some of them still work
            return super().model_validate_json(json_data, **{k: v for k, v in given.items() if v is not None})
        except ValidationError as exc:
            raise _config_error(exc, cls) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update`` the changed options are validated like new ones."""
        if not update:
            return super().model_copy(deep=deep)
        return self.model_validate({**self._given(), **update})

    def _given(self) -> dict[str, Any]:
        """The options the caller set, which ``model_copy`` rebuilds from."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    def _check(self) -> None:
        """Cross-field rules; raise ``ConfigError``."""


_TYPE_ERRORS = {
    "int_type": "a whole number (int)",
    "int_parsing": "a whole number (int)",
    "int_from_float": "a whole number (int)",
    "dict_type": "a mapping of options",
    "model_type": "a mapping of options",
    "model_attributes_type": "a mapping of options",
    "dataclass_type": "a mapping of options",
}


def _words(key: str) -> set[str]:
    return {word.rstrip("s") for word in key.lower().split("_") if word}


def _closest(key: str, known: Sequence[str]) -> str | None:
    """The option ``key`` most likely misspells: most words shared, then most alike; ``None`` if none is."""
    words = _words(key)

    def likeness(name: str) -> tuple[int, float]:
        return len(words & _words(name)), difflib.SequenceMatcher(None, key, name).ratio()

    best = max(known, key=likeness, default=None)
    if best is None:
        return None
    shared, alike = likeness(best)
    return best if shared or alike >= 0.75 else None


def _config_error(exc: ValidationError, cls: type[_Options]) -> ConfigError:
    errors = exc.errors()
    # A misspelt option is what a "required" error beside it comes from: name the misspelling.
    first = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
    loc = tuple(first["loc"])
    prefix = cls._key_prefix
    path = ".".join([prefix, *map(str, loc)] if prefix else map(str, loc)) or prefix or "options"
    kind, given = first["type"], first.get("input")
    reason = first["msg"].removeprefix("Value error, ").replace("Input should be", "must be", 1)
    if kind == "missing":
        field = cls.model_fields.get(str(loc[-1]))
        examples = (field.examples if field else None) or []
        hint = f", for example {loc[-1]}={examples[0]!r}" if examples else ""
        return ConfigError(path, f"is required{hint}")
    if kind == "extra_forbidden":
        known = sorted(cls.model_fields)  # a nested model reports its own unknown keys
        close = _closest(str(loc[-1]), known)
        guess = f"did you mean {close}? " if close else ""
        return ConfigError(path, f"is not an option; {guess}the options are {', '.join(known)}", value=given)
    if kind == "json_invalid":
        return ConfigError(path, f"{reason}; pass a JSON object of options", value=given)
    if kind in _TYPE_ERRORS:
        reason = f"must be {_TYPE_ERRORS[kind]}, not {type(given).__name__}"
        if kind.startswith("int_") and len(loc) == 1 and str(loc[0]) in cls.model_fields:
            reason += f", for example {_whole_example(cls, str(loc[0]), given)}"
    elif kind in _RANGE_ERRORS and len(loc) == 1 and str(loc[0]) in cls.model_fields:
        reason = _range_reason(cls, str(loc[0]), given)
    return ConfigError(path, reason, value=given)


_RANGE_ERRORS = frozenset(
    {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
)


def _range_reason(cls: type[_Options], name: str, given: Any) -> str:
    """What values ``name`` takes and one that works, for a value outside its range."""
    field = cls.model_fields[name]
    bounds: list[str] = []
    for rule in field.metadata:
        for attribute, words in (("gt", "above"), ("ge", "at least"), ("lt", "below"), ("le", "at most")):
            bound = getattr(rule, attribute, None)
            if bound is not None:
                bounds.append(f"{words} {bound:g}")
    whole = isinstance(field.default, int) or field.annotation in (int, int | None)
    allowed = f"{'a whole number' if whole else 'a number'} {' and '.join(bounds)}"
    example = _example(cls, name)
    if isinstance(given, float) and math.isnan(given):
        return f"is not a number; it must be {allowed}, for example {example}"
    if isinstance(given, float) and math.isinf(given):  # "never" is a None where a field takes one
        return f"is infinite; it must be a finite {allowed.removeprefix('a ')}, for example {example}"
    return f"must be {allowed}, for example {example}"


def _example(cls: type[_Options], name: str) -> str:
    """A value of ``name`` that works: the class's own example, else its default."""
    example = cls._examples.get(name)
    if example is not None:
        return example
    field = cls.model_fields[name]
    if field.is_required():
        return repr(field.examples[0]) if field.examples else "see the option's documentation"
    default = field.default
    return f"{default!r} (the default)" if default is not None else "None (the default)"


def _whole_example(cls: type[_Options], name: str, given: Any) -> str:
    """The whole number a float or text ``given`` meant (``8000.0``, ``"8000"``), else ``_example``."""
    meant: int | None = None
    if isinstance(given, float) and given.is_integer():
        meant = int(given)
    elif isinstance(given, str) and given.strip().lstrip("+-").isdigit():
        meant = int(given)
    return str(meant) if meant is not None else _example(cls, name)


def _default_summary_tokens(budget: Any, target: Any) -> int | None:
    """1024, or half the target when that is smaller; ``None`` when the budget is unusable."""
    if type(target) is int:
        aim: int = target
    elif type(budget) is int:
        aim = budget // 2
    else:
        return None
    return min(DEFAULT_MAX_SUMMARY_TOKENS, aim // 2) if aim >= 2 else None


class SummarizeOptions(_Options):
    """When and how to fold the older part of a thread: the preset built on triggers and strategies.

    Compaction fires once the working context is above
    ``trigger_token_budget`` tokens (or the optional episodic policy fires),
    then keeps the newest whole turns that fit ``target_tokens`` together with
    the pinned head and the summary — never fewer than ``min_recent_messages``
    messages or ``min_recent_turns`` turns — and folds the rest into the
    summary. ``max_summary_tokens`` defaults to 1024 or half the target,
    whichever is smaller. The same objects are available directly:
    ``Compactor(store, trigger=..., strategy=...)``.
    """

    _key_prefix: ClassVar[str] = "compaction"
    _examples: ClassVar[dict[str, str]] = {
        "target_tokens": "half of trigger_token_budget, or None (the default: half of it)",
        "max_summary_tokens": (
            "a quarter of trigger_token_budget, or leave it unset for 1024 or half the target, "
            "whichever is smaller"
        ),
        "keep_first": "0 (the default), or 1 to pin the first user message",
        "max_tool_output_tokens": "2000, or None (the default) for no cap",
        "abandon_after_turns": (
            "8 (the default), or None to abandon by time only, with abandon_after_seconds set"
        ),
        "abandon_after_seconds": "600, or None (the default) to abandon by turns only",
        "background_at": "0.8, or None (the default) to summarize within the step",
    }

    trigger_token_budget: int = Field(strict=True, examples=[8000])
    min_recent_messages: int = Field(default=8, ge=0, strict=True)
    target_tokens: int | None = Field(default=None, gt=0, strict=True)
    min_recent_turns: int = Field(default=2, ge=0, strict=True)
    keep_first: int = Field(default=0, ge=0, strict=True)
    max_summary_tokens: int = Field(default=DEFAULT_MAX_SUMMARY_TOKENS, gt=0, strict=True)
    mode: CompactionMode = "summarize"
    episodic: EpisodicCompactionConfig | None = None
    summary_role: Role = Role.USER
    on_summarizer_error: OnSummarizerError = "fallback"
    max_tool_output_tokens: int | None = Field(default=None, gt=0, strict=True)
    abandon_after_turns: int | None = Field(default=8, gt=0, strict=True)
    abandon_after_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    background_at: float | None = Field(default=None, gt=0, lt=1, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "keep_recent_messages" in data:
            raise ConfigError(
                "compaction.keep_recent_messages",
                "was renamed min_recent_messages, the name the planner uses too; pass "
                f"min_recent_messages={data['keep_recent_messages']!r}",
                value=data["keep_recent_messages"],
            )
        return data

    @field_validator("episodic", mode="wrap")
    @classmethod
    def _episodic_key(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            if isinstance(value, Mapping):
                # Built here rather than by pydantic, which would turn "3" into 3 before the
                # config's own checks could see it.
                options = [f.name for f in fields(EpisodicCompactionConfig)]
                unknown = [key for key in value if key not in options]
                if unknown:
                    raise ConfigError(
                        str(unknown[0]),
                        f"is not an option; the options are {', '.join(options)}",
                        value=value[unknown[0]],
                    )
                value = EpisodicCompactionConfig(**value)
            return handler(value)
        except ConfigError as exc:  # the episodic config's own rule, keyed relative to it
            raise exc.under("compaction.episodic") from None

    @field_validator("summary_role", mode="wrap")
    @classmethod
    def _summary_role(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Role:
        # pydantic's own message lists every Role, 'tool' included, which this option refuses.
        try:
            role: Role = handler(value)
        except ValidationError:
            raise ConfigError("compaction.summary_role", f"must be {_SUMMARY_ROLES}", value=value) from None
        if role is Role.TOOL:
            raise ConfigError(
                "compaction.summary_role",
                f"a summary answers no tool call; use {_SUMMARY_ROLES}",
                value=role.value,
            )
        return role

    @model_validator(mode="wrap")
    @classmethod
    def _default_summary_size(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        # A fixed default would reject every small budget over a key the caller never set.
        derived = isinstance(data, dict) and "max_summary_tokens" not in data
        if derived:
            size = _default_summary_tokens(data.get("trigger_token_budget"), data.get("target_tokens"))
            if size is not None:
                data = {**data, "max_summary_tokens": size}
        options = handler(data)
        if derived:  # not given, so model_copy derives it again from a new budget and errors call it unset
            options.__pydantic_fields_set__.discard("max_summary_tokens")
        return options

    def _check(self) -> None:
        budget = self.trigger_token_budget
        if budget == 0:
            raise ConfigError(
                "compaction.trigger_token_budget",
                "must be non-zero when compaction is enabled; disable it with "
                "RunOptions.without_compaction() instead of setting a zero budget, or use a "
                f"budget of at least {_SMALLEST_BUDGET}, for example 8000",
                value=0,
            )
        if budget < 0:
            raise ConfigError(
                "compaction.trigger_token_budget",
                f"must be a positive token count of at least {_SMALLEST_BUDGET}, for example 8000",
                value=budget,
            )
        if self.target_tokens is not None and self.target_tokens >= budget:
            raise ConfigError(
                "compaction.target_tokens",
                f"must be below trigger_token_budget={budget}, or every step would compact "
                f"again; use at most {budget - 1} (default: half the budget)",
                value=self.target_tokens,
            )
        if self.effective_target_tokens < 2:
            key = "target_tokens" if self.target_tokens is not None else "trigger_token_budget"
            raise ConfigError(
                f"compaction.{key}",
                "leaves no room for a summary below the target; use a trigger_token_budget of at "
                f"least {_SMALLEST_BUDGET} (the target defaults to half of it) or a target_tokens "
                "of at least 2",
                value=getattr(self, key),
            )
        context = self.episodic.trigger_context_tokens if self.episodic is not None else None
        target = self.effective_target_tokens
        if context is not None and context <= target:
            aim = (
                "target_tokens"
                if self.target_tokens is not None
                else f"half of trigger_token_budget={budget}"
            )
            raise ConfigError(
                "compaction.episodic.trigger_context_tokens",
                f"fires a fold at {context} tokens, at or below the {target}-token target ({aim}) the "
                "fold aims for, so no fold can bring the context below it and it would fire again on "
                f"every check; use a trigger_context_tokens above {target}, for example {budget} (the "
                f"trigger_token_budget), or a target_tokens below {context}, for example {context // 2}",
                value=context,
            )
        if self.background_at is not None and self.background_at * budget <= self.effective_target_tokens:
            smallest = self.effective_target_tokens / budget
            raise ConfigError(
                "compaction.background_at",
                f"starts the summary at {self.background_at * budget:g} tokens, at or below the "
                f"{self.effective_target_tokens}-token target a fold aims for, so it would fold again at "
                f"once; use a fraction above {smallest:g}, for example 0.8",
                value=self.background_at,
            )
        if self.abandon_after_turns is None and self.abandon_after_seconds is None:
            raise ConfigError(
                "compaction.abandon_after_turns",
                "is None and so is abandon_after_seconds, so a tool call that never gets its result is "
                "never abandoned: it stays pending and blocks every fold of its thread for good; keep "
                "abandon_after_turns=8 (the default), or set abandon_after_seconds, for example 600, to "
                "abandon by time only",
                value=None,
            )
        if self.max_summary_tokens >= self.effective_target_tokens:
            raise ConfigError(
                "compaction.max_summary_tokens",
                f"must be below the target of {self.effective_target_tokens} tokens the "
                f"compacted context aims for; use at most {self.effective_target_tokens // 2}",
                value=self.max_summary_tokens,
            )

    @property
    def effective_target_tokens(self) -> int:
        """Tokens the kept tail aims to fit after a compaction."""
        if self.target_tokens is not None:
            return self.target_tokens
        return max(1, self.trigger_token_budget // 2)

    @property
    def window_tokens(self) -> int:
        """Tokens of history compaction can see: the budget times ``WINDOW_MULTIPLE_OF_TRIGGER``."""
        return self.trigger_token_budget * WINDOW_MULTIPLE_OF_TRIGGER

    @property
    def trigger(self) -> Trigger:
        token_trigger = TokenCount(self.trigger_token_budget)
        if self.episodic is None:
            return token_trigger
        return EpisodicPolicy(self.episodic) | token_trigger

    def strategy(self) -> tuple[Strategy, ...]:
        """The strategy pipeline these options stand for."""
        budget = TokenBudget(self.effective_target_tokens, keep_recent_turns=self.min_recent_turns)
        if self.mode == "mask":
            return (ObservationMasking(keep_recent_turns=self.min_recent_turns),)
        if self.mode == "mask_then_summarize":
            return (ObservationMasking(keep_recent_turns=self.min_recent_turns), budget)
        return (budget,)

    @property
    def summarizes(self) -> bool:
        return self.mode in ("summarize", "mask_then_summarize")

    def compaction_config(self) -> CompactionConfig:
        """The pure planner these options stand for."""
        return CompactionConfig(
            self.trigger,
            self.strategy(),
            min_recent_turns=self.min_recent_turns,
            min_recent_messages=self.min_recent_messages,
            keep_first=self.keep_first,
            summary_tokens=self.max_summary_tokens if self.summarizes else 0,
        )


class RunOptions(_Options):
    """Options of one agent run: the history limit and compaction (off unless configured)."""

    max_history_tokens: int = Field(default=128_000, gt=0, strict=True)
    compaction: SummarizeOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _budget_that_works_here(cls, data: Any) -> Any:
        """A zero or negative budget given with these options: name the smallest one they take.

        ``SummarizeOptions`` alone knows no ``max_history_tokens``, and the
        budget it would suggest could break the window rule below. Only a
        budget the options are then checked to take is named; anything else
        (an unknown option beside it, say) is left to the usual checks.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("compaction"), Mapping):
            return data
        compaction = data["compaction"]
        budget = compaction.get("trigger_token_budget")
        limit = data.get("max_history_tokens", cls.model_fields["max_history_tokens"].default)
        if type(budget) is not int or budget > 0 or type(limit) is not int or limit <= 0:
            return data  # not this case; the fields' own checks word anything else
        quarter = -(-limit // WINDOW_MULTIPLE_OF_TRIGGER)
        least = max(_SMALLEST_BUDGET, quarter)
        example = min(max(least, 8000), limit)
        taken = [n for n in dict.fromkeys((example, least)) if cls._takes(data, n)]
        if not taken:
            return data
        why = f"max_history_tokens = {limit} / {WINDOW_MULTIPLE_OF_TRIGGER}, rounded up"
        given = "must be non-zero when compaction is enabled; disable it with "
        given += "RunOptions.without_compaction() instead of setting a zero budget, or use"
        raise ConfigError(
            "compaction.trigger_token_budget",
            (given if budget == 0 else "must be a positive token count; use")
            + f" a budget from {least}{f' ({why})' if least == quarter else ''} to {limit}, "
            f"for example {taken[0]}",
            value=budget,
        )

    @classmethod
    def _takes(cls, data: Mapping[str, Any], budget: int) -> bool:
        """Whether the options ``data`` holds are valid with ``budget`` as the trigger's."""
        try:
            cls.model_validate({**data, "compaction": {**data["compaction"], "trigger_token_budget": budget}})
        except ConfigError:
            return False
        return True

    def _check(self) -> None:
        opts = self.compaction
        if opts is None:
            return
        if opts.trigger_token_budget > self.max_history_tokens:
            raise ConfigError(
                "compaction.trigger_token_budget",
                f"is above max_history_tokens = {self.max_history_tokens}, so requests would grow past "
                "that limit before any fold. Lower compaction.trigger_token_budget to "
                f"{self.max_history_tokens} or less, or raise max_history_tokens to at least "
                f"{opts.trigger_token_budget}",
                value=opts.trigger_token_budget,
            )
        window = opts.window_tokens
        if window < self.max_history_tokens:
            minimum = -(-self.max_history_tokens // WINDOW_MULTIPLE_OF_TRIGGER)
            raise ConfigError(
                "compaction.trigger_token_budget",
                f"trigger_token_budget * {WINDOW_MULTIPLE_OF_TRIGGER} = {window} is below "
                f"max_history_tokens = {self.max_history_tokens}, so a thread the request path "
                "can restore would exceed the window compaction can see, and history past that "
                "window would be discarded without being summarized. Raise "
                f"compaction.trigger_token_budget to at least {minimum}, or lower "
                "max_history_tokens",
                value=opts.trigger_token_budget,
            )

    @classmethod
    def without_compaction(cls, max_history_tokens: int = 128_000) -> Self:
        """Options that never compact: the explicit way to turn compaction off."""
        return cls(max_history_tokens=max_history_tokens, compaction=None)


def _token_limit(trigger: Trigger) -> int | None:
    """The token count from which a trigger fires on tokens alone, if it has one."""
    found = _limit_source(trigger)
    return found[0] if found is not None else None


def _limit_source(trigger: Trigger) -> tuple[int, str] | None:
    """``_token_limit`` and the sub-trigger that sets it, as a user would write it."""
    if isinstance(trigger, TokenCount):
        return trigger.limit, f"TokenCount({trigger.limit})"
    if isinstance(trigger, EpisodicPolicy):
        context = trigger.config.trigger_context_tokens
        return (context, f"trigger_context_tokens={context}") if context else None
    if isinstance(trigger, AnyOf | AllOf):
        found = [limit for t in trigger.triggers if (limit := _limit_source(t)) is not None]
        if not found:
            return None
        # AnyOf fires at its lowest limit; AllOf only once every token limit is passed.
        return (min if isinstance(trigger, AnyOf) else max)(found, key=lambda pair: pair[0])
    return None


def _check_target_below_trigger(
    config: CompactionConfig,
    *,
    trigger: Trigger | None,
    strategy: Strategy | Sequence[Strategy] | None,
    preset: SummarizeOptions | None,
) -> None:
    """Refuse a fold target at or above the token limit that fires the fold.

    A fold then leaves the context over its trigger, so every step folds again
    (or, when the target keeps every turn, every check stalls).
    """
    found = _limit_source(config.trigger)
    target = config.target
    if found is None or target is None or target < found[0]:
        return
    limit, source = found
    if trigger is None:
        fires = f"the options' trigger ({source})"
    elif isinstance(trigger, TokenCount):
        fires = f"trigger={source}"
    else:
        fires = f"trigger={trigger!r} ({source})"
    above = max(target * 2, target + 1)
    wider = f"TokenCount({above})" if source.startswith("TokenCount") else f"trigger_context_tokens={above}"
    if strategy is not None:
        # The smallest target the summary check below accepts: above a preset's summary size, or 2
        # when summaries get half the target.
        if preset is not None:
            least = preset.max_summary_tokens + 1 if preset.summarizes else 1
        else:
            least = 1 if all(s.masks for s in config.strategies) else 2
        lower = ""
        if least < limit:  # else no target below the trigger is accepted: name only the trigger
            budgeted = [s for s in config.strategies if s.target() == target][-1]
            aim = max(limit // 2, least)
            smaller = (
                repr(replace(budgeted, max_tokens=aim))
                if isinstance(budgeted, TokenBudget)
                else f"TokenBudget({aim})"
            )
            lower = f"a target below {limit}, for example {smaller}, or "
        raise ConfigError(
            "strategy",
            f"aims a fold at {target} tokens, at or above the {limit} tokens at which {fires} fires, "
            f"so no fold can bring the context below the trigger and it would fire again on every "
            f"step; use {lower}a trigger above {target}, for example {wider}",
            value=strategy,
        )
    assert preset is not None  # a trigger alone is refused before this
    # target_tokens needs room for a summary below it: 2, or above a summary size the caller set.
    least = preset.max_summary_tokens + 1 if _summary_size_given(preset) and preset.summarizes else 2
    aim = max(limit // 2, least)
    lower = f", or compaction.target_tokens below {limit}, for example {aim}" if aim < limit else ""
    raise ConfigError(
        "trigger",
        f"fires a fold at {limit} tokens ({source}), at or below the {target}-token target of the "
        "options (compaction.target_tokens, half of trigger_token_budget by default), so no fold can "
        "bring the context below the trigger and it would fire again on every step; use a trigger "
        f"above {target}, for example TokenCount({preset.trigger_token_budget}){lower}",
        value=trigger,
    )


def _summary_key(options: object) -> str:
    """Where ``max_summary_tokens`` was given, as a ``ConfigError`` about it names it."""
    return "compaction.max_summary_tokens" if isinstance(options, RunOptions) else "max_summary_tokens"


def _preset_of(options: object) -> SummarizeOptions | None:
    if isinstance(options, SummarizeOptions):
        return options
    return options.compaction if isinstance(options, RunOptions) else None


def _summary_size_given(preset: SummarizeOptions) -> bool:
    """Whether the caller set ``max_summary_tokens``, rather than leaving it derived from the budget."""
    return "max_summary_tokens" in preset.model_fields_set


def _with_target(config: CompactionConfig, target: int) -> str:
    """The strategy aiming at ``target`` instead, with a trigger above it when the current one fires below.

    A fold's target must stay below the tokens at which its trigger fires
    (see ``_check_target_below_trigger``), so a larger target may need a
    larger trigger too.
    """
    budgeted = [s for s in config.strategies if s.target() is not None and s.target() == config.target]
    wider = (
        repr(replace(budgeted[-1], max_tokens=target))
        if budgeted and isinstance(budgeted[-1], TokenBudget)
        else f"TokenBudget({target})"
    )
    found = _limit_source(config.trigger)
    if found is None or found[0] > target:
        return wider
    above = 2 * target
    source = found[1]
    trigger = f"TokenCount({above})" if source.startswith("TokenCount") else f"trigger_context_tokens={above}"
    return f"{wider} with a trigger above it, such as {trigger} in place of {source}"


def _check_summary_below_target(config: CompactionConfig) -> None:
    """Refuse a strategy alone whose target leaves a summary (half of it) no room: a 1-token target.

    A preset's summary size against a strategy's target is checked with the
    summarizers (``check_summary_room``), whose needs bound the size to suggest.
    """
    target = config.target
    if target is None or target >= 2:
        return
    found = _limit_source(config.trigger)
    aim = found[0] // 2 if found is not None and found[0] >= 4 else 4000
    raise ConfigError(
        "strategy",
        f"aims a fold at {target} token, which leaves a summary no room below it (a summary gets half "
        f"the target); use a target of at least 2, for example {_with_target(config, aim)}",
        value=config.strategy,
    )


def _summary_above_target_error(
    settings: Settings,
    options: object,
    preset: SummarizeOptions,
    needs: tuple[ExtractiveSummarizer, str] | None,
) -> ConfigError:
    """A preset's summary size at or above a strategy's target, with only fixes the summarizers accept.

    ``needs`` is the extractive summarizer asked that needs the most tokens for
    its headings, and who it is in words; ``None`` when no summarizer asked has
    a least size.
    """
    config, size = settings.config, settings.max_summary_tokens
    target = config.target
    assert target is not None
    least = needs[0].least_summary_tokens() if needs is not None else 1
    fixes: list[str] = []
    if least <= target - 1:  # a size that both the target and the summarizer accept
        most = target // 2 if target // 2 >= least else target - 1
        if needs is None:
            fixes.append(f"set max_summary_tokens to at most {most}")
        else:
            span = f"to {least}" if least == most else f"to between {least} and {most}"
            fixes.append(f"set max_summary_tokens {span} ({needs[1]} needs {least} for its section headings)")
    if size >= least:  # the summarizer takes this size: a target above it is enough
        fixes.append(f"use a target above {size}, for example {_with_target(config, 2 * size)}")
    elif needs is not None and not fixes:  # neither alone: a size the summarizer takes, and targets above it
        fixes.append(f"set {_larger_targets(settings, preset, needs[0].advised_summary_tokens())}")
    unset = (
        ""
        if _summary_size_given(preset)
        else " (unset, it is 1024 or half the preset's own target, whichever is smaller)"
    )
    return ConfigError(
        _summary_key(options),
        f"must be below the {target}-token target of strategy={config.strategy!r}, which replaces the "
        f"preset's target{unset}: a summary that large leaves the kept turns no room, so folds would end "
        f"over the target; {', or '.join(fixes)}",
        value=size,
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a ``Compactor`` needs, resolved from a preset or from triggers and strategies."""

    config: CompactionConfig
    summarize: bool
    max_summary_tokens: int
    summary_role: Role
    on_summarizer_error: OnSummarizerError
    max_tool_output_tokens: int | None
    hard_limit: int | None
    """``RunOptions.max_history_tokens``: tool outputs are cut to keep a request under it."""
    window_tokens: int | None
    """History a fold loads; ``None`` loads the whole thread."""
    budget: int | None
    """The token limit the trigger fires above, if it has one."""
    abandon_after_turns: int | None
    abandon_after_seconds: float | None
    background_at: float | None
    episodic: bool
    """Whether the trigger needs the episodic view."""

    @property
    def target(self) -> int | None:
        return self.config.target


def _needs_episodic(trigger: Trigger) -> bool:
    if isinstance(trigger, EpisodicPolicy):
        return True
    if isinstance(trigger, AnyOf | AllOf):
        return any(_needs_episodic(t) for t in trigger.triggers)
    return False


def resolve_settings(
    options: RunOptions | SummarizeOptions | None,
    trigger: Trigger | None,
    strategy: Strategy | Sequence[Strategy] | None,
) -> Settings | None:
    """The settings of a compactor, or ``None`` when compaction is off.

    ``trigger`` and ``strategy`` replace the preset's own; given alone they
    need no preset at all.
    """
    if options is not None and not isinstance(options, RunOptions | SummarizeOptions):
        raise ConfigError("options", "must be RunOptions(...) or SummarizeOptions(...)", value=options)
    if trigger is not None and not isinstance(trigger, Trigger):
        raise ConfigError("trigger", "must be a Trigger such as TokenCount(8000)", value=trigger)
    run = options if isinstance(options, RunOptions) else None
    preset = options if isinstance(options, SummarizeOptions) else (run.compaction if run else None)
    if preset is None and trigger is None and strategy is None:
        return None
    if preset is None and (trigger is None or strategy is None):
        missing = "strategy" if trigger is not None else "trigger"
        example = "TokenBudget(4000)" if missing == "strategy" else "TokenCount(8000)"
        raise ConfigError(
            missing,
            f"is needed with {'trigger' if missing == 'strategy' else 'strategy'}= when no "
            f"SummarizeOptions preset is given; pass {missing}={example}, or options=SummarizeOptions(...)",
        )
    if preset is not None:
        base = preset.compaction_config()
        config = CompactionConfig(
            trigger if trigger is not None else base.trigger,
            strategy if strategy is not None else base.strategies,
            min_recent_turns=base.min_recent_turns,
            min_recent_messages=base.min_recent_messages,
            keep_first=base.keep_first,
            summary_tokens=base.summary_tokens,
        )
        if trigger is not None or strategy is not None:  # the preset checked its own pair
            _check_target_below_trigger(config, trigger=trigger, strategy=strategy, preset=preset)
        hard = run.max_history_tokens if run is not None else None
        return Settings(
            config=config,
            summarize=preset.summarizes,
            max_summary_tokens=preset.max_summary_tokens,
            summary_role=preset.summary_role,
            on_summarizer_error=preset.on_summarizer_error,
            max_tool_output_tokens=preset.max_tool_output_tokens,
            hard_limit=hard,
            window_tokens=preset.window_tokens,
            budget=_token_limit(config.trigger),
            abandon_after_turns=preset.abandon_after_turns,
            abandon_after_seconds=preset.abandon_after_seconds,
            background_at=preset.background_at,
            episodic=_needs_episodic(config.trigger),
        )
    assert trigger is not None and strategy is not None
    probe = CompactionConfig(trigger, strategy, min_recent_turns=0)
    target = probe.target
    summary = (
        min(DEFAULT_MAX_SUMMARY_TOKENS, target // 2) if target is not None else DEFAULT_MAX_SUMMARY_TOKENS
    )
    summarize = not all(s.masks for s in probe.strategies)
    config = CompactionConfig(trigger, strategy, summary_tokens=summary if summarize else 0)
    _check_target_below_trigger(config, trigger=trigger, strategy=strategy, preset=None)
    if summarize:
        _check_summary_below_target(config)
    budget = _token_limit(trigger)
    return Settings(
        config=config,
        summarize=summarize,
        max_summary_tokens=max(1, summary),
        summary_role=Role.USER,
        on_summarizer_error="fallback",
        max_tool_output_tokens=None,
        hard_limit=None,
        window_tokens=budget * WINDOW_MULTIPLE_OF_TRIGGER if budget is not None else None,
        budget=budget,
        abandon_after_turns=8,
        abandon_after_seconds=None,
        background_at=None,
        episodic=_needs_episodic(trigger),
    )


def check_summary_room(
    settings: Settings,
    options: object,
    *,
    summarizer: Summarizer | None,
    fallback: Summarizer | None,
    default: Summarizer,
) -> None:
    """Refuse a summary size that a summarizer the compactor may ask cannot write to.

    The extractive summarizer needs room for its section headings; a chat
    model needs its window to hold the summary beside the conversation. The
    error says which summarizer cannot (the one asked for every summary, or
    the fallback asked when it fails) and names what the caller set or can
    set: ``max_summary_tokens`` under a preset; with triggers and strategies
    alone, the strategy whose target the size is derived from, or the
    fallback. A preset's size at or above a strategy's target is refused here
    too, since the size to suggest must also suit the summarizers.
    """
    from .summarizers import ChatSummarizer, ExtractiveSummarizer

    if not settings.summarize:
        return
    size = settings.max_summary_tokens
    # (the argument holding it, or None for the default; what it serves as; the summarizer)
    asked: list[tuple[str | None, str, Summarizer]] = [
        (
            "summarizer" if summarizer is not None else ("fallback" if fallback is not None else None),
            "summarizer",
            summarizer if summarizer is not None else default,
        )
    ]
    if settings.on_summarizer_error == "fallback" and asked[0][2] is not default:
        asked.append(("fallback" if fallback is not None else None, "fallback", default))
    preset = _preset_of(options)
    target = settings.config.target
    if preset is not None and target is not None and size >= target:
        extractive = [
            (chosen, _who(settings, given, serves))
            for given, serves, chosen in asked
            if isinstance(chosen, ExtractiveSummarizer)
        ]
        needs = max(extractive, key=lambda pair: pair[0].least_summary_tokens(), default=None)
        raise _summary_above_target_error(settings, options, preset, needs)
    for given, serves, chosen in asked:
        if isinstance(chosen, ExtractiveSummarizer):
            if size < chosen.least_summary_tokens():
                raise _headings_error(settings, options, preset, given, serves, chosen)
        elif isinstance(chosen, ChatSummarizer):
            if preset is not None:
                chosen.check_summary_room(size, key=_summary_key(options))
            else:
                _check_window(settings, chosen, given or serves)


def _who(settings: Settings, given: str | None, serves: str) -> str:
    """The extractive summarizer asked, in words: the argument that holds it, or the default, and its role."""
    if given is None and serves == "summarizer":
        also = ", also the fallback," if settings.on_summarizer_error == "fallback" else ""
        return f"the default summarizer, an ExtractiveSummarizer{also}"
    if given is None:
        return "the default fallback (an ExtractiveSummarizer, asked whenever the summarizer fails)"
    who = f"the ExtractiveSummarizer passed as {given}"
    if given == "fallback" and serves == "summarizer":
        who += " (with no summarizer given, it writes every summary)"
    return who


def _summary_caps(settings: Settings, preset: SummarizeOptions) -> tuple[int, int | None]:
    """The targets a preset's summary size must stay below: its own, and a strategy's that replaced it.

    The preset checks its size against its own target when it is built, so a
    strategy's target bounds the size only besides it.
    """
    own = preset.effective_target_tokens
    target = settings.config.target
    return own, (target if target is not None and target != own else None)


def _larger_targets(settings: Settings, preset: SummarizeOptions, size: int) -> str:
    """``max_summary_tokens={size}`` and the targets above it that it needs, as one fix."""
    own, strategy = _summary_caps(settings, preset)
    parts = [f"max_summary_tokens={size}"]
    if strategy is not None and strategy <= size:
        parts.append(f"a strategy target above it, for example {_with_target(settings.config, 2 * size)}")
    if own <= size:
        if preset.target_tokens is None:
            parts.append(f"trigger_token_budget={4 * size} (the preset's own target is half of it)")
        else:
            parts.append(f"target_tokens={2 * size}")
            if preset.trigger_token_budget <= 2 * size:
                parts.append(f"trigger_token_budget={4 * size}")
    return f"{', '.join(parts[:-1])} and {parts[-1]}" if len(parts) > 1 else parts[0]


def _preset_size_fixes(settings: Settings, preset: SummarizeOptions, chosen: ExtractiveSummarizer) -> str:
    """Sizes that hold the extractive headings and stay below the targets, or the larger targets they need."""
    least, advised = chosen.least_summary_tokens(), chosen.advised_summary_tokens()
    own, strategy = _summary_caps(settings, preset)
    cap = min(own, strategy) if strategy is not None else own
    if _summary_size_given(preset):
        unset = ""
    elif strategy is None:
        unset = " (unset, it is half of target_tokens, by default a quarter of trigger_token_budget"
        unset += f": a budget of {4 * advised} or more)" if preset.target_tokens is None else ")"
    else:
        unset = " (unset, it is 1024 or half the preset's own target, whichever is smaller)"
    if advised < cap:
        room = f"room for a few lines beside them below the {cap}-token target"
        return f"give it {advised} to {cap - 1}, {room}{unset}"
    if least < cap:
        return f"give it between {least} and {cap - 1}, all the {cap}-token target allows{unset}"
    return f"set {_larger_targets(settings, preset, advised)}"


def _headings_error(
    settings: Settings,
    options: object,
    preset: SummarizeOptions | None,
    given: str | None,
    serves: str,
    chosen: ExtractiveSummarizer,
) -> ConfigError:
    """The summary size is below the extractive summarizer's headings: say which one, and what to change."""
    size = settings.max_summary_tokens
    least, advised = chosen.least_summary_tokens(), chosen.advised_summary_tokens()
    asks_fallback = settings.on_summarizer_error == "fallback"
    who = _who(settings, given, serves)
    fails = (
        "so every fold would fail"
        if serves == "summarizer"
        else "so every fold that falls back to it would fail"
    )
    short = "a summarizer that writes summaries that short, such as a FunctionSummarizer"
    if given is None and serves == "summarizer":
        swap = f"pass summarizer= {short}" + (", and fallback= one like it" if asks_fallback else "")
    elif serves == "fallback":
        swap = f"pass fallback= {short} (the summarizer you passed will do)"
        if preset is not None:
            swap += ", or on_summarizer_error='raise' or 'skip', which ask no fallback"
    else:
        swap = f"pass {given}= {short}"
    if preset is not None:
        return ConfigError(
            _summary_key(options),
            f"is below the {least} tokens {who} needs for its section headings alone, {fails}; "
            f"{_preset_size_fixes(settings, preset, chosen)}, or {swap}",
            value=size,
        )
    # Without a preset the size is half the strategy's target: that target, or the fallback, is the fix.
    config = settings.config
    wider = _with_target(config, 2 * advised)
    room = f"a target of {2 * advised} or more, for example {wider}"
    if serves == "summarizer":
        return ConfigError(
            "strategy",
            f"leaves summaries {size} tokens, half its {config.target}-token target, below the {least} "
            f"tokens {who} needs for its section headings alone, {fails}; use {room}, or {swap}",
            value=config.strategy,
        )
    reason = (
        f"{'is unset, so it is ' if given is None else 'is '}an ExtractiveSummarizer, asked whenever the "
        f"summarizer fails, which needs {least} tokens for its section headings alone; summaries get {size} "
        f"here, half the {config.target}-token target of strategy={config.strategy!r}, {fails}; {swap}, or "
        f"give summaries room with {room}"
    )
    return ConfigError("fallback", reason) if given is None else ConfigError("fallback", reason, value=chosen)


def _check_window(settings: Settings, chosen: ChatSummarizer, key: str) -> None:
    """Refuse a summary size the chat model's window cannot hold, naming the strategy's target as the fix."""
    size = settings.max_summary_tokens

    def fits(tokens: int) -> bool:
        try:
            chosen.check_summary_room(tokens)
        except ConfigError:
            return False
        return True

    if fits(size):
        return
    # The largest size the window holds: the check is cheap (no tokenizer) and monotonic in the size.
    low, high = 0, size
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    target = settings.config.target
    source = (
        f"half the {target}-token target of strategy={settings.config.strategy!r}, at most "
        f"{DEFAULT_MAX_SUMMARY_TOKENS}"
        if target is not None
        else f"{DEFAULT_MAX_SUMMARY_TOKENS}, as no TokenBudget in the strategy sets a target"
    )
    if low < 1:
        fix = ""
    elif target is not None:
        fix = f"use a target of at most {2 * low}, for example {_with_target(settings.config, 2 * low)}, or "
    else:
        fix = f"end the strategy with a TokenBudget of at most {2 * low}, such as TokenBudget({2 * low}), or "
    raise ConfigError(
        key,
        f"cannot hold a {size}-token summary beside the conversation in its context_window_tokens="
        f"{chosen.context_window_tokens} (summaries get {source}); {fix}use a summarizer model with a "
        "larger window",
        value=chosen,
    )
