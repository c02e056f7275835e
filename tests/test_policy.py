"""Triggers and the episodic policy: the seeds' tests and the semantics around them."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from contextfold import ConfigError, EpisodicCompactionConfig, TokenCount, TurnCount
from contextfold._policy import unchecked_pressure
from contextfold.planning import (
    AllOf,
    AnyOf,
    EpisodicCompactionPressure,
    EpisodicCompactionTrigger,
    EpisodicPolicy,
    Pressure,
    Trigger,
    episodic_compaction_trigger,
)

# clark_episodic.rs ------------------------------------------------------------


def test_context_pressure_wins_before_a_provider_overflow() -> None:
    """A context estimate at the configured threshold wins over every other trigger."""
    pressure = EpisodicCompactionPressure(
        estimated_context_tokens=408_000,
        user_messages_since_boundary=80,
        run_completed_since_boundary=80,
        conversation_age_days=1,
        total_user_messages=80,
    )
    config = EpisodicCompactionConfig(trigger_context_tokens=400_000)

    assert episodic_compaction_trigger(pressure, config) is EpisodicCompactionTrigger.CONTEXT_PRESSURE


def test_unfinished_turns_only_count_after_the_latest_clean_completion() -> None:
    """Nine user messages after the latest clean completion fire the unfinished-turns trigger."""
    pressure = EpisodicCompactionPressure(
        user_messages_since_boundary=20,
        run_completed_since_boundary=1,
        user_messages_after_latest_run_completed=9,
        conversation_age_days=1,
        total_user_messages=20,
    )

    assert (
        episodic_compaction_trigger(pressure, EpisodicCompactionConfig())
        is EpisodicCompactionTrigger.UNFINISHED_TURNS
    )


def test_a_recent_clean_completion_prevents_the_unfinished_turn_trigger() -> None:
    """Only two user messages after a clean completion do not fire anything."""
    pressure = EpisodicCompactionPressure(
        user_messages_since_boundary=20,
        run_completed_since_boundary=1,
        user_messages_after_latest_run_completed=2,
        conversation_age_days=1,
        total_user_messages=20,
    )

    assert episodic_compaction_trigger(pressure, EpisodicCompactionConfig()) is None


def test_context_pressure_is_disabled_until_the_runtime_supplies_a_limit() -> None:
    """A huge context estimate fires nothing while the default config has no context limit."""
    pressure = EpisodicCompactionPressure(
        estimated_context_tokens=900_000,
        user_messages_since_boundary=80,
        run_completed_since_boundary=80,
        conversation_age_days=1,
        total_user_messages=80,
    )

    assert episodic_compaction_trigger(pressure, EpisodicCompactionConfig()) is None


def test_age_trigger_requires_both_age_and_turn_count() -> None:
    """An old conversation fires the age trigger only once it also has enough user messages."""
    sparse = EpisodicCompactionPressure(conversation_age_days=60, total_user_messages=10)
    assert episodic_compaction_trigger(sparse, EpisodicCompactionConfig()) is None

    old_busy = EpisodicCompactionPressure(conversation_age_days=60, total_user_messages=200)
    assert (
        episodic_compaction_trigger(old_busy, EpisodicCompactionConfig())
        is EpisodicCompactionTrigger.AGE_AND_TURNS
    )


def test_trigger_names_are_stable_for_store_metadata() -> None:
    """Trigger names are the stable strings stores persist."""
    assert EpisodicCompactionTrigger.CONTEXT_PRESSURE.as_str() == "context_pressure"
    assert EpisodicCompactionTrigger.MANUAL_RECOVERY.as_str() == "manual_recovery"
    assert EpisodicCompactionTrigger.UNFINISHED_TURNS.as_str() == "unfinished_turns"
    assert EpisodicCompactionTrigger.AGE_AND_TURNS.as_str() == "age_and_turns"
    assert [t.value for t in EpisodicCompactionTrigger] == [
        "context_pressure",
        "unfinished_turns",
        "age_and_turns",
        "manual_recovery",
    ]


# lc_agents compaction.rs triggers -------------------------------------------------


def test_trigger_turn_count() -> None:
    """TurnCount(3) stays quiet at 3 turns and fires at 4."""
    t = TurnCount(3)
    assert not t.should_compact(3, 0)
    assert t.should_compact(4, 0)


def test_trigger_token_count() -> None:
    """TokenCount(100) stays quiet at 100 tokens and fires at 101."""
    t = TokenCount(100)
    assert not t.should_compact(0, 100)
    assert t.should_compact(0, 101)


def test_trigger_token_count_never_fires_without_tokens() -> None:
    """Agents that report no tokens (0) never fire a TokenCount trigger, even TokenCount(0)."""
    t = TokenCount(0)
    assert not t.should_compact(10, 0)


def test_trigger_any_and_all() -> None:
    """Any fires when one sub-trigger fires; All only when both do."""
    turn = TurnCount(2)
    token = TokenCount(10)
    any_ = AnyOf(turn, token)
    all_ = AllOf(turn, token)
    assert any_.should_compact(5, 0)
    assert not all_.should_compact(5, 0)
    assert all_.should_compact(5, 100)


# semantics beyond the seeds ----------------------------------------------------------


def test_token_count_fires_strictly_above_its_limit_for_any_positive_tokens() -> None:
    """TokenCount(n) fires exactly when 0 < tokens and tokens > n."""
    for limit, tokens in itertools.product((0, 1, 7), range(10)):
        assert TokenCount(limit).fires(Pressure(0, tokens)) is (tokens > 0 and tokens > limit)


def test_turn_count_fires_strictly_above_its_limit() -> None:
    """TurnCount(n) fires exactly when turns > n, including TurnCount(0) at one turn."""
    for limit, turns in itertools.product((0, 1, 7), range(10)):
        assert TurnCount(limit).fires(Pressure(turns, 0)) is (turns > limit)


def test_operators_build_any_of_and_all_of() -> None:
    """`a | b` is AnyOf(a, b) and `a & b` is AllOf(a, b)."""
    turn, token = TurnCount(2), TokenCount(10)
    assert turn | token == AnyOf(turn, token)
    assert turn & token == AllOf(turn, token)
    assert turn | token != turn & token


def test_any_of_reports_the_first_firing_reason() -> None:
    """AnyOf names the reason of the first sub-trigger that fires, in order."""
    either = TurnCount(2) | TokenCount(10)
    assert either.reason(Pressure(5, 0)) == "turn_count"
    assert either.reason(Pressure(1, 50)) == "token_count"
    assert either.reason(Pressure(5, 50)) == "turn_count"
    assert either.reason(Pressure(1, 5)) is None


def test_all_of_reports_the_first_reason_only_when_all_fire() -> None:
    """AllOf names its first sub-trigger's reason, and only when every sub-trigger fires."""
    both = TokenCount(10) & TurnCount(2)
    assert both.reason(Pressure(5, 50)) == "token_count"
    assert both.reason(Pressure(5, 5)) is None
    assert both.reason(Pressure(1, 50)) is None


