"""CompactingSession's pop_item and clear_session: one write to both memories, under the thread's lock."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from contextfold import StoreError, conversation
from contextfold.episodes import MessagesRetractedEpisode, SummaryCheckpoint
from contextfold.stores import ContextWindow, MemoryStore, SQLiteStore, ThreadStats

from .scenario import _execute, agreeing, compactor, meddle, question, record_text, refusing_withdrawals

pytest.importorskip("agents")

from agents import SQLiteSession

from contextfold.integrations.openai_agents import CompactingSession, to_items

CALL: Any = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"n": 1}'}
"""With the assistant item before it, one message: popping it leaves that item, recorded again."""


def turns(count: int) -> list[Any]:
    """``count`` exchanges as items, each a question and an answer long enough for a fold to take."""
    items: list[Any] = []
    for n in range(count):
        items += [{"role": "user", "content": question(n)}, {"role": "assistant", "content": record_text(n)}]
    return items


async def both(store: Any) -> tuple[Any, ...]:
    """All the session holds in both memories."""
    return (await store.load("s"), [r async for r in store.replay("s")])


async def replayed(store: Any) -> list[Any]:
    """The session's items as a replay of the log gives them."""
    return to_items(conversation([r async for r in store.replay("s")]))


async def sdk_after(items: list[Any], pops: int) -> tuple[list[Any], list[Any]]:
    """What the SDK's own SQLiteSession pops, and holds after, given ``items`` and then ``pops`` pops."""
    sdk = SQLiteSession("s")
    try:
        await sdk.add_items(items)
        popped = [await sdk.pop_item() for _ in range(pops)]
        return popped, await sdk.get_items()
    finally:
        sdk.close()


@contextmanager
def refusing(path: Path, trigger: str) -> Iterator[None]:
    """For the block, the SQLite file at ``path`` runs ``trigger`` (one named ``refuse``) on its writes."""
    _execute(path, f"CREATE TRIGGER refuse {trigger} BEGIN SELECT RAISE(ABORT, 'injected failure'); END")
    try:
        yield
    finally:
        _execute(path, "DROP TRIGGER refuse")


async def test_a_pop_whose_log_write_fails_leaves_both_memories_as_they_were(tmp_path: Path) -> None:
    """The log refusing the item that stays, recorded again, leaves the working context unpopped too.

    Before, the retraction was already recorded: a replay lost the whole assistant message, and the
    session still held it.
    """
    path = tmp_path / "s.db"
    given = [{"role": "user", "content": question(1)}, {"role": "assistant", "content": "Let me look."}, CALL]
    async with SQLiteStore(path) as store:
        session = CompactingSession("s", compactor(store))
        await session.add_items(given)
        before = await both(store)
        with refusing(path, "BEFORE INSERT ON episodes WHEN NEW.kind = 'llm_call'"):
            with pytest.raises(StoreError, match="injected failure"):
                await session.pop_item()
        assert await both(store) == before
        assert await session.get_items() == given
        assert await session.pop_item() == CALL
        popped, held = await sdk_after(given, 1)
        assert popped == [CALL]
        assert await session.get_items() == held == await replayed(store) == given[:-1]


async def test_a_clear_whose_context_write_fails_leaves_both_memories_as_they_were(tmp_path: Path) -> None:
    """The working context refusing the clear leaves the log without it too; a clear made again clears both.

    Before, the log recorded the clear first: a replay gave an empty session that still held its items.
    """
    path = tmp_path / "s.db"
    given = turns(2)
    async with SQLiteStore(path) as store:
        session = CompactingSession("s", compactor(store))
        await session.add_items(given)
        before = await both(store)
        with refusing(path, "BEFORE DELETE ON messages"), pytest.raises(StoreError, match="injected failure"):
            await session.clear_session()
        assert await both(store) == before
        with refusing_withdrawals(path), pytest.raises(StoreError, match="injected failure"):
            await session.clear_session()
        assert await both(store) == before
        await session.clear_session()
        assert await session.get_items() == [] == await replayed(store)
        records = [r async for r in store.replay("s")]
        assert records[:-1] == before[1] and records[-1].episode.kind == "history_cleared"


