"""Many agents on one store: throughput, hook latency and event-loop lag while folds run.

``--agents`` agents (50) share one store per backend (memory, SQLite, PostgreSQL),
each stepping its own thread ``--steps`` times (200): the hook, the context the
request would send, the append of the session's next message (tool results of
200-4,000 characters). The budget is small enough that every thread folds
several times during the run. A ticker task sleeps 5 ms at a time and records
how late it wakes: that is the event-loop lag every other coroutine sees.
The longest garbage-collector pass during the run is printed beside it, since
a full collection stops the loop as surely as blocking code does.

Two loads: saturated (agents never wait, the loop is never idle: throughput,
and a lag that is one round of every agent's step) and paced (each step
awaits a ``--model-ms`` model call, 100 ms by default, so the loop has room
and the lag is what blocking work costs everyone else).

Printed per backend and load, each run in a process of its own (so no run
carries the modules or heap of the runs before it), with the default
collector and after ``gc.freeze()``: steps/s, hook p50/p99, the no-op hook's
p99 (the checks where no trigger fired), loop-lag p99 and max, the longest
collection, and the folds that ran.

Run it:  python benchmarks/bench_agents.py [--agents 50] [--steps 200] [--model-ms 100]
         [--backends memory,sqlite,postgres]
PostgreSQL comes from ``--postgres-url`` or ``CONTEXTFOLD_TEST_POSTGRES_URL``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from contextfold import Compactor, Message, RunOptions, SummarizeOptions
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.testing import agent_session
from contextfold.tokens import TiktokenCounter

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
TICK = 0.005

OPTIONS = RunOptions(
    max_history_tokens=32_000,
    compaction=SummarizeOptions(trigger_token_budget=8_000, min_recent_messages=8, max_summary_tokens=300),
)


async def instant(messages: Sequence[Message], previous: str | None, max_tokens: int) -> str:
    return "Summary: the agent fixed retry logic in several modules; all tests pass."


@dataclass
class Measured:
    hooks: list[float] = field(default_factory=list)
    noop_hooks: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    folds: int = 0
    steps: int = 0
    seconds: float = 0.0
    gc_pauses: list[float] = field(default_factory=list)


class GcTimer:
    """Collects the duration of every garbage-collector pass while installed."""

    def __init__(self, out: list[float]) -> None:
        self.out = out
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.out.append(time.perf_counter() - self.started)

    def __enter__(self) -> None:
        gc.callbacks.append(self)

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self)


def percentile(samples: Sequence[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@asynccontextmanager
async def open_backend(name: str, folder: Path, postgres_url: str) -> AsyncIterator[Any]:
    if name == "memory":
        async with MemoryStore() as store:
            yield store
    elif name == "sqlite":
        async with SQLiteStore(folder / "agents.db", synchronous="NORMAL") as store:
            yield store
    else:
        import psycopg

        from contextfold.stores import PostgresStore

        schema = f"bench_{uuid.uuid4().hex[:10]}"
        try:
            async with PostgresStore(postgres_url, schema=schema) as store:
                yield store
        finally:
            async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def agent(
    compactor: Compactor, thread: str, messages: Sequence[str], out: Measured, model_seconds: float
) -> None:
    """Step through the session; each message arrives as JSON, as it does from a model's API."""
    clock = time.perf_counter
    for body in messages:
        message = Message.model_validate_json(body)
        started = clock()
        result = await compactor.maybe_compact(thread)
        took = clock() - started
        out.hooks.append(took)
        if result is None or not result.compacted:
            out.noop_hooks.append(took)
        else:
            out.folds += 1
        await compactor.context(thread)
        if model_seconds:
            await anyio.sleep(model_seconds)  # the model call the context is sent to
        await compactor.append(thread, [message])
        out.steps += 1


async def ticker(out: Measured, stop: anyio.Event) -> None:
    clock = time.perf_counter
    while not stop.is_set():
        started = clock()
        await anyio.sleep(TICK)
        out.lags.append(max(0.0, clock() - started - TICK))


async def run_backend(
    backend: str,
    agents: int,
    steps: int,
    folder: Path,
    postgres_url: str,
    *,
    freeze: bool = False,
    model_seconds: float = 0.0,
) -> Measured:
    out = Measured()
    counter = TiktokenCounter()
    # Held as JSON until each step: 10,000 message objects held up front would be walked by
    # every full garbage collection (60-70 ms here), a cost of the harness, not of the store.
    sessions = [[m.model_dump_json() for m in agent_session(steps, seed=n)] for n in range(agents)]
    counter.count(Message.user("load the encoding before anything is timed"))
    async with open_backend(backend, folder, postgres_url) as store:
        compactor = Compactor(store, options=OPTIONS, summarizer=FunctionSummarizer(instant), counter=counter)
        if freeze:
            # What a latency-minded service does once started: the ~57k objects of the imported
            # modules move to the permanent generation, so full collections no longer walk them.
            gc.collect()
            gc.freeze()
        with GcTimer(out.gc_pauses):
            await run_agents(compactor, sessions, out, model_seconds)
    return out


