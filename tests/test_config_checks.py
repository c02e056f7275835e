"""Settings no fold can honour are refused when they are built, naming the key, the value and the fix.

Each was accepted before: a preset's summary size against a smaller target a
strategy set, a summary size the extractive fallback cannot write named by
options the API does not take, ``TokenBudget(0)``, and a tool call never
abandoned. The fixes they suggest are accepted when followed: no value the
caller never gave, no pair of errors that send the caller back and forth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from contextfold import (
    Compactor,
    ConfigError,
    Message,
    RunOptions,
    SlidingWindow,
    SummarizeOptions,
    TokenBudget,
    TokenCount,
    TurnCount,
)
from contextfold.planning import AllOf
from contextfold.stores import MemoryStore
from contextfold.summarizers import ExtractiveSummarizer, FunctionSummarizer
from contextfold.tokens import ApproximateCounter


async def short(messages: Sequence[Message], previous: str | None, max_tokens: int) -> str:
    return "short summary"


async def fold_long_thread(compactor: Compactor) -> tuple[bool, bool, int]:
    """Fold a 300-message thread once: (compacted, stalled, tokens after)."""
    await compactor.append("t", [Message.system("sys")])
    for n in range(300):
        await compactor.append("t", [Message.user(f"q{n} " + "x " * 60)])
    result = await compactor.maybe_compact("t")
    assert result is not None
    _, tokens = await compactor.context_tokens("t")
    return result.compacted, result.stalled, tokens


@pytest.mark.parametrize(
    ("options", "key"),
    [
        (SummarizeOptions(trigger_token_budget=8000), "max_summary_tokens"),
        (
            RunOptions(max_history_tokens=8000, compaction=SummarizeOptions(trigger_token_budget=8000)),
            "compaction.max_summary_tokens",
        ),
    ],
    ids=["preset", "run-options"],
)
async def test_a_preset_summary_size_at_a_strategys_smaller_target_is_refused_and_its_fix_folds_under_it(
    options: Any, key: str
) -> None:
    """The preset's 1024-token summary against TokenBudget(900) is refused; the size it names folds under 900.

    Before, it was accepted and every fold ended at 1128 tokens against the 900-token target.
    """
    with pytest.raises(ConfigError) as caught:
        Compactor(MemoryStore(), options=options, strategy=TokenBudget(900), counter=ApproximateCounter())
    assert caught.value.key == key and caught.value.value == 1024
    assert str(caught.value) == (
        f"{key}=1024: must be below the 900-token target of strategy=TokenBudget(max_tokens=900, "
        "keep_recent_turns=0), which replaces the preset's target (unset, it is 1024 or half the "
        "preset's own target, whichever is smaller): a summary that large leaves the kept turns no room, "
        "so folds would end over the target; set max_summary_tokens to between 41 and 450 (the default "
        "summarizer, an ExtractiveSummarizer, also the fallback, needs 41 for its section headings), or use "
        "a target above 1024, for example TokenBudget(max_tokens=2048, keep_recent_turns=0)"
    )
    async with MemoryStore() as store:
        compactor = Compactor(
            store,
            options=SummarizeOptions(trigger_token_budget=8000, max_summary_tokens=450),
            strategy=TokenBudget(900),
            counter=ApproximateCounter(),
        )
        compacted, stalled, tokens = await fold_long_thread(compactor)
    assert compacted and not stalled and tokens <= 900


async def test_a_larger_target_the_summary_size_error_names_folds_under_it() -> None:
    """The other fix the error names, a target above the summary size, is accepted and folds under it."""
    async with MemoryStore() as store:
        compactor = Compactor(
            store,
            options=SummarizeOptions(trigger_token_budget=8000),
            strategy=TokenBudget(2048),
            counter=ApproximateCounter(),
        )
        compacted, stalled, tokens = await fold_long_thread(compactor)
    assert compacted and not stalled and tokens <= 2048


def test_a_summary_size_the_caller_set_is_named_as_set() -> None:
    """A max_summary_tokens the caller set at a strategy's target or above is refused as set, not unset."""
    options = SummarizeOptions(trigger_token_budget=8000, max_summary_tokens=1000)
    with pytest.raises(ConfigError) as caught:
        Compactor(MemoryStore(), options=options, strategy=TokenBudget(900))
    assert caught.value.key == "max_summary_tokens" and caught.value.value == 1000
    assert "(unset" not in caught.value.reason
    assert "set max_summary_tokens to between 41 and 450 (the default" in caught.value.reason
    assert "or use a target above 1000" in caught.value.reason


