"""A large message is encoded in a worker thread, not on the event loop, on every backend.

Encoding two megabytes of text takes milliseconds; the loop is left free while
it happens. The worker is seen by the thread ``encode_rows``' per-message step
runs in: the event loop's own thread for a small message, another for a
large one. What is stored is the same either way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

from contextfold import Message, StoreClosedError, ToolCall
from contextfold._episodes import episode_for
from contextfold.stores import MemoryStore, _rows

LARGE = 100_000
"""Characters of a large tool result: over ``PREPARE_ON_LOOP_CHARS``."""


@pytest.fixture
def encoded_in() -> Iterator[list[int]]:
    """The threads each message was encoded in, in order."""
    seen: list[int] = []
    row: Callable[..., Any] = _rows._row

    def spy(*args: Any) -> Any:
        seen.append(threading.get_ident())
        return row(*args)

    _rows._row = spy
    try:
        yield seen
    finally:
        _rows._row = row


def big_result(call_id: str = "c1") -> Message:
    return Message.tool(call_id, "x = 1  # a long file\n" * (LARGE // 21 + 1))


async def test_a_small_batch_is_encoded_on_the_loop_and_a_large_message_in_a_worker(
    store: Any, encoded_in: list[int]
) -> None:
    loop = threading.get_ident()
    call = ToolCall(id="c1", name="read_file", arguments='{"path": "big.py"}')
    small = [Message.user("read big.py"), Message.assistant(None, tool_calls=[call])]
    await store.append("t", small, [4, 9])
    assert encoded_in == [loop, loop]

    large = big_result()
    assert len(large.text) > _rows.PREPARE_ON_LOOP_CHARS
    stored = await store.append("t", [large], [30_000])
    assert len(encoded_in) == 3 and encoded_in[2] != loop
    assert [m.message for m in stored] == [large]
    window = await store.load("t")
    assert [m.message for m in window.messages] == [*small, large]
    assert window.total_tokens == 4 + 9 + 30_000


async def test_a_large_step_is_recorded_from_a_worker_in_one_transaction(
    store: Any, encoded_in: list[int]
) -> None:
    loop = threading.get_ident()
    large = big_result()
    stored = await store.record_and_append("t", [episode_for(large)], [large], [30_000], message_episodes=[0])
    assert encoded_in and loop not in encoded_in
    assert stored[0].message == large and stored[0].episode_seq is not None
    records = [record async for record in store.replay("t")]
    assert [record.episode for record in records] == [episode_for(large)]


async def test_many_small_messages_are_a_large_batch_too(store: Any, encoded_in: list[int]) -> None:
    loop = threading.get_ident()
    messages = [Message.user(f"message {n}") for n in range(_rows.PREPARE_ON_LOOP_MESSAGES + 1)]
    await store.append("t", messages, [3] * len(messages))
    assert len(encoded_in) == len(messages) and loop not in encoded_in
    assert [m.message for m in (await store.load("t")).messages] == messages


def test_heavy_batch_counts_text_parts_and_tool_call_arguments() -> None:
    limit = _rows.PREPARE_ON_LOOP_CHARS
    half = "y" * (limit // 2 + 1)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + half}}
    assert not _rows.heavy_batch([Message.user(half)])
    assert _rows.heavy_batch([Message.user(half), Message.user(half)])
    assert _rows.heavy_batch([Message.user([{"type": "text", "text": half}, image])])
    assert _rows.heavy_batch(
        [Message.assistant(None, tool_calls=[ToolCall(id="c", name="write", arguments=f'"{half}{half}"')])]
    )
    # Input the encoding refuses next is light here: the encoding reports it.
    assert not _rows.heavy_batch("not a list")
    assert not _rows.heavy_batch(["not a message", None])


async def test_a_memory_store_closed_while_a_large_batch_is_encoded_writes_nothing() -> None:
    encoding, closed = threading.Event(), threading.Event()
    row: Callable[..., Any] = _rows._row

    def slow(*args: Any) -> Any:
        encoding.set()
        closed.wait(5)
        return row(*args)

    store = MemoryStore()
    await store.append("t", [Message.user("kept")], [1])
    _rows._row = slow
    try:
        async with anyio.create_task_group() as tg:

            async def append() -> None:
                with pytest.raises(StoreClosedError):
                    await store.append("t", [big_result()], [30_000])

            tg.start_soon(append)
            await anyio.to_thread.run_sync(encoding.wait, 5)
            await store.aclose()
            closed.set()
    finally:
        _rows._row = row
    assert [m.message.text for m in store._contexts["t"].messages] == ["kept"]
