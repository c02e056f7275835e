"""How the stores' cheap calls share the loop: always a cancellation point, a yield once per interval."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time

import anyio
import pytest

from contextfold import Message, _pacing
from contextfold._pacing import PACE_SECONDS, Pacer
from contextfold.stores import MemoryStore


class Clock:
    """A ``time.monotonic`` the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(_pacing.time, "monotonic", clock)
    return clock


async def test_a_pacer_yields_once_per_interval(clock: Clock) -> None:
    """The first call yields to a waiting task; calls within the interval do not; the first after it does."""
    pace = Pacer()
    ran: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_note, ran, 1)
        await pace()
        assert ran == [1]
        tg.start_soon(_note, ran, 2)
        clock.now += PACE_SECONDS / 2
        await pace()
        assert ran == [1], "a call within the interval kept the loop"
        clock.now += PACE_SECONDS
        await pace()
        assert ran == [1, 2]


async def _note(ran: list[int], n: int) -> None:
    ran.append(n)


async def test_a_pacer_call_that_does_not_yield_still_raises_a_cancellation(clock: Clock) -> None:
    """Within the interval a paced call is still a cancellation point."""
    pace = Pacer()
    await pace()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pace()
        pytest.fail("the paced call did not see the cancellation")
    assert scope.cancelled_caught


async def test_a_loop_of_memory_writes_lets_other_tasks_run() -> None:
    """A task that only appends to a MemoryStore still gives the loop to others, many times a second."""
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0)

    # A full collection of the test process's heap (50-60 ms on a slow machine) would stop
    # both tasks: the wait asserted is the store's, not the collector's.
    gc.disable()
    try:
        async with MemoryStore() as store, anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await anyio.sleep(0)
            started = time.monotonic()
            n = 0
            while time.monotonic() - started < 0.1:
                await store.append("t", [Message.user(f"m{n}")], [1])
                n += 1
            tg.cancel_scope.cancel()
    finally:
        gc.enable()
    assert n > 100
    assert len(ticks) >= 10, f"{len(ticks)} turns for the other task in 0.1 s of writes"
    longest = max(b - a for a, b in itertools.pairwise(ticks))
    assert longest < 0.05, f"the other task waited {longest * 1e3:.1f} ms"


async def test_a_task_whose_sleep_ended_waits_one_round_of_busy_paced_tasks_at_most() -> None:
    """Busy tasks that yield through their pacers let a due sleeper run before any of them runs twice.

    A plain yield on asyncio queues ahead of the timers that came due, and the
    sleeper's wake-up then queues behind the busy tasks once more: it waited
    for two rounds of all of them, and more (bench_agents' saturated lag).
    """
    busy = 20
    turns: list[float] = []  # when each busy turn began
    due: list[float] = []
    woke: list[float] = []

    async def work() -> None:
        pace = Pacer()
        while not woke:
            began = time.monotonic()
            turns.append(began)
            while time.monotonic() - began < 2 * PACE_SECONDS:  # every paced call yields
                pass
            await pace()

    async def sleeper() -> None:
        await anyio.sleep(0.001)  # the busy tasks are running
        due.append(time.monotonic() + 0.005)
        await anyio.sleep(0.005)
        woke.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        for _ in range(busy):
            tg.start_soon(work)
        tg.start_soon(sleeper)
    waited = [began for began in turns if due[0] <= began < woke[0]]
    assert len(waited) <= busy + 1, (
        f"the sleeper waited for {len(waited)} turns of {busy} busy tasks, more than one round"
    )


async def test_a_lone_task_yields_in_one_round_of_the_loop() -> None:
    """With no other task taking turns, a paced yield costs one round of the loop, as a plain yield does.

    Queueing behind due timers takes two rounds; it is for a crowded loop
    (the test above), not for a single agent's steps.
    """
    loop = asyncio.get_running_loop()
    rounds = 0

    def tick() -> None:
        nonlocal rounds, handle
        rounds += 1
        handle = loop.call_soon(tick)

    handle = loop.call_soon(tick)
    pace = Pacer()
    took: list[int] = []
    try:
        for _ in range(5):
            before = rounds
            await pace()
            took.append(rounds - before)
            await anyio.sleep(2 * PACE_SECONDS)  # the next call yields again
    finally:
        handle.cancel()
    # A yield the machine stalled for 0.2 ms reads as a crowded loop, and the next one
    # takes two rounds: one such stall is allowed for.
    assert took.count(1) >= 4, f"rounds of the loop per yield: {took}"
