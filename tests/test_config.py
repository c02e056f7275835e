"""Option validation: the klieo rules, and every rejected option as a ConfigError with key, value, fix."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from contextfold import (
    ConfigError,
    EpisodicCompactionConfig,
    Message,
    ObservationMasking,
    RunOptions,
    SummarizeOptions,
    TokenBudget,
)
from contextfold._config import WINDOW_MULTIPLE_OF_TRIGGER
from contextfold.planning import CompactionConfig, Pressure

# klieo compaction.rs ----------------------------------------------------------------


def test_compaction_is_off_unless_configured() -> None:
    """RunOptions() carries no compaction options."""
    assert RunOptions().compaction is None
    assert RunOptions(max_history_tokens=4000).compaction is None


def test_without_compaction_is_the_explicit_way_to_disable_compaction() -> None:
    """RunOptions.without_compaction() keeps the history limit and sets compaction to None."""
    options = RunOptions.without_compaction(max_history_tokens=50_000)
    assert options.compaction is None
    assert options.max_history_tokens == 50_000
    assert RunOptions.without_compaction() == RunOptions()


def test_a_zero_trigger_token_budget_is_rejected_with_the_way_to_disable_compaction() -> None:
    """A zero budget would re-summarize every step, so it is rejected pointing at without_compaction()."""
    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=0)
    error = info.value
    assert error.key == "compaction.trigger_token_budget"
    assert error.value == 0
    assert "non-zero" in error.reason
    assert "RunOptions.without_compaction()" in error.reason
    assert "at least 4" in error.reason
    assert not isinstance(error, ValidationError)
    SummarizeOptions(trigger_token_budget=4)  # the smallest the reason names is accepted


def test_a_zero_budget_given_as_a_mapping_inside_run_options_is_rejected_the_same_way() -> None:
    """A nested compaction mapping with a zero budget raises the same ConfigError from RunOptions."""
    with pytest.raises(ConfigError) as info:
        RunOptions(max_history_tokens=1000, compaction={"trigger_token_budget": 0})  # type: ignore[arg-type]
    assert info.value.key == "compaction.trigger_token_budget"
    assert "without_compaction" in info.value.reason


def test_a_window_below_max_history_tokens_is_rejected_with_the_smallest_budget_that_works() -> None:
    """A window below max_history_tokens is rejected naming the key, the reason and the minimum budget."""
    max_history = 100_001
    smallest = math.ceil(max_history / WINDOW_MULTIPLE_OF_TRIGGER)
    with pytest.raises(ConfigError) as info:
        RunOptions(
            max_history_tokens=max_history, compaction=SummarizeOptions(trigger_token_budget=smallest - 1)
        )
    error = info.value
    assert error.key == "compaction.trigger_token_budget"
    assert error.value == smallest - 1
    assert f"= {(smallest - 1) * WINDOW_MULTIPLE_OF_TRIGGER} is below max_history_tokens = {max_history}" in (
        error.reason
    )
    assert f"at least {smallest}" in error.reason
    assert not isinstance(error, ValidationError)

    accepted = RunOptions(
        max_history_tokens=max_history, compaction=SummarizeOptions(trigger_token_budget=smallest)
    )
    assert accepted.compaction is not None
    assert accepted.compaction.window_tokens >= max_history


def test_the_window_is_the_budget_times_the_window_multiple() -> None:
    """window_tokens is trigger_token_budget * WINDOW_MULTIPLE_OF_TRIGGER."""
    assert SummarizeOptions(trigger_token_budget=8000).window_tokens == 8000 * WINDOW_MULTIPLE_OF_TRIGGER
    assert WINDOW_MULTIPLE_OF_TRIGGER >= 1


def test_a_window_equal_to_max_history_tokens_is_accepted() -> None:
    """The window check is strict: a window exactly max_history_tokens is enough."""
    budget = 2500
    options = RunOptions(
        max_history_tokens=budget * WINDOW_MULTIPLE_OF_TRIGGER,
        compaction=SummarizeOptions(trigger_token_budget=budget),
    )
    assert options.compaction is not None


def test_summarize_options_alone_do_not_check_a_window() -> None:
    """Options built without RunOptions choose their own coverage: no max_history_tokens, no window check."""
    assert SummarizeOptions(trigger_token_budget=100).window_tokens == 100 * WINDOW_MULTIPLE_OF_TRIGGER


def test_without_compaction_skips_the_window_check() -> None:
    """A huge history limit needs no budget when compaction is off."""
    assert RunOptions.without_compaction(max_history_tokens=10**9).max_history_tokens == 10**9


# defaults and derived planners ------------------------------------------------------


def test_summarize_options_defaults() -> None:
    """Defaults keep 8 messages and 2 turns, aim at half the budget and cap the summary at 1024 tokens."""
    options = SummarizeOptions(trigger_token_budget=8000)
    assert options.min_recent_messages == 8
    assert options.min_recent_turns == 2
    assert options.effective_target_tokens == 4000
    assert options.max_summary_tokens == 1024
    assert options.mode == "summarize"
    assert options.episodic is None


def test_a_small_budget_gets_a_summary_cap_that_fits_its_target() -> None:
    """With budget 1000 the default summary cap is half the 500-token target, not a rejection."""
    options = SummarizeOptions(trigger_token_budget=1000)
    assert options.max_summary_tokens == 250
    assert SummarizeOptions(trigger_token_budget=1000, target_tokens=300).max_summary_tokens == 150


def test_the_planner_fires_above_the_budget_and_keeps_recent_messages() -> None:
    """compaction_config() fires strictly above the budget and keeps min_recent_messages verbatim."""
    options = SummarizeOptions(trigger_token_budget=100, min_recent_messages=3, min_recent_turns=0)
    config = options.compaction_config()
    assert isinstance(config, CompactionConfig)
    assert [type(s) for s in config.strategies] == [TokenBudget]
    assert options.trigger.reason(Pressure(1, 100)) is None
    assert options.trigger.reason(Pressure(1, 101)) == "token_count"
    history = [Message.user("u" * 400) for _ in range(6)]
    plan = config.plan(history, 600)
    assert plan.kept == tuple(history[-3:])


def test_mask_mode_plans_observation_masking() -> None:
    """mode='mask' plans with masking alone; 'mask_then_summarize' masks before the token budget."""
    assert [type(s) for s in SummarizeOptions(trigger_token_budget=100, mode="mask").strategy()] == [
        ObservationMasking
    ]
    pipeline = SummarizeOptions(trigger_token_budget=100, mode="mask_then_summarize").strategy()
    assert [type(s) for s in pipeline] == [ObservationMasking, TokenBudget]


def test_episodic_options_add_the_episodic_policy_to_the_budget_trigger() -> None:
    """With an episodic policy, context pressure fires at its threshold before the budget does."""
    options = SummarizeOptions(
        trigger_token_budget=10_000, episodic=EpisodicCompactionConfig(trigger_context_tokens=6_000)
    )
    assert options.trigger.reason(Pressure(1, 6_000)) == "context_pressure"
    assert options.trigger.reason(Pressure(1, 5_999)) is None


def test_options_are_frozen() -> None:
    """Built options cannot be changed afterwards, so a validated value stays valid."""
    options = SummarizeOptions(trigger_token_budget=8000)
    with pytest.raises(ValidationError):
        options.trigger_token_budget = 0  # type: ignore[misc]


# every rejected option --------------------------------------------------------------

Build = Callable[[], Any]
NAN = float("nan")


def summarize(**fields: Any) -> Build:
    return lambda: SummarizeOptions(**fields)


def run(**fields: Any) -> Build:
    return lambda: RunOptions(**fields)


REJECTED: list[tuple[str, Build, str, object]] = [
    ("negative budget", summarize(trigger_token_budget=-5), "compaction.trigger_token_budget", -5),
    ("string budget", summarize(trigger_token_budget="8000"), "compaction.trigger_token_budget", "8000"),
    ("bool budget", summarize(trigger_token_budget=True), "compaction.trigger_token_budget", True),
    ("float budget", summarize(trigger_token_budget=8000.0), "compaction.trigger_token_budget", 8000.0),
    ("NaN budget", summarize(trigger_token_budget=NAN), "compaction.trigger_token_budget", NAN),
    ("None budget", summarize(trigger_token_budget=None), "compaction.trigger_token_budget", None),
    (
        "infinite summary cap",
        summarize(trigger_token_budget=8000, max_summary_tokens=float("inf")),
        "compaction.max_summary_tokens",
        float("inf"),
    ),
    ("tiny budget", summarize(trigger_token_budget=1), "compaction.trigger_token_budget", 1),
    (
        "negative keep",
        summarize(trigger_token_budget=8000, min_recent_messages=-1),
        "compaction.min_recent_messages",
        -1,
    ),
    ("zero target", summarize(trigger_token_budget=8000, target_tokens=0), "compaction.target_tokens", 0),
    (
        "target at budget",
        summarize(trigger_token_budget=8000, target_tokens=8000),
        "compaction.target_tokens",
        8000,
    ),
    (
        "negative floor",
        summarize(trigger_token_budget=8000, min_recent_turns=-1),
        "compaction.min_recent_turns",
        -1,
    ),
    (
        "zero summary",
        summarize(trigger_token_budget=8000, max_summary_tokens=0),
        "compaction.max_summary_tokens",
        0,
    ),
    (
        "summary over target",
        summarize(trigger_token_budget=8000, max_summary_tokens=4000),
        "compaction.max_summary_tokens",
        4000,
    ),
    ("unknown mode", summarize(trigger_token_budget=8000, mode="shred"), "compaction.mode", "shred"),
    (
        "unknown error policy",
        summarize(trigger_token_budget=8000, on_summarizer_error="ignore"),
        "compaction.on_summarizer_error",
        "ignore",
    ),
    (
        "unknown role",
        summarize(trigger_token_budget=8000, summary_role="robot"),
        "compaction.summary_role",
        "robot",
    ),
    (
        "tool summary role",
        summarize(trigger_token_budget=8000, summary_role="tool"),
        "compaction.summary_role",
        "tool",
    ),
    (
        "zero tool output cap",
        summarize(trigger_token_budget=8000, max_tool_output_tokens=0),
        "compaction.max_tool_output_tokens",
        0,
    ),
    ("unknown option", summarize(trigger_token_budget=8000, budget=3), "compaction.budget", 3),
    (
        "bad episodic",
        summarize(trigger_token_budget=8000, episodic={"trigger_unfinished_turns": -1}),
        "compaction.episodic.trigger_unfinished_turns",
        -1,
    ),
    (
        "episodic age as a string",
        summarize(trigger_token_budget=8000, episodic={"trigger_age_days": "3"}),
        "compaction.episodic.trigger_age_days",
        "3",
    ),
    (
        "unknown episodic option",
        summarize(trigger_token_budget=8000, episodic={"trigger_age": 3}),
        "compaction.episodic.trigger_age",
        3,
    ),
    ("zero history", run(max_history_tokens=0), "max_history_tokens", 0),
    ("negative history", run(max_history_tokens=-1), "max_history_tokens", -1),
    (
        "nested negative keep",
        run(compaction={"trigger_token_budget": 40_000, "min_recent_messages": -2}),
        "compaction.min_recent_messages",
        -2,
    ),
    (
        "nested bad episodic",
        run(compaction={"trigger_token_budget": 40_000, "episodic": {"trigger_age_days": -1}}),
        "compaction.episodic.trigger_age_days",
        -1,
    ),
    ("compaction of the wrong type", run(compaction=5), "compaction", 5),
    (
        "zero budget through model_validate",
        lambda: RunOptions.model_validate({"compaction": {"trigger_token_budget": 0}}),
        "compaction.trigger_token_budget",
        0,
    ),
    (
        "small window through model_validate_json",
        lambda: RunOptions.model_validate_json(
            '{"max_history_tokens": 1000, "compaction": {"trigger_token_budget": 10}}'
        ),
        "compaction.trigger_token_budget",
        10,
    ),
    (
        "string budget through model_validate_json",
        lambda: SummarizeOptions.model_validate_json('{"trigger_token_budget": "lots"}'),
        "compaction.trigger_token_budget",
        "lots",
    ),
    ("unknown run option", run(compactoin=None), "compactoin", None),
    (
        "text that is not JSON",
        lambda: RunOptions.model_validate_json("{compaction: 1"),
        "options",
        "{compaction: 1",
    ),
    (
        "a JSON array",
        lambda: SummarizeOptions.model_validate_json("[8000]"),
        "compaction",
        [8000],
    ),
    (
        "zero budget through model_copy",
        lambda: SummarizeOptions(trigger_token_budget=8000).model_copy(update={"trigger_token_budget": 0}),
        "compaction.trigger_token_budget",
        0,
    ),
    (
        "small window through model_copy",
        lambda: RunOptions(compaction=SummarizeOptions(trigger_token_budget=40_000)).model_copy(
            update={"max_history_tokens": 1_000_000}
        ),
        "compaction.trigger_token_budget",
        40_000,
    ),
]


@pytest.mark.parametrize(("build", "key", "value"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_every_rejected_option_is_a_config_error_naming_key_value_and_fix(
    build: Build, key: str, value: object
) -> None:
    """A rejected option raises ConfigError (never ValidationError) with its key, its value and a reason."""
    with pytest.raises(ConfigError) as info:
        build()
    error = info.value
    assert not isinstance(error, ValidationError)
    assert error.key == key
    assert error.value == value or (value is NAN and error.value is NAN)
    assert str(error).startswith(f"{key}={value!r}: ")
    assert error.reason and "Value error" not in error.reason and "Input should" not in error.reason


def test_a_missing_budget_names_the_key_and_an_example() -> None:
    """Leaving out trigger_token_budget is a ConfigError naming it and a value to use, showing no value."""
    with pytest.raises(ConfigError) as info:
        SummarizeOptions()  # type: ignore[call-arg]
    assert (info.value.key, info.value.value) == ("compaction.trigger_token_budget", None)
    assert str(info.value) == (
        "compaction.trigger_token_budget: is required, for example trigger_token_budget=8000"
    )


def test_a_value_of_the_wrong_type_says_what_type_it_must_be() -> None:
    """A float where a whole number belongs is rejected saying an int is needed and what was given."""
    with pytest.raises(ConfigError) as info:
        RunOptions(max_history_tokens=1.5)  # type: ignore[arg-type]
    assert info.value.reason == "must be a whole number (int), not float, for example 128000 (the default)"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: SummarizeOptions(trigger_token_budget=8000.0),
            "compaction.trigger_token_budget=8000.0: must be a whole number (int), not float, "
            "for example 8000",
        ),
        (
            lambda: SummarizeOptions(trigger_token_budget="8000"),
            "compaction.trigger_token_budget='8000': must be a whole number (int), not str, for example 8000",
        ),
        (
            lambda: SummarizeOptions(trigger_token_budget=8000.5),
            "compaction.trigger_token_budget=8000.5: must be a whole number (int), not float, "
            "for example 8000",
        ),
        (
            lambda: RunOptions(compaction={"trigger_token_budget": 8000, "min_recent_turns": 2.5}),
            "compaction.min_recent_turns=2.5: must be a whole number (int), not float, "
            "for example 2 (the default)",
        ),
        (
            lambda: RunOptions(max_history_tokens=100_000.0),
            "max_history_tokens=100000.0: must be a whole number (int), not float, for example 100000",
        ),
    ],
)
def test_a_value_of_the_wrong_type_names_a_value_that_works(build: Any, message: str) -> None:
    """A type error names the key, the value and a value that works, as a range error does.

    It named no value, against the README's "a ConfigError naming the key,
    the value and a value that works"; a whole float or a number in text
    names the number it meant.
    """
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value) == message


@pytest.mark.parametrize("given", ["robot", "TOOL", 3, None])
def test_an_unknown_summary_role_offers_only_the_roles_the_option_takes(given: Any) -> None:
    """summary_role="robot" is offered 'user', 'system' or 'assistant', never 'tool', which it refuses."""
    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=8000, summary_role=given)
    assert str(info.value) == (
        f"compaction.summary_role={given!r}: must be 'user' (the default), 'system' or 'assistant'"
    )
    offered = re.findall(r"'(\w+)'", info.value.reason)
    assert offered == ["user", "system", "assistant"]
    for role in offered:
        assert SummarizeOptions(trigger_token_budget=8000, summary_role=role).summary_role == role
    with pytest.raises(ConfigError) as nested:
        RunOptions.model_validate_json(
            f'{{"compaction": {{"trigger_token_budget": 40000, "summary_role": {json.dumps(given)}}}}}'
        )
    assert nested.value.reason == info.value.reason


def test_an_unknown_option_lists_the_options_of_its_own_model() -> None:
    """A misspelt nested option is rejected with the options that model does take."""
    with pytest.raises(ConfigError) as info:
        RunOptions(compaction={"trigger_token_budget": 40_000, "keep_recent": 4})
    assert info.value.key == "compaction.keep_recent"
    assert "min_recent_messages" in info.value.reason
    assert "max_history_tokens" not in info.value.reason


def test_model_copy_validates_the_update_and_keeps_the_rest() -> None:
    """model_copy(update=...) returns options built from the old ones and the valid update."""
    options = SummarizeOptions(trigger_token_budget=8000, min_recent_messages=3)
    dropping = options.model_copy(update={"mode": "drop"})
    assert (dropping.mode, dropping.min_recent_messages, dropping.trigger_token_budget) == ("drop", 3, 8000)
    assert options.model_copy() == options


def test_model_copy_derives_the_default_summary_size_again_for_a_new_budget() -> None:
    """A summary size that was derived from the old budget is derived again; one the caller chose is kept."""
    derived = SummarizeOptions(trigger_token_budget=8000).model_copy(update={"trigger_token_budget": 100})
    assert derived.max_summary_tokens == 25
    chosen = SummarizeOptions(trigger_token_budget=8000, max_summary_tokens=500)
    with pytest.raises(ConfigError) as info:
        chosen.model_copy(update={"trigger_token_budget": 100})
    assert (info.value.key, info.value.value) == ("compaction.max_summary_tokens", 500)


def test_a_summary_size_the_caller_gave_is_set_even_when_it_equals_the_derived_one() -> None:
    """model_fields_set holds max_summary_tokens only when given; one given as 1024 is kept by model_copy.

    Before, a given 1024 (the size 8000 derives) counted as unset: errors
    called it unset and model_copy derived it again from a new budget.
    """
    derived = SummarizeOptions(trigger_token_budget=8000)
    given = SummarizeOptions(trigger_token_budget=8000, max_summary_tokens=1024)
    assert derived == given
    assert "max_summary_tokens" not in derived.model_fields_set
    assert "max_summary_tokens" in given.model_fields_set
    assert (
        "max_summary_tokens"
        in SummarizeOptions.model_validate_json(
            '{"trigger_token_budget": 8000, "max_summary_tokens": 1024}'
        ).model_fields_set
    )
    assert (
        "max_summary_tokens"
        not in SummarizeOptions.model_validate_json('{"trigger_token_budget": 8000}').model_fields_set
    )
    assert given.model_copy(update={"trigger_token_budget": 9000}).max_summary_tokens == 1024
    with pytest.raises(ConfigError) as info:
        given.model_copy(update={"trigger_token_budget": 100})
    assert (info.value.key, info.value.value) == ("compaction.max_summary_tokens", 1024)


def test_own_rules_say_which_value_would_work() -> None:
    """The cross-field rules name a value that would be accepted."""
    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=8000, target_tokens=9000)
    assert "use at most 7999" in info.value.reason
    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=8000, max_summary_tokens=4000)
    assert "use at most 2000" in info.value.reason
    with pytest.raises(ConfigError) as info:
        SummarizeOptions(trigger_token_budget=-1)
    assert "positive" in info.value.reason


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("trigger_tokens", "trigger_token_budget"),
        ("min_recent_msgs", "min_recent_messages"),
        ("targettokens", "target_tokens"),
    ],
)
def test_a_misspelt_option_is_named_with_the_option_it_misspells(given: str, meant: str) -> None:
    """A misspelling is the error, not the required option it leaves missing; the fix is named."""
    with pytest.raises(ConfigError) as caught:
        SummarizeOptions(**{given: 3_000})
    assert caught.value.key == f"compaction.{given}"
    assert f"did you mean {meant}?" in str(caught.value) and "3000" in str(caught.value)


def test_an_option_like_none_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as caught:
        SummarizeOptions(trigger_token_budget=3_000, zzz=1)
    assert "did you mean" not in str(caught.value) and caught.value.key == "compaction.zzz"


def test_a_trigger_budget_above_the_history_limit_is_refused() -> None:
    """Requests would grow past max_history_tokens before any fold: the error says which way to fix it."""
    with pytest.raises(ConfigError) as caught:
        RunOptions(max_history_tokens=1_000, compaction=SummarizeOptions(trigger_token_budget=3_000))
    assert caught.value.key == "compaction.trigger_token_budget"
    text = str(caught.value)
    assert "3000" in text and "max_history_tokens = 1000" in text and "1000 or less" in text
    RunOptions(max_history_tokens=3_000, compaction=SummarizeOptions(trigger_token_budget=3_000))


def test_an_episodic_context_trigger_at_or_below_the_target_is_refused() -> None:
    """Context pressure at 2,000 tokens under a 50,000-token target stalled on every firing; it is refused."""
    episodic = EpisodicCompactionConfig(trigger_context_tokens=2_000, trigger_unfinished_turns=10_000)
    with pytest.raises(ConfigError) as caught:
        SummarizeOptions(trigger_token_budget=100_000, episodic=episodic)
    assert (caught.value.key, caught.value.value) == ("compaction.episodic.trigger_context_tokens", 2_000)
    assert str(caught.value) == (
        "compaction.episodic.trigger_context_tokens=2000: fires a fold at 2000 tokens, at or below the "
        "50000-token target (half of trigger_token_budget=100000) the fold aims for, so no fold can bring "
        "the context below it and it would fire again on every check; use a trigger_context_tokens above "
        "50000, for example 100000 (the trigger_token_budget), or a target_tokens below 2000, for example "
        "1000"
    )
    with pytest.raises(ConfigError, match=r"at or below the 5000-token target \(target_tokens\)"):
        RunOptions(
            compaction={
                "trigger_token_budget": 40_000,
                "target_tokens": 5_000,
                "episodic": {"trigger_context_tokens": 5_000},
            }
        )
    # Both values it names work.
    SummarizeOptions(trigger_token_budget=100_000, target_tokens=1_000, episodic=episodic)
    SummarizeOptions(
        trigger_token_budget=100_000, episodic=EpisodicCompactionConfig(trigger_context_tokens=100_000)
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"background_at": 1.0},
            "compaction.background_at=1.0: must be a number above 0 and below 1, for example 0.8, or None "
            "(the default) to summarize within the step",
        ),
        (
            {"background_at": NAN},
            "compaction.background_at=nan: is not a number; it must be a number above 0 and below 1, for "
            "example 0.8, or None (the default) to summarize within the step",
        ),
        (
            {"abandon_after_turns": 0},
            "compaction.abandon_after_turns=0: must be a whole number above 0, for example 8 (the default), "
            "or None to abandon by time only, with abandon_after_seconds set",
        ),
        (
            {"abandon_after_seconds": 0},
            "compaction.abandon_after_seconds=0: must be a number above 0, for example 600, or None (the "
            "default) to abandon by turns only",
        ),
        (
            {"keep_first": -1},
            "compaction.keep_first=-1: must be a whole number at least 0, for example 0 (the default), or 1 "
            "to pin the first user message",
        ),
        (
            {"min_recent_turns": -1},
            "compaction.min_recent_turns=-1: must be a whole number at least 0, for example 2 (the default)",
        ),
        (
            {"max_summary_tokens": 0},
            "compaction.max_summary_tokens=0: must be a whole number above 0, for example a quarter of "
            "trigger_token_budget, or leave it unset for 1024 or half the target, whichever is smaller",
        ),
        (
            {"target_tokens": 0},
            "compaction.target_tokens=0: must be a whole number above 0, for example half of "
            "trigger_token_budget, or None (the default: half of it)",
        ),
        (
            {"max_tool_output_tokens": 0},
            "compaction.max_tool_output_tokens=0: must be a whole number above 0, for example 2000, or None "
            "(the default) for no cap",
        ),
    ],
    ids=[
        "background_at",
        "background_at-nan",
        "abandon_after_turns",
        "abandon_after_seconds",
        "keep_first",
        "min_recent_turns",
        "max_summary_tokens",
        "target_tokens",
        "max_tool_output_tokens",
    ],
)
def test_an_option_out_of_range_names_a_value_that_works(given: dict[str, Any], message: str) -> None:
    """Range errors say what the option takes and a value that works; NaN is called not a number."""
    with pytest.raises(ConfigError) as caught:
        SummarizeOptions(trigger_token_budget=8_000, **given)
    assert str(caught.value) == message


def test_a_run_option_out_of_range_names_a_value_that_works() -> None:
    """RunOptions' own range error names the default as a value that works."""
    with pytest.raises(ConfigError) as caught:
        RunOptions(max_history_tokens=0)
    assert str(caught.value) == (
        "max_history_tokens=0: must be a whole number above 0, for example 128000 (the default)"
    )
