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
    InvalidMessageError,
    Message,
    RunOptions,
    StepLoop,
    SummarizeOptions,
    Usage,
)
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