class MeddlingStore(MemoryStore):
    """The memory store, running ``meanwhile`` once after a read of a context, before its reader goes on.

    An edit reads the context (``load``; ``stats``, as ``clear_session`` did), then writes what stays
    of it: the worst moment for another writer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: Callable[[], Awaitable[None]] | None = None

    async def load(self, thread: str, *, max_tokens: int | None = None) -> ContextWindow:
        window = await super().load(thread, max_tokens=max_tokens)
        await self._meddle()
        return window

    async def stats(self, thread: str) -> ThreadStats:
        stats = await super().stats(thread)
        await self._meddle()
        return stats

    async def _meddle(self) -> None:
        meanwhile, self.meanwhile = self.meanwhile, None
        if meanwhile is not None:
            await meanwhile()


def adding(
    store: MeddlingStore, session: CompactingSession, items: list[Any], group: TaskGroup
) -> anyio.Event:
    """Make ``store`` start ``session.add_items(items)`` in ``group`` at its next read of a context."""
    return meddle(store, partial(session.add_items, items), group)


ONE_TWO: list[Any] = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
THREE: list[Any] = [{"role": "user", "content": "three"}]


async def test_an_item_added_while_pop_item_runs_lands_after_it() -> None:
    """add_items started once pop_item loaded the session lands after the pop, in both memories.

    Before, it landed between the load and the write: the log's retraction took the added item, not
    the popped one, and a replay gave back the popped item the session had lost.
    """
    async with MeddlingStore() as store:
        session = CompactingSession("s", compactor(store))
        await session.add_items(ONE_TWO)
        async with anyio.create_task_group() as group:
            added = adding(store, session, THREE, group)
            assert await session.pop_item() == ONE_TWO[-1]
        assert added.is_set()
        popped, held = await sdk_after(ONE_TWO, 1)
        assert popped == [ONE_TWO[-1]]
        assert await session.get_items() == [*held, *THREE] == await replayed(store) == [ONE_TWO[0], *THREE]
        assert await agreeing(store, "s") == ["one", "three"]


async def test_an_item_added_while_clear_session_runs_lands_after_it() -> None:
    """add_items started once clear_session read the session lands after the clear, in both memories.

    Before, it landed between the read and the log's clear: the log cleared it, and the session kept it.
    """
    async with MeddlingStore() as store:
        session = CompactingSession("s", compactor(store))
        await session.add_items(ONE_TWO)
        async with anyio.create_task_group() as group:
            added = adding(store, session, THREE, group)
            await session.clear_session()
        assert added.is_set()
        assert await session.get_items() == THREE == await replayed(store)
        assert await agreeing(store, "s") == ["three"]


async def test_a_fold_between_the_load_and_the_write_is_popped_from_again() -> None:
    """Another worker folding the session after pop_item loaded it: the pop is planned again, not raised.

    The newest item still goes, the summary stays, and the log records the retraction once, after the
    fold. Before, the pop raised ConflictError, its retraction already recorded.
    """
    given = [
        *turns(6),
        {"role": "user", "content": question(6)},
        {"role": "assistant", "content": "Let me look."},
        CALL,
    ]
    async with MeddlingStore() as store:
        session = CompactingSession("s", compactor(store))
        await session.add_items(given)
        other = compactor(store)

        async def fold() -> None:
            assert await other.compact_now("s") is not None

        store.meanwhile = fold
        assert await session.pop_item() == CALL
        assert store.meanwhile is None
        records = [r.episode async for r in store.replay("s")]
        stays = (await store.load("s")).messages[-1]
        assert stays.message.text == "Let me look." and stays.episode_seq == len(records)  # recorded again
        assert [episode.kind for episode in records][-3:] == [
            "summary_checkpoint",
            "messages_retracted",
            "llm_call",
        ]
        assert sum(isinstance(episode, SummaryCheckpoint) for episode in records) == 1
        assert sum(isinstance(episode, MessagesRetractedEpisode) for episode in records) == 1
        popped, held = await sdk_after(given, 1)
        assert popped == [CALL]
        assert await replayed(store) == held == given[:-1]
        items = await session.get_items()
        assert "Codes seen:" in str(items[0].get("content"))
        assert items[1:] == given[-len(items) : -1]