def test_compositions_nest() -> None:
    """Composed triggers compose again: (a & b) | c fires on c alone or on a and b together."""
    nested = (TurnCount(2) & TokenCount(10)) | TurnCount(100)
    assert nested.fires(Pressure(3, 11))
    assert not nested.fires(Pressure(3, 5))
    assert nested.fires(Pressure(101, 0))


def test_pressure_takes_turns_and_tokens_by_position_and_by_keyword() -> None:
    """Pressure(turns, tokens) and Pressure(turns=, tokens=) are the same snapshot."""
    assert Pressure(3, 400) == Pressure(turns=3, tokens=400)
    assert Pressure(3, 400).turns == 3
    assert Pressure(3, 400).tokens == 400
    assert Pressure() == Pressure(0, 0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: Pressure("3", 4),  # type: ignore[arg-type]
            "Pressure.turns='3': must be a whole number (int), not str, for example Pressure(3, 4000)",
        ),
        (
            lambda: Pressure(3, 4.0),  # type: ignore[arg-type]
            "Pressure.tokens=4.0: must be a whole number (int), not float, for example Pressure(3, 4000)",
        ),
        (
            lambda: Pressure(True, 4),
            "Pressure.turns=True: must be a whole number (int), not bool, for example Pressure(3, 4000)",
        ),
        (
            lambda: Pressure(3, 4, messages="5"),  # type: ignore[arg-type]
            "Pressure.messages='5': must be a whole number (int) or None (the default: as many as turns), "
            "not str, for example Pressure(3, 4000, messages=5)",
        ),
        (
            lambda: Pressure(3, 4, episodic={"total_user_messages": 2}),  # type: ignore[arg-type]
            "Pressure.episodic={'total_user_messages': 2}: must be an EpisodicCompactionPressure or None "
            "(the default), not dict, for example "
            "Pressure(3, 4000, episodic=EpisodicCompactionPressure(total_user_messages=2))",
        ),
    ],
    ids=["turns-str", "tokens-float", "turns-bool", "messages-str", "episodic-dict"],
)
def test_a_pressure_of_the_wrong_type_is_a_config_error_when_built(build: object, message: str) -> None:
    """Pressure("3", 4) fails when it is built, naming the field, the value and one that works."""
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert str(info.value) == message


