"""Store benchmark: write costs, whether the hot-path reads stay flat as a thread grows, and a fold burst.

For each backend (memory, SQLite with ``synchronous="FULL"`` and with
``"NORMAL"``, PostgreSQL) and each thread size it builds one thread of that
many messages (batched appends) and as many episodes, then measures
single-message appends, ``record_and_append`` of one step (a message and its
episode, one transaction), a windowed ``load(max_tokens=2000)``, ``stats()``,
``pressure()`` and ``state()`` (the compactor's per-step check). The reads must
cost the same at 100,000 messages as at 1,000: the script prints the
largest/smallest size ratio of their medians, which should stay near 1.

Then, per backend, a burst: 50 threads compacting at once on one store handle
(each takes its lease, sleeps 0.5 s as a summarizer would, and folds). It
reports the errors (which must be 0) and the wall time against the sleep.

Run it with::

    .venv/bin/python benchmarks/bench_stores.py
    .venv/bin/python benchmarks/bench_stores.py --sizes 1000,10000 --backends memory,sqlite
    .venv/bin/python benchmarks/bench_stores.py --burst 50 --burst-sleep 0.5

PostgreSQL is reached through ``CONTEXTFOLD_TEST_POSTGRES_URL`` (default
``postgresql://postgres@127.0.0.1:5432/test``), in a schema of its own that is
dropped afterwards; when the server is unreachable that backend is skipped.
SQLite builds the episode log through a ``synchronous="NORMAL"`` handle, which
would otherwise measure the disk's fsync rate; ``sqlite`` measures the rest on
its default ``"FULL"`` handle, ``sqlite-normal`` on a ``"NORMAL"`` one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from contextfold import ContextfoldError, Message
from contextfold._episodes import Episode, RunCompletedEpisode, SummaryCheckpoint, UserMessageEpisode
from contextfold.messages import SUMMARY_METADATA_KEY
from contextfold.stores import MemoryStore, SQLiteStore

DEFAULT_SIZES = (1_000, 10_000, 100_000)
BACKENDS = ("memory", "sqlite", "sqlite-normal", "postgres")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
TOKENS_PER_MESSAGE = 20
WINDOW_TOKENS = 2_000
BUILD_BATCH = 1_000
RECORD_WORKERS = 8
SINGLE_APPENDS = 100
READ_REPEATS = 100
BURST_THREADS = 50
BURST_SLEEP = 0.5
BURST_MESSAGES = 8


@dataclass(frozen=True)
class Result:
    backend: str
    size: int
    build_per_s: float
    """Messages per second appended in batches of ``BUILD_BATCH``."""
    single_per_s: float
    """Messages per second appended one per call."""
    step_us: float
    """Median of ``record_and_append`` of one step: a message and its episode, one transaction."""
    record_per_s: float
    """Episodes per second recorded by concurrent callers on the one thread."""
    window_us: float
    stats_us: float
    pressure_us: float
    state_us: float


@dataclass(frozen=True)
class Burst:
    backend: str
    threads: int
    sleep: float
    wall: float
    errors: int
    """Calls that raised, and leases that were refused; must be 0."""
    first_error: str


def _message(n: int) -> Message:
    role = "user" if n % 2 == 0 else "assistant"
    return Message.model_validate(
        {"role": role, "content": f"message {n}: " + "the quick brown fox jumps over the lazy dog " * 2}
    )


def _episode(n: int) -> Episode:
    if n % 10 == 9:
        return RunCompletedEpisode(clean=True)
    return UserMessageEpisode(message=Message.user(f"user message {n}"))


async def _record_all(store: Any, thread: str, count: int, workers: int) -> float:
    """Record ``count`` episodes with ``workers`` concurrent callers; episodes per second."""
    next_n = 0

    async def worker() -> None:
        nonlocal next_n
        while next_n < count:
            n, next_n = next_n, next_n + 1
            await store.record(thread, _episode(n))

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(workers):
            tg.start_soon(worker)
    return count / (time.perf_counter() - start)


async def _build(backend: str, size: int, store: Any, record_store: Any) -> tuple[float, float, float, float]:
    """Fill one thread with ``size`` messages and episodes; the write throughputs and the step's cost."""
    thread = f"thread-{size}"
    start = time.perf_counter()
    for offset in range(0, size, BUILD_BATCH):
        batch = [_message(n) for n in range(offset, min(size, offset + BUILD_BATCH))]
        await store.append(thread, batch, [TOKENS_PER_MESSAGE] * len(batch))
    build_per_s = size / (time.perf_counter() - start)

    record_per_s = await _record_all(record_store, thread, size, 1 if backend == "memory" else RECORD_WORKERS)

    single = _message(size)
    start = time.perf_counter()
    for _ in range(SINGLE_APPENDS):
        await store.append(thread, [single], [TOKENS_PER_MESSAGE])
    single_per_s = SINGLE_APPENDS / (time.perf_counter() - start)

    steps = []
    for n in range(SINGLE_APPENDS):
        message = Message.user(f"step {n}: " + "the quick brown fox jumps over the lazy dog " * 2)
        start = time.perf_counter()
        await store.record_and_append(
            thread,
            [UserMessageEpisode(message=message)],
            [message],
            [TOKENS_PER_MESSAGE],
            message_episodes=[0],
        )
        steps.append(time.perf_counter() - start)
    step_us = statistics.median(steps) * 1e6

    window = await store.load(thread, max_tokens=WINDOW_TOKENS)
    expected = WINDOW_TOKENS // TOKENS_PER_MESSAGE
    if len(window.messages) != expected or window.complete:
        raise AssertionError(f"{backend}: window of {len(window.messages)} messages, expected {expected}")
    stats = await store.stats(thread)
    if stats.message_count != size + 2 * SINGLE_APPENDS:
        raise AssertionError(
            f"{backend}: {stats.message_count} messages, expected {size + 2 * SINGLE_APPENDS}"
        )
    pressure = await store.pressure(thread)
    if pressure.total_user_messages != size - size // 10 + SINGLE_APPENDS:
        raise AssertionError(f"{backend}: pressure counted {pressure.total_user_messages} user messages")
    return build_per_s, single_per_s, step_us, record_per_s