@pytest.mark.parametrize(
    ("trigger", "target", "summary", "source"),
    [
        (TokenCount(160), 80, 40, "TokenCount(160)"),
        (AllOf(TurnCount(10), TokenCount(50)), 25, 12, "TokenCount(50)"),
    ],
    ids=["token-count", "all-of"],
)
def test_a_fallback_that_cannot_fit_is_named_with_fixes_of_the_building_blocks(
    trigger: Any, target: int, summary: int, source: str
) -> None:
    """With triggers and strategies, a default fallback that cannot fit is keyed fallback, with working fixes.

    Before, the error named max_summary_tokens and trigger_token_budget, which
    this API does not take, and suggested the FunctionSummarizer already passed.
    """
    least = ExtractiveSummarizer().least_summary_tokens()
    with pytest.raises(ConfigError) as caught:
        Compactor(
            MemoryStore(), trigger=trigger, strategy=TokenBudget(target), summarizer=FunctionSummarizer(short)
        )
    assert caught.value.key == "fallback"
    assert str(caught.value) == (
        "fallback: is unset, so it is an ExtractiveSummarizer, asked whenever the summarizer fails, which "
        f"needs {least} tokens for its section headings alone; summaries get {summary} here, half the "
        f"{target}-token target of strategy=TokenBudget(max_tokens={target}, keep_recent_turns=0), so every "
        "fold that falls back to it would fail; pass fallback= a summarizer that writes summaries that "
        "short, such as a FunctionSummarizer (the summarizer you passed will do), or give summaries room "
        "with a target of 210 or more, for example TokenBudget(max_tokens=210, keep_recent_turns=0) with a "
        f"trigger above it, such as TokenCount(420) in place of {source}"
    )
    assert "trigger_token_budget" not in str(caught.value)
    assert "max_summary_tokens" not in str(caught.value)
    # Both fixes it names are accepted.
    Compactor(
        MemoryStore(),
        trigger=trigger,
        strategy=TokenBudget(target),
        summarizer=FunctionSummarizer(short),
        fallback=FunctionSummarizer(short),
    )
    wider = AllOf(TurnCount(10), TokenCount(420)) if isinstance(trigger, AllOf) else TokenCount(420)
    Compactor(MemoryStore(), trigger=wider, strategy=TokenBudget(210), summarizer=FunctionSummarizer(short))


def test_a_default_summarizer_that_cannot_fit_names_the_strategy() -> None:
    """With no summarizer given, the size derived from the strategy's target is the key, with both fixes."""
    with pytest.raises(ConfigError) as caught:
        Compactor(MemoryStore(), trigger=TokenCount(160), strategy=TokenBudget(80))
    assert caught.value.key == "strategy" and caught.value.value == TokenBudget(80)
    reason = caught.value.reason
    assert reason.startswith("leaves summaries 40 tokens, half its 80-token target, below the ")
    assert "the default summarizer, an ExtractiveSummarizer, also the fallback," in reason
    assert "use a target of 210 or more, for example TokenBudget(max_tokens=210" in reason
    assert reason.endswith(
        "pass summarizer= a summarizer that writes summaries that short, such as a FunctionSummarizer, and "
        "fallback= one like it"
    )
    Compactor(
        MemoryStore(),
        trigger=TokenCount(160),
        strategy=TokenBudget(80),
        summarizer=FunctionSummarizer(short),
        fallback=FunctionSummarizer(short),
    )