def test_a_trigger_asked_with_the_wrong_type_names_the_pressure_field() -> None:
    """should_compact("3", 4) is the ConfigError of Pressure.turns, not a TypeError from a comparison."""
    with pytest.raises(ConfigError) as info:
        TurnCount(2).should_compact("3", 4)  # type: ignore[arg-type]
    assert (info.value.key, info.value.value) == ("Pressure.turns", "3")


def test_the_compactor_s_unchecked_pressure_is_the_same_snapshot() -> None:
    """The compactor's unchecked constructor sets every field, and equals the checked Pressure."""
    episodic = EpisodicCompactionPressure(total_user_messages=2)
    built = unchecked_pressure(3, 400, 5, episodic)
    assert built == Pressure(3, 400, messages=5, episodic=episodic)
    assert type(built) is Pressure
    assert [getattr(built, f.name) for f in dataclasses.fields(Pressure)] == [3, 400, 5, episodic]
    assert unchecked_pressure(0, 7, None, None) == Pressure(0, 7)


def test_episodic_config_defaults_match_the_seed() -> None:
    """The default policy has no context limit, 8 unfinished turns, 30 days and 50 user messages."""
    config = EpisodicCompactionConfig()
    assert config.trigger_context_tokens is None
    assert config.trigger_unfinished_turns == 8
    assert config.trigger_age_days == 30
    assert config.trigger_age_turn_count == 50


def test_priority_is_context_pressure_then_unfinished_turns_then_age() -> None:
    """With every rule satisfied, the priority order picks context pressure, then unfinished turns."""
    config = EpisodicCompactionConfig(trigger_context_tokens=1000)
    everything = EpisodicCompactionPressure(
        estimated_context_tokens=1000,
        user_messages_after_latest_run_completed=8,
        conversation_age_days=30,
        total_user_messages=50,
    )
    assert episodic_compaction_trigger(everything, config) is EpisodicCompactionTrigger.CONTEXT_PRESSURE
    no_context = EpisodicCompactionPressure(
        user_messages_after_latest_run_completed=8, conversation_age_days=30, total_user_messages=50
    )
    assert episodic_compaction_trigger(no_context, config) is EpisodicCompactionTrigger.UNFINISHED_TURNS
    only_age = EpisodicCompactionPressure(conversation_age_days=30, total_user_messages=50)
    assert episodic_compaction_trigger(only_age, config) is EpisodicCompactionTrigger.AGE_AND_TURNS


def test_episodic_thresholds_fire_at_the_threshold_like_the_seed() -> None:
    """The episodic rules compare with >= (one below the threshold fires nothing)."""
    config = EpisodicCompactionConfig(trigger_context_tokens=1000)
    below = EpisodicCompactionPressure(
        estimated_context_tokens=999,
        user_messages_after_latest_run_completed=7,
        conversation_age_days=29,
        total_user_messages=49,
    )
    assert episodic_compaction_trigger(below, config) is None