async def _bench(backend: str, sizes: list[int], store: Any, record_store: Any) -> list[Result]:
    writes = {}
    for size in sizes:
        writes[size] = await _build(backend, size, store, record_store)
        print(f"{backend}: built {size:,} messages and episodes", file=sys.stderr, flush=True)
    calls: dict[str, Callable[[str], Awaitable[object]]] = {
        "window": lambda thread: store.load(thread, max_tokens=WINDOW_TOKENS),
        "stats": store.stats,
        "pressure": store.pressure,
        "state": store.state,
    }
    samples: dict[tuple[str, int], list[float]] = {(name, size): [] for name in calls for size in sizes}
    for call in calls.values():
        for size in sizes:
            await call(f"thread-{size}")  # warm caches and prepared statements
    # Sizes take turns within every round, and the first turn rotates, so neither a
    # busy machine nor the position in the round favours one size.
    for round_ in range(READ_REPEATS):
        turn = round_ % len(sizes)
        for name, call in calls.items():
            for size in sizes[turn:] + sizes[:turn]:
                start = time.perf_counter()
                await call(f"thread-{size}")
                samples[name, size].append(time.perf_counter() - start)

    def median_us(name: str, size: int) -> float:
        return statistics.median(samples[name, size]) * 1e6

    return [
        Result(
            backend,
            size,
            *writes[size],
            window_us=median_us("window", size),
            stats_us=median_us("stats", size),
            pressure_us=median_us("pressure", size),
            state_us=median_us("state", size),
        )
        for size in sizes
    ]


@asynccontextmanager
async def _stores(
    backend: str, postgres_url: str, *, defaults: bool = False
) -> AsyncIterator[tuple[Any, Any]]:
    """A fresh, empty store for one run, and the handle episodes are recorded through.

    With ``defaults``, the store has its default options (the burst measures those).
    """
    if backend == "memory":
        async with MemoryStore() as memory:
            yield memory, memory
    elif backend.startswith("sqlite"):
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL" if backend == "sqlite-normal" else "FULL"
        with tempfile.TemporaryDirectory(prefix="contextfold-bench-") as folder:
            path = Path(folder) / "bench.db"
            async with (
                SQLiteStore(path, synchronous=synchronous) as store,
                SQLiteStore(path, synchronous="NORMAL") as fast,
            ):
                yield store, fast
    else:
        import psycopg
        from psycopg import sql

        from contextfold.stores import PostgresStore

        schema = f"cf_bench_{uuid.uuid4().hex[:10]}"
        options = {} if defaults else {"max_size": RECORD_WORKERS}
        try:
            async with PostgresStore(postgres_url, schema=schema, **options) as store:
                yield store, store
        finally:
            async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
                await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


