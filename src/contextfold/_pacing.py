"""``Pacer``: how a store's cheap calls share the event loop with other tasks."""

from __future__ import annotations

import time

from anyio.lowlevel import checkpoint, checkpoint_if_cancelled

__all__ = ["PACE_SECONDS", "Pacer"]

PACE_SECONDS = 0.0002
"""The longest run of paced calls before they hand the event loop to other tasks.

About two steps of an agent's work: a loop of steps pays for a round of the
event loop once in a few steps, while with 50 agents that never wait the
event loop's lag stays tens of milliseconds (a one-millisecond slice let it
reach 160 ms in ``benchmarks/bench_agents.py``).
"""


class Pacer:
    """Makes every call a cancellation point, and a scheduling point at least once per ``PACE_SECONDS``.

    A call that yields to the scheduler costs a round of the event loop
    (several microseconds, more than a memory write itself); one that only
    looks for a cancellation costs about one. So a loop that only records and
    checks stops at once when cancelled, and lets other tasks (a background
    summary, a heartbeat) run at least every 0.2 ms, without paying a
    loop round on every call.
    """

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due = 0.0

    async def __call__(self) -> None:
        if time.monotonic() < self._due:
            await checkpoint_if_cancelled()
            return
        await checkpoint()
        self._due = time.monotonic() + PACE_SECONDS