def test_a_preset_whose_fallback_cannot_fit_names_the_fallback_and_the_policy() -> None:
    """Under a preset, a default fallback that cannot fit names fallback= and the policy."""
    with pytest.raises(ConfigError) as caught:
        Compactor(
            MemoryStore(),
            options=SummarizeOptions(trigger_token_budget=100),
            summarizer=FunctionSummarizer(short),
        )
    assert caught.value.key == "max_summary_tokens" and caught.value.value == 25
    reason = caught.value.reason
    assert "the default fallback (an ExtractiveSummarizer, asked whenever the summarizer fails)" in reason
    assert (
        "so every fold that falls back to it would fail; give it between 41 and 49, all the 50-token "
        "target allows (unset, it is half of target_tokens, by default a quarter of trigger_token_budget: "
        "a budget of 420 or more)"
    ) in reason
    assert reason.endswith(
        "pass fallback= a summarizer that writes summaries that short, such as a FunctionSummarizer (the "
        "summarizer you passed will do), or on_summarizer_error='raise' or 'skip', which ask no fallback"
    )
    Compactor(
        MemoryStore(),
        options=SummarizeOptions(trigger_token_budget=100),
        summarizer=FunctionSummarizer(short),
        fallback=FunctionSummarizer(short),
    )


def test_a_target_of_one_token_leaves_no_room_for_a_summary() -> None:
    """TokenBudget(1) summarizing is refused even with summarizers that write one-token summaries."""
    with pytest.raises(ConfigError) as caught:
        Compactor(
            MemoryStore(),
            trigger=TokenCount(160),
            strategy=TokenBudget(1),
            summarizer=FunctionSummarizer(short),
            fallback=FunctionSummarizer(short),
        )
    assert caught.value.key == "strategy"
    assert "use a target of at least 2, for example TokenBudget(max_tokens=80" in caught.value.reason


async def test_a_zero_token_budget_is_refused_and_the_alternative_it_names_folds() -> None:
    """TokenBudget(0) is refused when built; SlidingWindow(0), which it names, folds where it stalled.

    Before, every fold stalled on "the pinned head alone holds 0 tokens", on a
    thread with no system prompt.
    """
    with pytest.raises(ConfigError) as caught:
        TokenBudget(0)
    assert caught.value.key == "TokenBudget.max_tokens" and caught.value.value == 0
    assert str(caught.value) == (
        "TokenBudget.max_tokens=0: must be non-zero: the target covers the whole request, pinned head "
        "included, and no request fits in 0 tokens, so every fold would stall; use a positive target such as "
        "TokenBudget(4000), or SlidingWindow(0) to keep only the protected turns, instead of a zero target"
    )
    with pytest.raises(ConfigError, match=r"TokenBudget.max_tokens=-3: must be a whole number >= 1"):
        TokenBudget(-3)
    async with MemoryStore() as store:
        compactor = Compactor(
            store,
            trigger=TurnCount(5),
            strategy=SlidingWindow(0),
            counter=ApproximateCounter(),
            summarizer=FunctionSummarizer(short),
        )
        for n in range(10):
            await compactor.append("t", [Message.user(f"q{n}"), Message.assistant(f"a{n}")])
        result = await compactor.maybe_compact("t")
    assert result is not None and result.compacted and not result.stalled