async def _burst(backend: str, store: Any, threads: int, sleep: float) -> Burst:
    """``threads`` threads compacting at once: lease, ``sleep`` as the summarizer, fold."""
    names = [f"burst-{n}" for n in range(threads)]
    for name in names:
        messages = [_message(n) for n in range(BURST_MESSAGES)]
        await store.record_and_append(
            name,
            [UserMessageEpisode(message=m) for m in messages],
            messages,
            [TOKENS_PER_MESSAGE] * len(messages),
            message_episodes=range(len(messages)),
        )
    errors: list[str] = []

    async def compact(name: str) -> None:
        try:
            async with store.compaction_lock(name) as mine:
                if not mine:
                    errors.append(f"{name}: lease refused")
                    return
                window = await store.load(name)
                cut = window.messages[: len(window.messages) // 2]
                await anyio.sleep(sleep)
                await store.fold(
                    name,
                    checkpoint=SummaryCheckpoint(
                        trigger="bench", from_seq=cut[0].seq, through_seq=cut[-1].seq, summary="so far"
                    ),
                    through_seq=cut[-1].seq,
                    expected_version=window.version,
                    replacement=[Message.system("so far", metadata={SUMMARY_METADATA_KEY: True})],
                    tokens=[2],
                )
        except ContextfoldError as exc:
            errors.append(f"{name}: {exc}")

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(compact, name)
    wall = time.perf_counter() - start
    for name in names:
        if (await store.stats(name)).version != 1:
            errors.append(f"{name}: the fold was not applied")
    return Burst(backend, threads, sleep, wall, len(errors), errors[0] if errors else "")


def _table(results: list[Result]) -> str:
    header = (
        f"{'backend':<13} {'messages':>9} {'append batched/s':>17} {'append single/s':>16} {'step µs':>8} "
        f"{'record/s':>9} {'window µs':>10} {'stats µs':>9} {'pressure µs':>12} {'state µs':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.backend:<13} {r.size:>9,} {r.build_per_s:>17,.0f} {r.single_per_s:>16,.0f} "
            f"{r.step_us:>8.0f} {r.record_per_s:>9,.0f} {r.window_us:>10.1f} {r.stats_us:>9.1f} "
            f"{r.pressure_us:>12.1f} {r.state_us:>9.1f}"
        )
    return "\n".join(lines)


def _ratios(results: list[Result]) -> str:
    lines = []
    for backend in dict.fromkeys(r.backend for r in results):
        runs = sorted((r for r in results if r.backend == backend), key=lambda r: r.size)
        if len(runs) < 2:
            continue
        small, large = runs[0], runs[-1]
        lines.append(
            f"{backend:<13} {large.size:,}/{small.size:,} ratio: "
            f"window {large.window_us / small.window_us:.2f}  "
            f"stats {large.stats_us / small.stats_us:.2f}  "
            f"pressure {large.pressure_us / small.pressure_us:.2f}  "
            f"state {large.state_us / small.state_us:.2f}"
        )
    return "\n".join(lines)


def _bursts(bursts: list[Burst]) -> str:
    lines = []
    for b in bursts:
        line = (
            f"{b.backend:<13} burst of {b.threads} folds ({b.sleep:g} s summarizer each): errors {b.errors}, "
            f"wall {b.wall:.2f} s = {b.wall / b.sleep:.2f}x the summarizer's own time"
        )
        lines.append(line + (f"; first error: {b.first_error}" if b.errors else ""))
    return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        default=",".join(str(size) for size in DEFAULT_SIZES),
        help="comma-separated messages per thread (default: %(default)s)",
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated subset of %(default)s"
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("CONTEXTFOLD_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL),
        help="PostgreSQL DSN (default: $CONTEXTFOLD_TEST_POSTGRES_URL or %(default)s)",
    )
    parser.add_argument(
        "--burst", type=int, default=BURST_THREADS, help="threads folding at once (%(default)s)"
    )
    parser.add_argument(
        "--burst-sleep", type=float, default=BURST_SLEEP, help="each fold's summarizer sleep, s (%(default)s)"
    )
    args = parser.parse_args(argv)
    if args.burst < 1 or not args.burst_sleep > 0:
        parser.error("--burst must be at least 1 and --burst-sleep above 0")
    try:
        args.sizes = sorted({int(size) for size in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes must be comma-separated whole numbers, got {args.sizes!r}")
    if any(size < WINDOW_TOKENS // TOKENS_PER_MESSAGE + 1 for size in args.sizes):
        parser.error(f"every size must exceed the {WINDOW_TOKENS // TOKENS_PER_MESSAGE} messages of a window")
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    return args


async def _run(args: argparse.Namespace) -> tuple[list[Result], list[Burst]]:
    results: list[Result] = []
    bursts: list[Burst] = []
    for backend in args.backends:
        try:
            async with _stores(backend, args.postgres_url) as (store, record_store):
                results += await _bench(backend, args.sizes, store, record_store)
            async with _stores(backend, args.postgres_url, defaults=True) as (store, _):
                bursts.append(await _burst(backend, store, args.burst, args.burst_sleep))
        except (ContextfoldError, OSError) as exc:
            print(f"{backend}: skipped ({exc})", file=sys.stderr)
    return results, bursts


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its tables; 0 on success, 1 if a fold of the burst failed."""
    args = _parse(argv)
    results, bursts = anyio.run(_run, args)
    print(_table(results))
    ratios = _ratios(results)
    if ratios:
        print()
        print(ratios)
    print()
    print(_bursts(bursts))
    return 1 if any(b.errors for b in bursts) else 0


if __name__ == "__main__":
    sys.exit(main())