def test_manual_recovery_is_never_chosen_automatically() -> None:
    """Over a grid of pressures and configs, the policy never answers manual_recovery."""
    seen: set[EpisodicCompactionTrigger | None] = set()
    for tokens, unfinished, age, total, limit in itertools.product(
        (None, 0, 500, 10**6), (0, 8, 100), (0, 30, 400), (0, 50, 10**4), (None, 1, 1000)
    ):
        pressure = EpisodicCompactionPressure(
            estimated_context_tokens=tokens,
            user_messages_after_latest_run_completed=unfinished,
            conversation_age_days=age,
            total_user_messages=total,
        )
        seen.add(
            episodic_compaction_trigger(pressure, EpisodicCompactionConfig(trigger_context_tokens=limit))
        )
    assert EpisodicCompactionTrigger.MANUAL_RECOVERY not in seen
    assert seen == {None, *(t for t in EpisodicCompactionTrigger if t.value != "manual_recovery")}


def test_for_context_window_sets_the_context_threshold_to_a_fraction_of_the_window() -> None:
    """for_context_window(128_000, 0.75) triggers context pressure at 96,000 tokens."""
    config = EpisodicCompactionConfig.for_context_window(128_000, 0.75)
    assert config.trigger_context_tokens == 96_000
    assert config.trigger_unfinished_turns == 8
    assert EpisodicCompactionConfig.for_context_window(200_000).trigger_context_tokens == 160_000
    custom = EpisodicCompactionConfig.for_context_window(10_000, 0.5, trigger_unfinished_turns=3)
    assert (custom.trigger_context_tokens, custom.trigger_unfinished_turns) == (5_000, 3)


def test_token_count_fraction_of_fires_above_the_fraction_of_the_window() -> None:
    """TokenCount.fraction_of(1000, 0.5) is TokenCount(500)."""
    trigger = TokenCount.fraction_of(1000, 0.5)
    assert trigger == TokenCount(500)
    assert not trigger.fires(Pressure(0, 500))
    assert trigger.fires(Pressure(0, 501))
    assert TokenCount.fraction_of(128_000) == TokenCount(102_400)


@pytest.mark.parametrize(
    ("window", "fraction", "limit"),
    [
        (200_000, 0.57, 114_000),
        (100_000, 0.29, 29_000),
        (100, 0.29, 29),
        (1_000_000, 0.07, 70_000),
        (10, 0.15, 1),
        (3, 0.5, 1),
        (7, 1, 7),
    ],
)
def test_a_fraction_of_a_window_is_the_exact_product_rounded_down(
    window: int, fraction: float, limit: int
) -> None:
    """57% of 200,000 is 114,000, not the 113,999 a float product truncates to; both builders agree."""
    assert TokenCount.fraction_of(window, fraction).limit == limit
    assert EpisodicCompactionConfig.for_context_window(window, fraction).trigger_context_tokens == limit


