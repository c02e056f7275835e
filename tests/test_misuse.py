"""Misuse a newcomer makes is refused where it is made, naming the argument, the value and the fix.

Each of these used to be accepted and to fail later (a bare ``TypeError`` or
``AttributeError`` at the first append or fold), or to fail with pydantic's own
error instead of contextfold's, or to be stored as something else than given.
"""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from contextfold import (
    Compactor,
    ConfigError,
    EpisodicCompactionConfig,
    InvalidMessageError,
    Message,
    ObservationMasking,
    RunOptions,
    StepLoop,
    SummarizeOptions,
    TokenBudget,
    TokenCount,
    TurnCount,
    Usage,
)
from contextfold.planning import AllOf, EpisodicPolicy
from contextfold.stores import MemoryStore
from contextfold.summarizers import ExtractiveSummarizer
from contextfold.tokens import ApproximateCounter

OPTIONS = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=2_000))


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    async with MemoryStore() as backend:
        yield backend


@pytest.mark.parametrize(
    ("counter", "fix"),
    [
        ("o200k_base", re.escape('pass TiktokenCounter("o200k_base")')),
        (ApproximateCounter, re.escape("pass ApproximateCounter()")),
        (object(), re.escape("e.g. TiktokenCounter() or ApproximateCounter()")),
    ],
)
async def test_a_counter_that_is_not_a_counter_instance_is_refused_when_built(
    store: MemoryStore, counter: Any, fix: str
) -> None:
    with pytest.raises(ConfigError, match=fix) as caught:
        Compactor(store, options=OPTIONS, counter=counter)
    assert caught.value.key == "counter"
    with pytest.raises(ConfigError, match=fix):
        ExtractiveSummarizer(counter=counter)


async def test_subscribers_and_telemetry_of_the_wrong_kind_are_config_errors(store: MemoryStore) -> None:
    def on_event(event: object) -> None: ...

    with pytest.raises(ConfigError, match=r"subscribers=\[on_event\]") as caught:
        Compactor(store, options=OPTIONS, subscribers=on_event)  # type: ignore[arg-type]
    assert caught.value.key == "subscribers"
    with pytest.raises(ConfigError, match=re.escape("Telemetry.create()")) as caught:
        Compactor(store, options=OPTIONS, telemetry="otel")  # type: ignore[arg-type]
    assert caught.value.key == "telemetry"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_tokens", -1),
        ("request_messages", True),
        ("request_messages", 2.5),
        ("model", 123),
        ("usage", {"input_tokens": 3}),
    ],
)
async def test_appends_llm_call_fields_are_config_errors_and_nothing_is_written(
    store: MemoryStore, field: str, value: Any
) -> None:
    compactor = Compactor(store, options=OPTIONS, counter=ApproximateCounter())
    await compactor.append("t", [Message.user("hi")])
    with pytest.raises(ConfigError) as caught:
        await compactor.append("t", [Message.assistant("hello")], **{field: value})
    assert caught.value.key == field
    assert f"{field}={value!r}" in str(caught.value)
    assert [m.text for m in (await store.load("t")).plain] == ["hi"]
    assert len([record async for record in store.replay("t")]) == 1
    await compactor.append("t", [Message.assistant("hello")], model="m", usage=Usage(input_tokens=3))


async def test_a_step_loop_given_a_store_or_nothing_says_to_wrap_it_in_a_compactor(
    store: MemoryStore,
) -> None:
    with pytest.raises(
        ConfigError, match=r"StepLoop\(Compactor\(MemoryStore\(...\), options=...\)\)"
    ) as caught:
        StepLoop(store)  # type: ignore[arg-type]
    assert caught.value.key == "compactor"
    with pytest.raises(ConfigError, match=r"StepLoop\(Compactor\(store, options=...\)\)"):
        StepLoop(None)  # type: ignore[arg-type]