async def run_agents(
    compactor: Compactor, sessions: list[list[str]], out: Measured, model_seconds: float
) -> None:
    """Every agent on its own thread at once, with the lag ticker beside them."""
    stop = anyio.Event()
    started = time.perf_counter()
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker, out, stop)
        async with anyio.create_task_group() as group:
            for n, messages in enumerate(sessions):
                group.start_soon(agent, compactor, f"agent-{n}", messages, out, model_seconds)
        out.seconds = time.perf_counter() - started
        stop.set()


COLUMNS = ("steps/s", "hook p50 ms", "hook p99 ms", "no-op p99 ms", "lag p99 ms", "lag max ms", "gc max ms")


def summary(m: Measured) -> dict[str, float]:
    """One run's row: throughput, hook latencies, loop lag and the longest collection (ms)."""
    return {
        "steps/s": m.steps / m.seconds,
        "hook p50 ms": statistics.median(m.hooks) * 1e3,
        "hook p99 ms": percentile(m.hooks, 0.99) * 1e3,
        "no-op p99 ms": percentile(m.noop_hooks, 0.99) * 1e3,
        "lag p99 ms": percentile(m.lags, 0.99) * 1e3,
        "lag max ms": max(m.lags, default=0.0) * 1e3,
        "gc max ms": max(m.gc_pauses, default=0.0) * 1e3,
        "folds": m.folds,
    }


def one_run(args: argparse.Namespace) -> int:
    """In a child process: one backend, one load, printed as one JSON line."""
    backend, load, freeze = args.one.split(":")
    with tempfile.TemporaryDirectory() as folder:
        try:
            m = anyio.run(
                partial(
                    run_backend,
                    backend,
                    args.agents,
                    args.steps,
                    Path(folder),
                    args.postgres_url,
                    freeze=freeze == "freeze",
                    model_seconds=args.model_ms / 1e3 if load == "paced" else 0.0,
                )
            )
        except OSError as exc:
            print(f"{backend:<8} skipped: {exc}", file=sys.stderr)
            return 3
    print(json.dumps(summary(m)))
    return 0


def main_runs(args: argparse.Namespace) -> int:
    """Every backend, load and collector setting, each in a process of its own, printed as a table.

    A process of its own: a run would otherwise carry the modules and the heap
    the runs before it left (psycopg's for the SQLite run after PostgreSQL's),
    and every full collection in it would walk them.
    """
    print(f"{args.agents} agents x {args.steps} steps on one store, 8k-token trigger, instant summarizer")
    print("each run in a fresh process; +freeze: gc.freeze() after start-up, so full collections skip")
    print("the imported modules' objects")
    print(f"paced: each step awaits a {args.model_ms:g} ms model call; saturated: no wait at all")
    heading = " ".join(f"{name:>{max(8, len(name))}}" for name in COLUMNS)
    print(f"{'backend':<25} {heading} {'folds':>6}")
    loads = ["saturated"] + (["paced"] if args.model_ms else [])
    for load, freeze, backend in itertools.product(loads, ("", "freeze"), args.backends.split(",")):
        child = [
            sys.executable,
            __file__,
            "--one",
            f"{backend}:{load}:{freeze}",
            "--agents",
            str(args.agents),
            "--steps",
            str(args.steps),
            "--model-ms",
            str(args.model_ms),
            "--postgres-url",
            args.postgres_url,
        ]
        done = subprocess.run(child, capture_output=True, text=True, check=False)
        if done.returncode == 3:
            print(done.stderr.strip(), file=sys.stderr)
            continue
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        row = json.loads(done.stdout.splitlines()[-1])
        label = f"{backend}{' +freeze' if freeze else ''} {load}"
        cells = [f"{row[name]:>{max(8, len(name))}.{0 if name == 'steps/s' else 2}f}" for name in COLUMNS]
        print(f"{label:<25} " + " ".join(cells) + f" {row['folds']:6d}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backends", default="memory,sqlite,postgres")
    parser.add_argument(
        "--model-ms", type=float, default=100.0, help="the paced load's model call per step; 0 skips it"
    )
    parser.add_argument(
        "--postgres-url", default=os.environ.get("CONTEXTFOLD_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # backend:load:freeze, in a child process
    args = parser.parse_args(argv)
    return one_run(args) if args.one else main_runs(args)


if __name__ == "__main__":
    sys.exit(main())
