"""Sharing the interpreter fairly while a summarizer's CPU work runs in a worker thread."""

from __future__ import annotations

import time

__all__ = ["Breather"]

_SLICE_SECONDS = 0.002


class Breather:
    """Call it often from a worker thread's loop; every 2 ms it lets the event loop's thread run.

    A thread busy with Python code gives up the GIL only every
    ``sys.getswitchinterval()`` (5 ms) when asked, and the event loop asks
    after each wake-up, so ticks slip by 10-50 ms under load. Releasing the GIL
    of our own accord every 2 ms lets the loop in as soon as it is waiting.
    """

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = time.perf_counter() + _SLICE_SECONDS

    def __call__(self) -> None:
        now = time.perf_counter()
        if now >= self._next:
            time.sleep(0)  # releases the GIL, so a thread waiting for it gets it now
            self._next = time.perf_counter() + _SLICE_SECONDS
