"""SQLiteStore per-step cost: medians of ``state()`` and of ``record_and_append`` of one message.

An agent step on SQLite reads ``state(thread)`` (the compactor's check) and
then records the new message with its episode in one transaction. This script
times each of the two calls on their own, ``--calls`` times per
``synchronous`` setting, on a thread that already holds a few hundred
messages, and prints the median, the 90th percentile and the mean in
microseconds.

Run it with::

    .venv/bin/python benchmarks/bench_sqlite_step.py
    .venv/bin/python benchmarks/bench_sqlite_step.py --calls 5000 --synchronous NORMAL --backend trio
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal, cast

import anyio

from contextfold import Message
from contextfold._episodes import episode_for
from contextfold.stores import SQLiteStore

WARMUP = 50
PREFILL = 500


def summary(name: str, samples: list[float]) -> str:
    micro = sorted(sample * 1e6 for sample in samples)
    p90 = micro[int(len(micro) * 0.9)]
    return (
        f"  {name:<20} median {statistics.median(micro):8.1f} us   p90 {p90:8.1f} us   "
        f"mean {statistics.fmean(micro):8.1f} us"
    )


async def timed(calls: int, call: Callable[[int], Awaitable[object]]) -> list[float]:
    for n in range(WARMUP):
        await call(n)
    samples = []
    clock = time.perf_counter
    for n in range(calls):
        start = clock()
        await call(n)
        samples.append(clock() - start)
    return samples


async def bench(path: Path, synchronous: Literal["NORMAL", "FULL"], calls: int) -> None:
    messages = [Message.user(f"message {n} " + "word " * 20) for n in range(calls + WARMUP)]
    episodes = [episode_for(message) for message in messages]
    async with SQLiteStore(path, synchronous=synchronous) as store:
        await store.append("t", [Message.user(f"old {n}") for n in range(PREFILL)], [20] * PREFILL)

        async def state(n: int) -> object:
            return await store.state("t")

        async def step(n: int) -> object:
            return await store.record_and_append(
                "t", [episodes[n]], [messages[n]], [20], message_episodes=[0]
            )

        reads = await timed(calls, state)
        writes = await timed(calls, step)
    print(f"synchronous={synchronous}, {calls} calls each")
    print(summary("state()", reads))
    print(summary("record_and_append", writes))


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as directory:
        for n, synchronous in enumerate(args.synchronous.split(",")):
            mode = cast(Literal["NORMAL", "FULL"], synchronous.strip().upper())
            await bench(Path(directory) / f"step{n}.db", mode, args.calls)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--synchronous", default="NORMAL,FULL")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    arguments = parser.parse_args()
    anyio.run(main, arguments, backend=arguments.backend)