@pytest.mark.parametrize(
    "build",
    [
        lambda: SummarizeOptions(trigger_token_budget=2000, abandon_after_turns=None),
        lambda: SummarizeOptions.model_validate({"trigger_token_budget": 2000, "abandon_after_turns": None}),
        lambda: SummarizeOptions(trigger_token_budget=2000).model_copy(update={"abandon_after_turns": None}),
        lambda: RunOptions(
            max_history_tokens=8000, compaction={"trigger_token_budget": 2000, "abandon_after_turns": None}
        ),
    ],
    ids=["constructor", "model_validate", "model_copy", "run-options"],
)
def test_a_tool_call_that_can_never_be_abandoned_is_refused(build: Any) -> None:
    """abandon_after_turns=None with no abandon_after_seconds is refused, naming both and the fix.

    Before, one call that never got its result blocked every fold: the context
    grew to 10,240 tokens against a 2,000-token budget.
    """
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.key == "compaction.abandon_after_turns" and caught.value.value is None
    assert str(caught.value) == (
        "compaction.abandon_after_turns=None: is None and so is abandon_after_seconds, so a tool call that "
        "never gets its result is never abandoned: it stays pending and blocks every fold of its thread for "
        "good; keep abandon_after_turns=8 (the default), or set abandon_after_seconds, for example 600, to "
        "abandon by time only"
    )
    timed = SummarizeOptions(trigger_token_budget=2000, abandon_after_turns=None, abandon_after_seconds=600)
    assert timed.abandon_after_turns is None and timed.abandon_after_seconds == 600