async def test_a_list_where_messages_go_one_by_one_says_to_unpack_it(store: MemoryStore) -> None:
    loop = StepLoop(Compactor(store, options=OPTIONS, counter=ApproximateCounter()))
    history = [Message.user("x")]
    with pytest.raises(ConfigError, match=r"unpack it: append\(thread, \*messages\)") as caught:
        await loop.append("t", history)  # type: ignore[arg-type]
    assert caught.value.key == "messages"

    async def llm(messages: Sequence[Message]) -> Message:
        return Message.assistant("hi")

    with pytest.raises(ConfigError, match=r"loop.append\(thread, \*messages\)") as caught:
        await loop.run("t", history, llm=llm)  # type: ignore[arg-type]
    assert caught.value.key == "user"
    assert (await store.load("t")).plain == []
    await loop.append("t", *history)
    assert (await store.load("t")).plain == history


@pytest.mark.parametrize(
    ("option", "value"),
    [("abandon_after_seconds", True), ("background_at", "0.8"), ("abandon_after_seconds", "5")],
)
def test_fractional_options_are_as_strict_as_their_siblings(option: str, value: Any) -> None:
    """``abandon_after_seconds=True`` became one second; ``background_at="0.8"`` was taken as 0.8."""
    with pytest.raises(ConfigError) as caught:
        SummarizeOptions(trigger_token_budget=8_000, **{option: value})
    assert caught.value.key == f"compaction.{option}"
    SummarizeOptions(trigger_token_budget=8_000, abandon_after_seconds=5, background_at=0.8)


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        ({"handle": object()}, "metadata.handle"),
        ({"nested": [1, {"lock": threading.Lock()}]}, r"metadata.nested\[1\].lock"),
    ],
)
def test_metadata_with_no_json_form_is_refused_at_construction(metadata: dict[str, Any], where: str) -> None:
    """Such an object was accepted by ``Message`` and failed only at ``append``."""
    with pytest.raises(
        InvalidMessageError, match=f"{where}: must be JSON data, not .* which has no JSON form"
    ):
        Message.user("x", metadata=metadata)
    # What pydantic writes as JSON is kept: the stores read it back as that JSON.
    kept = Message.user("x", metadata={"pair": (1, 2), "tags": {"a"}, "at": datetime(2026, 1, 2, tzinfo=UTC)})
    assert kept.metadata["tags"] == {"a"}


TARGET_OVER_TRIGGER = (
    "strategy=TokenBudget(max_tokens=2000, keep_recent_turns=0): aims a fold at 2000 tokens, at or above "
    "the 1000 tokens at which trigger=TokenCount(1000) fires, so no fold can bring the context below the "
    "trigger and it would fire again on every step; use a target below 1000, for example "
    "TokenBudget(max_tokens=500, keep_recent_turns=0), or a trigger above 2000, for example TokenCount(4000)"
)


async def test_a_fold_target_above_the_token_trigger_is_refused_when_built(store: MemoryStore) -> None:
    """TokenCount(1000) with TokenBudget(2000) folded on 29 of 40 steps; it is refused, naming both values."""
    with pytest.raises(ConfigError) as caught:
        Compactor(store, trigger=TokenCount(1_000), strategy=TokenBudget(2_000))
    assert caught.value.key == "strategy"
    assert str(caught.value) == TARGET_OVER_TRIGGER
    Compactor(store, trigger=TokenCount(1_000), strategy=TokenBudget(500))  # the value it names
    Compactor(store, trigger=TokenCount(4_000), strategy=TokenBudget(2_000))


