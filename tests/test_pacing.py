"""How the stores' cheap calls share the loop: always a cancellation point, a yield once per interval."""

from __future__ import annotations

import asyncio
import gc
import itertools
import socket
import threading
import time

import anyio
import pytest
from anyio.lowlevel import checkpoint

from contextfold import Compactor, Message, _pacing
from contextfold._pacing import CROWDED_PACE_SECONDS, PACE_SECONDS, Pacer, others_can_run
from contextfold.stores import MemoryStore
from contextfold.tokens import ApproximateCounter


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


async def _neighbour(clock: Clock, ran: list[float]) -> None:
    """Another task that takes a millisecond every time it runs: the loop is crowded."""
    while True:
        ran.append(clock.now)
        clock.now += 0.001
        await checkpoint()


async def test_while_other_tasks_take_turns_a_pacer_yields_after_a_short_slice(clock: Clock) -> None:
    """Once a yield gave the loop away for a slice or more, the next comes after CROWDED_PACE_SECONDS.

    A round of 50 busy agents is 50 of their slices: on ``PACE_SECONDS``
    slices a ticker beside them waited 18-26 ms (``bench_agents.py``).
    """
    assert CROWDED_PACE_SECONDS < PACE_SECONDS / 2
    pace = Pacer()
    ran: list[float] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_neighbour, clock, ran)
        await pace()  # the neighbour's millisecond passes meanwhile: the loop is crowded
        assert len(ran) == 1
        clock.now += CROWDED_PACE_SECONDS / 2
        await pace()
        assert len(ran) == 1, "a call within the short slice kept the loop"
        clock.now += CROWDED_PACE_SECONDS
        await pace()
        assert len(ran) > 1, "a crowded slice lasted longer than CROWDED_PACE_SECONDS"
        # A yield that returns at once (nobody else ran) ends the crowding: the long slice again.
        tg.cancel_scope.cancel()
    clock.now += PACE_SECONDS
    await pace()
    clock.now += 2 * CROWDED_PACE_SECONDS
    ran.clear()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_neighbour, clock, ran)
        await pace()
        assert ran == [], "alone, the slice is PACE_SECONDS again"
        tg.cancel_scope.cancel()


async def test_a_turn_is_nothing_alone_and_a_paced_call_while_the_loop_is_crowded(clock: Clock) -> None:
    """``turn`` neither yields nor reads the clock alone, and yields once the crowded slice is spent."""
    pace = Pacer()
    ran: list[float] = []
    reads = 0

    def counted() -> float:
        nonlocal reads
        reads += 1
        return clock.now

    async with anyio.create_task_group() as tg:
        tg.start_soon(_neighbour, clock, ran)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_pacing.time, "monotonic", counted)
            await pace.turn()
        assert (ran, reads) == ([], 0), "a lone task's turn did something"
        await pace()  # the neighbour runs: the loop is crowded
        assert len(ran) == 1
        clock.now += CROWDED_PACE_SECONDS
        await pace.turn()
        assert len(ran) > 1, "a turn in a crowded loop kept the loop past its slice"
        tg.cancel_scope.cancel()


async def test_in_a_crowded_loop_a_step_takes_a_turn_before_it_is_counted(clock: Clock) -> None:
    """``Compactor.append`` yields before counting, so the count and the write are a turn each.

    Before, a step's only scheduling point was its write: the check, the
    context, the count and the write of the step before all went in one slice.
    """
    ran: list[float] = []
    counted_after: list[int] = []  # how many turns the neighbour had when each count began

    class SlowCounter(ApproximateCounter):
        def _measure(self, message: Message) -> int:
            counted_after.append(len(ran))
            clock.now += 0.0001  # a tokenizer's 100 µs
            return super()._measure(message)

    async with MemoryStore() as store, anyio.create_task_group() as tg:
        compactor = Compactor(store, counter=SlowCounter())
        tg.start_soon(_neighbour, clock, ran)
        await compactor.append("t", [Message.user("one")])  # its write yields: the neighbour runs
        assert counted_after == [0] and len(ran) == 1
        clock.now += CROWDED_PACE_SECONDS  # the next step's check and context
        await compactor.append("t", [Message.user("two")])
        tg.cancel_scope.cancel()
        assert [m.text for m in await compactor.context("t")] == ["one", "two"]
    assert counted_after[1] > 1, "the step was counted before the other task had its turn"


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


class _Yields:
    """Counts the pacer's scheduling points (either kind of yield), each still made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        plain, behind = _pacing.checkpoint, _pacing.yield_behind_due_timers

        async def counted_plain() -> None:
            self.count += 1
            await plain()

        async def counted_behind() -> None:
            self.count += 1
            await behind()

        monkeypatch.setattr(_pacing, "checkpoint", counted_plain)
        monkeypatch.setattr(_pacing, "yield_behind_due_timers", counted_behind)


async def test_alone_on_asyncio_a_due_paced_call_skips_the_round_that_would_run_nothing_else(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """A lone task's due call only looks for a cancellation: a round of the loop would run only it.

    A round costs 25-40 µs between a session's tokenizer calls; alone, a
    SQLite session yielded at every paced call (5,227 times in 5,000 steps).
    On trio, which has no look at what else could run, it yields as before.
    """
    yields = _Yields(monkeypatch)
    pace = Pacer()
    for _ in range(5):
        await pace()
        pace._due = 0.0  # due again at once
    assert yields.count == (0 if anyio_backend == "asyncio" else 5)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pace()
        pytest.fail("the paced call did not see the cancellation")
    assert scope.cancelled_caught


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("waiting", ["callback", "timer", "socket", "thread"])
async def test_a_due_paced_call_yields_to_whatever_else_could_run(
    waiting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another task, a timer that came due, a ready socket, a worker thread's result: each gets its round.

    (A plain yield resumes the caller in that round ahead of the timers and
    sockets the round finds ready; they run right after it.)
    """
    yields = _Yields(monkeypatch)
    loop = asyncio.get_running_loop()
    ran: list[object] = []
    ours, theirs = socket.socketpair()
    try:
        if waiting == "callback":
            loop.call_soon(ran.append, waiting)
        elif waiting == "timer":
            loop.call_at(loop.time() - 0.001, ran.append, waiting)
        elif waiting == "socket":
            loop.add_reader(ours.fileno(), lambda: ran.append(ours.recv(16)))
            theirs.send(b"socket")
        else:
            worker = threading.Thread(target=loop.call_soon_threadsafe, args=(ran.append, waiting))
            worker.start()
            worker.join()
        await Pacer()()
        assert yields.count == 1, f"a paced call due with a {waiting} waiting kept the loop"
        await anyio.sleep(0)
        assert ran == [b"socket" if waiting == "socket" else waiting]
    finally:
        loop.remove_reader(ours.fileno())
        ours.close()
        theirs.close()


def test_others_can_run_outside_an_event_loop_answers_that_it_cannot_tell() -> None:
    """Without a running asyncio loop (trio, or none), the caller yields as it would without the look."""
    assert others_can_run() is True
