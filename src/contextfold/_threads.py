"""Holding a thread lock from async code, whichever event loop and OS thread the caller runs on."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

__all__ = ["holding"]


@asynccontextmanager
async def holding(lock: threading.Lock) -> AsyncIterator[None]:
    """Hold ``lock`` for the block: taken at once when free, else waited for in a worker thread.

    A thread lock rather than anyio's, which belongs to one event loop: a
    framework's synchronous calls run their own loops in other OS threads
    (LangChain's ``invoke``), and a waiter on one loop is never woken by a
    release made on another. The wait never blocks the caller's loop, and it is
    shielded: a cancelled waiter takes the lock and gives it back at once, so it
    is never left held.
    """
    if not lock.acquire(blocking=False):
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lock.acquire)
    try:
        yield
    finally:
        lock.release()