@pytest.mark.parametrize(
    ("build", "key", "says"),
    [
        (
            lambda s: Compactor(s, trigger=TokenCount(1_000), strategy=TokenBudget(1_000)),
            "strategy",
            "aims a fold at 1000 tokens, at or above the 1000 tokens at which trigger=TokenCount(1000) fires",
        ),
        (
            lambda s: Compactor(
                s,
                trigger=TokenCount(1_000) | TurnCount(50),
                strategy=[ObservationMasking(1), TokenBudget(1_500, keep_recent_turns=2)],
            ),
            "strategy",
            "at which trigger=AnyOf(TokenCount(limit=1000), TurnCount(limit=50)) (TokenCount(1000)) fires, "
            "so no fold can bring the context below the trigger and it would fire again on every step; "
            "use a target below 1000, for example TokenBudget(max_tokens=500, keep_recent_turns=2)",
        ),
        (
            lambda s: Compactor(
                s,
                trigger=EpisodicPolicy(EpisodicCompactionConfig(trigger_context_tokens=2_000)),
                strategy=TokenBudget(50_000),
            ),
            "strategy",
            "(trigger_context_tokens=2000) fires, so no fold can bring the context below the trigger and it "
            "would fire again on every step; use a target below 2000, for example "
            "TokenBudget(max_tokens=1000, keep_recent_turns=0), or a trigger above 50000, for example "
            "trigger_context_tokens=100000",
        ),
        (
            lambda s: Compactor(
                s, options=SummarizeOptions(trigger_token_budget=8_000), trigger=TokenCount(3_000)
            ),
            "trigger",
            "trigger=TokenCount(limit=3000): fires a fold at 3000 tokens (TokenCount(3000)), at or below the "
            "4000-token target of the options (compaction.target_tokens, half of trigger_token_budget by "
            "default), so no fold can bring the context below the trigger and it would fire again on every "
            "step; use a trigger above 4000, for example TokenCount(8000), or compaction.target_tokens below "
            "3000, for example 1500",
        ),
        (
            lambda s: Compactor(
                s, options=SummarizeOptions(trigger_token_budget=8_000), strategy=TokenBudget(9_000)
            ),
            "strategy",
            "aims a fold at 9000 tokens, at or above the 8000 tokens at which the options' trigger "
            "(TokenCount(8000)) fires",
        ),
    ],
    ids=[
        "equal",
        "any-of-pipeline",
        "episodic-context-tokens",
        "preset-with-trigger",
        "preset-with-strategy",
    ],
)
async def test_every_way_to_aim_a_fold_at_or_above_its_token_trigger_is_refused(
    store: MemoryStore, build: Any, key: str, says: str
) -> None:
    """Triggers and strategies given directly, alone or beside a preset, are checked like the preset's own."""
    with pytest.raises(ConfigError) as caught:
        build(store)
    assert caught.value.key == key
    assert says in str(caught.value)


async def test_an_all_of_trigger_fires_at_its_highest_token_limit(store: MemoryStore) -> None:
    """AllOf(TokenCount(1000), TokenCount(3000)) fires above 3000, so a 2000-token target is fine."""
    compactor = Compactor(
        store, trigger=AllOf(TokenCount(1_000), TokenCount(3_000)), strategy=TokenBudget(2_000)
    )
    assert compactor.settings is not None and compactor.settings.budget == 3_000


async def test_an_episodic_policy_given_a_dict_is_refused_when_built(store: MemoryStore) -> None:
    """EpisodicPolicy({...}) was accepted, and the first check raised a bare AttributeError."""
    with pytest.raises(ConfigError) as caught:
        EpisodicPolicy({"trigger_unfinished_turns": 3})  # type: ignore[arg-type]
    assert caught.value.key == "EpisodicPolicy.config"
    assert str(caught.value) == (
        "EpisodicPolicy.config={'trigger_unfinished_turns': 3}: must be an EpisodicCompactionConfig, not "
        "dict; pass EpisodicPolicy(EpisodicCompactionConfig(trigger_unfinished_turns=3))"
    )
    Compactor(  # the fix it names
        store,
        trigger=EpisodicPolicy(EpisodicCompactionConfig(trigger_unfinished_turns=3)),
        strategy=TokenBudget(500),
    )