@pytest.mark.parametrize(
    ("window", "fraction", "key"),
    [
        (0, 0.8, "context_window"),
        (-5, 0.8, "context_window"),
        (True, 0.8, "context_window"),
        (1000, 0, "fraction"),
        (1000, 1.5, "fraction"),
        (1000, float("nan"), "fraction"),
        (1000, True, "fraction"),
    ],
)
def test_fraction_of_a_window_rejects_nonsense(window: int, fraction: float, key: str) -> None:
    """A non-positive window or a fraction outside (0, 1] is a ConfigError naming the key."""
    with pytest.raises(ConfigError) as info:
        TokenCount.fraction_of(window, fraction)
    assert info.value.key == key
    assert "must be" in info.value.reason
    with pytest.raises(ConfigError):
        EpisodicCompactionConfig.for_context_window(window, fraction)


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: TurnCount(-1), "TurnCount.limit"),
        (lambda: TokenCount(-1), "TokenCount.limit"),
        (lambda: TokenCount(True), "TokenCount.limit"),
        (lambda: TokenCount(None), "TokenCount.limit"),  # type: ignore[arg-type]
        (lambda: TurnCount(2.5), "TurnCount.limit"),  # type: ignore[arg-type]
        (lambda: EpisodicCompactionConfig(trigger_unfinished_turns=None), "trigger_unfinished_turns"),  # type: ignore[arg-type]
        (lambda: EpisodicCompactionConfig(trigger_age_days=float("nan")), "trigger_age_days"),  # type: ignore[arg-type]
        (lambda: EpisodicCompactionConfig(trigger_unfinished_turns=-1), "trigger_unfinished_turns"),
        (lambda: EpisodicCompactionConfig(trigger_age_days=-1), "trigger_age_days"),
        (lambda: EpisodicCompactionConfig(trigger_age_turn_count=-3), "trigger_age_turn_count"),
        (lambda: EpisodicCompactionConfig(trigger_context_tokens=0), "trigger_context_tokens"),
        (lambda: EpisodicCompactionConfig(trigger_unfinished_turns=0), "trigger_unfinished_turns"),
        (
            lambda: EpisodicCompactionConfig(trigger_age_days=0, trigger_age_turn_count=0),
            "trigger_age_turn_count",
        ),
        (lambda: AnyOf(TurnCount(1)), "AnyOf"),
        (lambda: AllOf(TurnCount(1), "tokens"), "AllOf"),  # type: ignore[arg-type]
    ],
)
def test_bad_trigger_settings_are_config_errors(build: object, key: str) -> None:
    """A negative limit, a rule that would fire on every request or a non-trigger operand names its key."""
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert info.value.key == key


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: TokenCount(-1),
            "TokenCount.limit=-1: must be a whole number >= 0, for example TokenCount(8000)",
        ),
        (lambda: TurnCount(-1), "TurnCount.limit=-1: must be a whole number >= 0, for example TurnCount(50)"),
        (
            lambda: EpisodicCompactionConfig(trigger_age_days=-1),
            "trigger_age_days=-1: must be a whole number >= 0, for example 30 (the default)",
        ),
        (
            lambda: TokenCount.fraction_of(0),
            "context_window=0: must be a positive token count, for example 128000",
        ),
    ],
    ids=["token-count", "turn-count", "episodic-age", "context-window"],
)
def test_a_bad_trigger_count_names_a_value_that_works(build: object, message: str) -> None:
    """A negative limit or window says a value that would be accepted."""
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("field", "message", "example"),
    [
        (
            "trigger_unfinished_turns",
            "trigger_unfinished_turns=-1: must be a whole number >= 1, for example 8 (the default)",
            8,
        ),
        (
            "trigger_context_tokens",
            "trigger_context_tokens=-1: must be a whole number >= 1, "
            "for example 100000, or None (the default)",
            100_000,
        ),
    ],
)
def test_a_threshold_that_refuses_zero_gives_its_real_range_for_a_negative(
    field: str, message: str, example: int
) -> None:
    """A negative count for a threshold where 0 is refused too says >= 1, and the example it gives works."""
    with pytest.raises(ConfigError) as info:
        EpisodicCompactionConfig(**{field: -1})  # type: ignore[arg-type]
    assert str(info.value) == message
    assert getattr(EpisodicCompactionConfig(**{field: example}), field) == example  # type: ignore[arg-type]
    assert getattr(EpisodicCompactionConfig(**{field: 1}), field) == 1  # type: ignore[arg-type]


def test_one_of_the_age_thresholds_may_be_zero() -> None:
    """A zero age or a zero turn count alone still leaves the age rule a real condition."""
    any_age = EpisodicCompactionConfig(trigger_age_days=0)
    assert episodic_compaction_trigger(EpisodicCompactionPressure(total_user_messages=49), any_age) is None
    assert (
        episodic_compaction_trigger(EpisodicCompactionPressure(total_user_messages=50), any_age) is not None
    )
    any_count = EpisodicCompactionConfig(trigger_age_turn_count=0)
    assert (
        episodic_compaction_trigger(EpisodicCompactionPressure(conversation_age_days=29), any_count) is None
    )
    assert (
        episodic_compaction_trigger(EpisodicCompactionPressure(conversation_age_days=30), any_count)
        is not None
    )


def test_episodic_policy_as_a_trigger_uses_the_runtime_token_count() -> None:
    """EpisodicPolicy reads the context estimate from Pressure.tokens and names the episodic reason."""
    policy = EpisodicPolicy(EpisodicCompactionConfig(trigger_context_tokens=1000))
    assert isinstance(policy, Trigger)
    assert policy.reason(Pressure(3, 1000)) == "context_pressure"
    assert policy.reason(Pressure(3, 999)) is None
    stalled = EpisodicCompactionPressure(user_messages_after_latest_run_completed=8)
    assert policy.reason(Pressure(3, 10, episodic=stalled)) == "unfinished_turns"
    assert (policy | TurnCount(100)).reason(Pressure(101, 0)) == "turn_count"
