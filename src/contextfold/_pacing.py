"""``Pacer``: how a store's cheap calls share the event loop with other tasks."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

try:
    from sniffio import current_async_library
except ModuleNotFoundError:  # pragma: no cover - trio requires sniffio: without it the loop is asyncio's

    def current_async_library() -> str:
        return "asyncio"


__all__ = [
    "CROWDED_PACE_SECONDS",
    "PACE_SECONDS",
    "Pacer",
    "current_async_library",
    "others_can_run",
    "wake",
    "yield_behind_due_timers",
]

PACE_SECONDS = 0.0002
"""The longest run of paced calls before they hand the event loop to other tasks, when none waits.

About two steps of an agent's work: a lone agent's loop of steps pays for a
round of the event loop once in a few steps. A yield that gave the loop away
for this long or longer means other tasks are taking turns: the pacer then
goes by ``CROWDED_PACE_SECONDS``.
"""

CROWDED_PACE_SECONDS = 0.00005
"""The slice while other tasks are taking turns: a yield at the first paced call after it.

With every agent busy, the event loop's lag is one round of their slices, so
the slice is what the lag is made of. In ``benchmarks/bench_agents.py`` 50
agents on ``PACE_SECONDS`` slices (one step and a part of the next, about
0.3 ms) kept a ticker waiting 18-26 ms; on these slices, with a step's count
and its write a turn each (see ``Pacer.turn``), about 10-15 ms. Not zero: a
burst of tiny calls (a replay, a ``sync`` of many messages) still makes
several of them per turn.
"""


class Pacer:
    """Makes every call a cancellation point, and a scheduling point at least once per ``PACE_SECONDS``.

    A call that yields to the scheduler costs a round of the event loop
    (several microseconds in a tight loop, 25-40 µs between a session's
    tokenizer calls, more than a memory write itself); one that only looks
    for a cancellation costs about one. So a loop that only records and
    checks stops at once when cancelled, and lets other tasks (a background
    summary, a heartbeat) run at least every 0.2 ms, without paying a
    loop round on every call. On asyncio a call that is due first looks
    whether anything else could run (``others_can_run``): a lone task whose
    round would run nothing but itself goes on without it. While other
    tasks are taking turns (the last yield gave the loop away for
    ``PACE_SECONDS`` or more) the slice is ``CROWDED_PACE_SECONDS``, and
    ``turn`` adds a scheduling point where a caller's own work would make a
    long slice.
    """

    __slots__ = ("_crowded", "_due")

    def __init__(self) -> None:
        self._due = 0.0
        self._crowded = False

    async def __call__(self) -> None:
        now = time.monotonic()
        if now < self._due:
            await checkpoint_if_cancelled()
            return
        if not self._crowded and not others_can_run():
            self._due = now + PACE_SECONDS  # looked again a slice from now, not on every call
            await checkpoint_if_cancelled()
            return
        # While other tasks take turns (the last yield gave the loop away for a slice or
        # more), a task whose timer came due goes first; alone, the plain yield is cheaper.
        if self._crowded:
            await yield_behind_due_timers()
        else:
            await checkpoint()
        resumed = time.monotonic()
        crowded = self._crowded = resumed - now >= PACE_SECONDS
        self._due = resumed + (CROWDED_PACE_SECONDS if crowded else PACE_SECONDS)

    async def turn(self) -> None:
        """A paced call while other tasks are taking turns; alone, nothing at all (not even a clock read).

        For a point between two paced calls where the caller's own work
        begins: ``Compactor.append`` takes one before it counts a step, so in
        a crowded loop the count and the write (with the check before it) are
        a turn each, not one long slice, and a lone agent's step pays nothing.
        """
        if self._crowded:
            await self()


def others_can_run() -> bool:
    """Whether a round of the event loop could run anything but the caller; ``True`` when it cannot tell.

    On asyncio's selector loops (the default loop on Linux and macOS, and
    anyio's), a round runs the callbacks already queued (another task's
    step, a worker thread's result, a cancellation), the timers that came
    due (a ``sleep`` that ended) and the handlers of sockets and pipes that
    are ready. The first two are the loop's own queues; for the third the
    loop's selector is asked without waiting, which reports a ready file
    again at the loop's next round (it is level-triggered, and ``select``
    changes nothing). The queues are attributes of CPython's
    ``BaseEventLoop`` and the selector one of ``BaseSelectorEventLoop``, the
    same since Python 3.7; a loop without them (uvloop, Windows' proactor
    loop) and trio are answered ``True``, and the caller yields as it would
    without this look.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio, or no loop at all
        return True
    ready = getattr(loop, "_ready", None)
    scheduled = getattr(loop, "_scheduled", None)
    selector = getattr(loop, "_selector", None)
    if type(ready) is not deque or type(scheduled) is not list or selector is None:
        return True
    if ready:
        return True
    if scheduled and scheduled[0].when() <= loop.time():
        return True
    return bool(selector.select(0))


async def yield_behind_due_timers() -> None:
    """A scheduling point that lets the tasks whose timers are already due run first.

    On asyncio a plain yield (``checkpoint()``) goes to the back of the ready
    queue, ahead of every timer that came due meanwhile: with many agents that
    never wait, a task whose ``sleep`` ended waited for two rounds of all of
    them (35-60 ms with 50 agents in ``benchmarks/bench_agents.py``). Resumed
    by a timer due now instead, the caller queues in due order with the other
    timers, so a task due earlier waits one round at most. It takes two
    rounds of the loop where a plain yield takes one (5-10 µs more in a
    session's loop, whose code the tokenizer keeps pushing out of the CPU's
    caches), so ``Pacer`` uses it only while other tasks are taking turns.
    trio runs a woken task in its next batch of all runnable tasks: there it
    is ``checkpoint()``.
    """
    if current_async_library() != "asyncio":
        await checkpoint()
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    loop.call_at(loop.time(), wake, waiter)
    await waiter


def wake(waiter: asyncio.Future[None]) -> None:
    """Resolve ``waiter`` unless it is done already (its awaiting task was cancelled meanwhile)."""
    if not waiter.done():
        waiter.set_result(None)
