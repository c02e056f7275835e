"""Per-step cost of ``maybe_compact`` when no trigger fires, and of a whole compacting session.

1. ``maybe_compact`` on threads of 100 ... 100,000 messages, on the memory and
   SQLite stores, with a budget no history reaches: the per-step check must
   cost the same at every size (the 100k/100 ratio is printed).
2. Side by side on the same histories, LangChain's
   ``SummarizationMiddleware.before_model`` with a model that must never be
   invoked (it re-counts the whole history on every call); our speed-up is
   printed per size. Needs the ``bench`` extra: ``pip install 'contextfold[bench]'``.
3. The total hook time of a session growing to 5,000 messages with compaction
   on, against the floor of tokenizing each of its messages exactly once.

Run it:  python benchmarks/bench_step.py [--sizes 100,1000,10000,100000] [--session 5000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from contextfold import (
    Compactor,
    Message,
    RunOptions,
    StepLoop,
    SummarizeOptions,
    TiktokenCounter,
    ToolCall,
)
from contextfold._demo import run_session
from contextfold.stores import MemoryStore, SQLiteStore

NEVER = RunOptions(
    max_history_tokens=100_000, compaction=SummarizeOptions(trigger_token_budget=10**12)
)


def history(size: int) -> list[Message]:
    """A tool-using conversation of exactly ``size`` messages."""
    messages: list[Message] = [Message.system("You are a coding agent.")]
    n = 0
    while len(messages) < size:
        call = ToolCall(id=f"c{n}", name="read_file", arguments=json.dumps({"path": f"src/m{n}.py"}))
        messages += [
            Message.user(f"Task {n}: look at src/m{n}.py and fix the bug with id BUG-{n}."),
            Message.assistant(None, tool_calls=[call]),
            Message.tool(f"c{n}", f"def f{n}(x):\n    return x + {n}  # BUG-{n}\n" * 8),
            Message.assistant(f"Fixed BUG-{n} in src/m{n}.py."),
        ]
        n += 1
    return messages[:size]


def median_time(fn: Callable[[], Any], *, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def amedian_time(fn: Callable[[], Awaitable[Any]], *, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def our_check(store: Any, messages: Sequence[Message], repeat: int) -> float:
    counter = TiktokenCounter()
    tokens = [counter.count(m) for m in messages]
    for start in range(0, len(messages), 5_000):
        await store.append("bench", messages[start : start + 5_000], tokens[start : start + 5_000])
    compactor = Compactor(store, options=NEVER, counter=counter)

    async def check() -> None:
        assert await compactor.maybe_compact("bench") is None

    await check()
    return await amedian_time(check, repeat=repeat)


def langchain_check(messages: Sequence[Message], repeat: int) -> float | None:
    try:
        from langchain.agents.middleware import SummarizationMiddleware
        from langchain_core.language_models import BaseChatModel
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
        from langchain_core.outputs import ChatResult
    except ImportError:
        return None

    class NeverInvoked(BaseChatModel):
        """A model the no-trigger path must never call."""

        @property
        def _llm_type(self) -> str:
            return "never-invoked"

        def _generate(self, *args: Any, **kwargs: Any) -> ChatResult:
            raise AssertionError("the summarization model was invoked")

    converted: list[Any] = []
    for m in messages:
        if m.role.value == "system":
            converted.append(SystemMessage(m.text))
        elif m.role.value == "user":
            converted.append(HumanMessage(m.text))
        elif m.role.value == "tool":
            converted.append(ToolMessage(m.text, tool_call_id=m.tool_call_id))
        else:
            calls = [{"id": c.id, "name": c.name, "args": c.parsed_arguments()} for c in m.tool_calls]
            converted.append(AIMessage(m.text, tool_calls=calls))
    middleware = SummarizationMiddleware(model=NeverInvoked(), trigger=("tokens", 10**12))
    state = {"messages": converted}

    def check() -> None:
        assert middleware.before_model(state, None) is None  # type: ignore[arg-type]

    check()
    return median_time(check, repeat=repeat)


async def session_cost(target_messages: int) -> tuple[float, float, float, int, int]:
    """Hook time of a compacting session versus tokenizing each of its messages once."""
    counter = TiktokenCounter()
    hook_time = 0.0
    options = RunOptions(
        max_history_tokens=24_000,
        compaction=SummarizeOptions(trigger_token_budget=12_000, max_summary_tokens=800),
    )
    summarizer_time = 0.0
    async with MemoryStore() as store:
        compactor = Compactor(store, options=options, counter=counter)
        original = compactor.maybe_compact
        summarize = compactor.summarizer.summarize

        async def timed_summarize(*args: Any, **kwargs: Any) -> Any:
            nonlocal summarizer_time
            started = time.perf_counter()
            try:
                return await summarize(*args, **kwargs)
            finally:
                summarizer_time += time.perf_counter() - started

        compactor.summarizer.summarize = timed_summarize  # type: ignore[method-assign]

        async def timed(thread: str, **kwargs: Any) -> Any:
            nonlocal hook_time
            started = time.perf_counter()
            try:
                return await original(thread, **kwargs)
            finally:
                hook_time += time.perf_counter() - started

        compactor.maybe_compact = timed  # type: ignore[method-assign]
        loop = StepLoop(compactor)
        steps = target_messages // 2
        stats = await run_session(loop, "session", steps=steps, counter=counter)
        messages = [r async for r in store.replay("session")]
    from contextfold import conversation

    originals = conversation(messages)
    encode = counter.encoding.encode_ordinary
    texts = [m.text + "".join(c.arguments for c in m.tool_calls) for m in originals]
    started = time.perf_counter()
    for text in texts:
        encode(text)
    floor = time.perf_counter() - started
    folds = len([c for c in stats.compactions if c.compacted])
    return hook_time, summarizer_time, floor, len(originals), folds


async def main_async(sizes: Sequence[int], session: int, repeat: int) -> None:
    print(f"maybe_compact with no trigger firing (median of {repeat} calls)")
    print(
        f"{'messages':>9} {'memory µs':>11} {'sqlite µs':>11} {'langchain µs':>13} "
        f"{'vs memory':>10} {'vs sqlite':>10}"
    )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        for size in sizes:
            messages = history(size)
            async with MemoryStore() as memory:
                mem = await our_check(memory, messages, repeat)
            async with SQLiteStore(Path(folder) / f"bench-{size}.db") as sqlite:
                sql = await our_check(sqlite, messages, repeat)
            lc = await anyio.to_thread.run_sync(langchain_check, messages, max(3, repeat // 20))
            first.setdefault("memory", mem)
            first.setdefault("sqlite", sql)
            last["memory"], last["sqlite"] = mem, sql
            if lc is None:
                shown = f"{'n/a':>13}  (pip install 'contextfold[bench]' for the comparison)"
            else:
                shown = f"{lc * 1e6:13.1f} {lc / mem:9.0f}x {lc / sql:9.0f}x"
            print(f"{size:9,d} {mem * 1e6:11.1f} {sql * 1e6:11.1f} {shown}")
    if len(sizes) > 1:
        print(
            f"ratio {sizes[-1]:,}/{sizes[0]:,} messages: memory {last['memory'] / first['memory']:.2f}, "
            f"sqlite {last['sqlite'] / first['sqlite']:.2f}"
        )
    if session:
        hook, summarizing, floor, count, folds = await session_cost(session)
        print(
            f"session of {count:,} messages, {folds} compactions: hook time {hook * 1e3:.0f} ms "
            f"(of which the extractive summarizer {summarizing * 1e3:.0f} ms), "
            f"tokenizing each message once {floor * 1e3:.0f} ms"
        )
        print(
            f"hook time / tokenize-once floor: {hook / floor:.2f} "
            f"(without the summarizer's own work: {(hook - summarizing) / floor:.2f})"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000,10000,100000")
    parser.add_argument("--session", type=int, default=5_000, help="messages in the session run (0 skips)")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    anyio.run(main_async, sizes, args.session, args.repeat)


if __name__ == "__main__":
    main()