@pytest.mark.parametrize("never", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("turns", [8, None], ids=["with-turns", "time-only"])
def test_abandon_after_seconds_that_never_comes_is_refused_naming_the_fix(
    never: float, turns: int | None
) -> None:
    """An infinite (or NaN) abandon_after_seconds is "never": refused, as None with no turns is.

    Before, math.inf was accepted, also beside abandon_after_turns=None: a call
    that never got its result then blocked every fold for good.
    """
    with pytest.raises(ConfigError) as caught:
        SummarizeOptions(trigger_token_budget=2000, abandon_after_turns=turns, abandon_after_seconds=never)
    assert caught.value.key == "compaction.abandon_after_seconds"
    assert "for example 600, or None (the default) to abandon by turns only" in str(caught.value)
    if math.isinf(never):
        assert "is infinite; it must be a finite number above 0" in str(caught.value)
    fixed = SummarizeOptions(trigger_token_budget=2000, abandon_after_turns=turns, abandon_after_seconds=600)
    assert fixed.abandon_after_seconds == 600


@pytest.mark.parametrize(("budget", "limit", "least"), [(0, 100_000, 25_000), (-5, None, 32_000)])
def test_a_zero_budget_in_run_options_names_the_smallest_budget_they_take(
    budget: int, limit: int | None, least: int
) -> None:
    """Given with max_history_tokens, a budget of 0 or below is told the smallest one the window rule takes.

    Before: "use a budget of at least 4, for example 8000", both of which the
    window rule then refused at max_history_tokens = 100,000.
    """
    given: dict[str, Any] = {"compaction": {"trigger_token_budget": budget}}
    if limit is not None:
        given["max_history_tokens"] = limit
    with pytest.raises(ConfigError) as caught:
        RunOptions(**given)
    assert caught.value.key == "compaction.trigger_token_budget" and caught.value.value == budget
    assert f"a budget from {least} (max_history_tokens = {limit or 128_000} / 4, rounded up)" in str(
        caught.value
    )
    fixed = RunOptions(**{**given, "compaction": {"trigger_token_budget": least}})
    assert fixed.compaction is not None and fixed.compaction.trigger_token_budget == least
    with pytest.raises(ConfigError, match="is below max_history_tokens"):
        RunOptions(**{**given, "compaction": {"trigger_token_budget": least - 1}})


def test_a_zero_budget_beside_another_mistake_leaves_that_mistake_named_first() -> None:
    """The smallest-budget hint never hides an unknown or renamed option beside the zero budget, names
    no formula that did not make its number, and names only a budget the options then take.
    """
    with pytest.raises(ConfigError) as caught:
        RunOptions(compaction={"trigger_token_budget": 0, "tigger": 3})
    assert caught.value.key == "compaction.tigger"
    with pytest.raises(ConfigError) as caught:
        RunOptions(compaction={"trigger_token_budget": 0, "keep_recent_messages": 3})
    assert caught.value.key == "compaction.keep_recent_messages"
    with pytest.raises(ConfigError) as caught:
        RunOptions(max_history_tokens=8, compaction={"trigger_token_budget": 0})
    assert str(caught.value).endswith("use a budget from 4 to 8, for example 8")
    assert RunOptions(max_history_tokens=8, compaction={"trigger_token_budget": 8}).compaction is not None


def build_with_short_summaries(trigger: Any, strategy: Any) -> Compactor:
    return Compactor(
        MemoryStore(),
        trigger=trigger,
        strategy=strategy,
        summarizer=FunctionSummarizer(short),
        fallback=FunctionSummarizer(short),
    )


@pytest.mark.parametrize(
    ("trigger", "strategy", "target", "wider"),
    [
        (TokenCount(1), TokenBudget(5), 5, TokenCount(10)),
        (TokenCount(0), TokenBudget(5), 5, TokenCount(10)),
        (TokenCount(1) | TurnCount(50), [TokenBudget(300, keep_recent_turns=2)], 300, TokenCount(600)),
    ],
    ids=["token-count-1", "token-count-0", "any-of"],
)
def test_a_target_above_a_trigger_of_one_token_or_none_names_the_strategy_and_only_a_trigger_fix(
    trigger: Any, strategy: Any, target: int, wider: TokenCount
) -> None:
    """Below a 2-token trigger no target is accepted: keyed strategy, the error names only a larger trigger.

    Before, building the suggestion TokenBudget(0) raised an error about
    TokenBudget.max_tokens=0, a value the caller never gave.
    """
    with pytest.raises(ConfigError) as caught:
        build_with_short_summaries(trigger, strategy)
    assert caught.value.key == "strategy" and caught.value.value == strategy
    assert caught.value.reason.startswith(f"aims a fold at {target} tokens, at or above the ")
    assert caught.value.reason.endswith(
        f"use a trigger above {target}, for example TokenCount({wider.limit})"
    )
    assert "target below" not in caught.value.reason
    # Short summarizers: the extractive one's headings do not fit a 5-token target, another error.
    build_with_short_summaries(wider, strategy)


@pytest.mark.parametrize(
    ("options", "trigger", "smaller"),
    [
        (None, TokenCount(3), TokenBudget(2)),
        (
            SummarizeOptions(trigger_token_budget=8000, max_summary_tokens=600),
            TokenCount(1000),
            TokenBudget(601),
        ),
    ],
    ids=["strategy-alone", "preset-summary-size"],
)
def test_the_smaller_target_a_target_above_trigger_error_names_is_accepted(
    options: Any, trigger: TokenCount, smaller: TokenBudget
) -> None:
    """The smaller target suggested leaves its summary room: 2 or more alone, above a preset's summary size.

    Before, TokenBudget(1) and TokenBudget(500) were suggested, and refused when followed.
    """
    kwargs: dict[str, Any] = {"summarizer": FunctionSummarizer(short), "fallback": FunctionSummarizer(short)}
    with pytest.raises(ConfigError) as caught:
        Compactor(MemoryStore(), options=options, trigger=trigger, strategy=TokenBudget(2000), **kwargs)
    assert caught.value.key == "strategy" and caught.value.value == TokenBudget(2000)
    assert f"use a target below {trigger.limit}, for example {smaller!r}, or a trigger" in caught.value.reason
    Compactor(MemoryStore(), options=options, trigger=trigger, strategy=smaller, **kwargs)


def build_preset(strategy: TokenBudget, **preset: Any) -> Compactor:
    return Compactor(
        MemoryStore(),
        options=SummarizeOptions(trigger_token_budget=8000, **preset),
        strategy=strategy,
        counter=ApproximateCounter(),
    )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (
            {},
            "set max_summary_tokens to between 41 and 59 (the default summarizer, an ExtractiveSummarizer, ",
        ),
        (
            {"max_summary_tokens": 30},
            "would fail; give it between 41 and 59, all the 60-token target allows, or ",
        ),
        (
            {"max_summary_tokens": 105},
            "set max_summary_tokens to between 41 and 59 (the default summarizer, ",
        ),
        (
            {"max_summary_tokens": 1024},
            "set max_summary_tokens to between 41 and 59 (the default summarizer, ",
        ),
    ],
    ids=["unset", "below-the-headings", "at-the-target", "given-as-the-derived-size"],
)
def test_a_preset_summary_size_suggested_against_a_small_strategy_target_holds_the_headings(
    given: dict[str, int], says: str
) -> None:
    """Against TokenBudget(60), each error suggests 41 to 59: enough for the headings, below the target.

    Before, one error said at most 30, the other 105 or more, each refused by
    the other check: a loop, though 41 to 59 were accepted.
    """
    with pytest.raises(ConfigError) as caught:
        build_preset(TokenBudget(60), **given)
    assert caught.value.key == "max_summary_tokens"
    assert caught.value.value == given.get("max_summary_tokens", 1024)
    assert says in caught.value.reason
    assert ("(unset" in caught.value.reason) == (not given)
    for size in (41, 59):
        build_preset(TokenBudget(60), max_summary_tokens=size)


def test_a_strategy_target_below_the_headings_is_answered_with_a_larger_target_only() -> None:
    """With no size below the target that holds the headings, a larger target is suggested (and a size)."""
    with pytest.raises(ConfigError) as caught:
        build_preset(TokenBudget(30))
    assert (caught.value.key, caught.value.value) == ("max_summary_tokens", 1024)
    assert caught.value.reason.endswith(
        "over the target; use a target above 1024, for example "
        "TokenBudget(max_tokens=2048, keep_recent_turns=0)"
    )
    build_preset(TokenBudget(2048))
    with pytest.raises(ConfigError) as caught:
        build_preset(TokenBudget(20), max_summary_tokens=30)
    assert (caught.value.key, caught.value.value) == ("max_summary_tokens", 30)
    assert caught.value.reason.endswith(
        "over the target; set max_summary_tokens=105 and a strategy target above it, for example "
        "TokenBudget(max_tokens=210, keep_recent_turns=0)"
    )
    build_preset(TokenBudget(210), max_summary_tokens=105)


def test_a_preset_target_too_small_for_the_advised_size_is_told_sizes_below_it() -> None:
    """A budget of 100 (a 50-token target) is told 41 to 49, or a budget of 420: each is accepted.

    Before, it was told 105 or more, which its own 50-token target refuses.
    """
    with pytest.raises(ConfigError) as caught:
        Compactor(MemoryStore(), options=SummarizeOptions(trigger_token_budget=100))
    assert (caught.value.key, caught.value.value) == ("max_summary_tokens", 25)
    assert (
        "would fail; give it between 41 and 49, all the 50-token target allows (unset, it is half of "
        "target_tokens, by default a quarter of trigger_token_budget: a budget of 420 or more), or "
    ) in caught.value.reason
    for options in (
        SummarizeOptions(trigger_token_budget=100, max_summary_tokens=41),
        SummarizeOptions(trigger_token_budget=100, max_summary_tokens=49),
        SummarizeOptions(trigger_token_budget=420),
    ):
        Compactor(MemoryStore(), options=options)
    with pytest.raises(ConfigError) as caught:  # a 20-token target: no size below it holds the headings
        Compactor(MemoryStore(), options=SummarizeOptions(trigger_token_budget=40))
    assert (caught.value.key, caught.value.value) == ("max_summary_tokens", 10)
    assert (
        "would fail; set max_summary_tokens=105 and trigger_token_budget=420 (the preset's"
        in caught.value.reason
    )
    Compactor(MemoryStore(), options=SummarizeOptions(trigger_token_budget=420, max_summary_tokens=105))
