"""Per-step cost of ``maybe_compact`` when no trigger fires, and of a whole compacting session.

1. ``maybe_compact`` on threads of 100 ... 100,000 messages, on the memory and
   SQLite stores, with a budget no history reaches: the per-step check must
   cost the same at every size (the 100k/100 ratio is printed).
2. Side by side on the same histories, LangChain's
   ``SummarizationMiddleware.before_model`` with a model that must never be
   invoked (it re-counts the whole history on every call); our speed-up is
   printed per size. Needs the ``bench`` extra: ``pip install 'contextfold[bench]'``.
3. The whole session: one thread growing to 5,000 realistic messages (tool
   results of 200-4,000 characters), one step per message (the hook, the
   context the request sends, the append) at a 32k-token budget with an
   instant summarizer, on memory, SQLite (``synchronous`` FULL and NORMAL) and
   PostgreSQL, against the floor of tokenizing each message once with
   tiktoken. contextfold counts with ``rs-bpe`` when the ``fast`` extra is
   installed (``TiktokenCounter``'s default); the rows marked "tiktoken
   counting" run memory and SQLite NORMAL with ``fast=False``. Beside them
   LangChain's ``SummarizationMiddleware`` with its state in memory, and in
   a LangGraph graph with the SQLite and PostgreSQL checkpointers as the
   persistent peers. Every row takes ``--session-repeat``
   turns with the others (3); each run is set against the floors measured
   right before and after it, the row shows the run with the median ratio,
   and the range of the runs' ratios is printed beside it.

Run it:  python benchmarks/bench_step.py [--sizes 100,1000,10000,100000] [--session 5000]
PostgreSQL comes from ``--postgres-url`` or ``CONTEXTFOLD_TEST_POSTGRES_URL``; ``none`` skips it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import anyio

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.testing import agent_session
from contextfold.tokens import TiktokenCounter

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"

NEVER = RunOptions(max_history_tokens=10**12, compaction=SummarizeOptions(trigger_token_budget=10**12))


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


async def amedian_time(
    fn: Callable[[], Awaitable[Any]], *, repeat: int, before: Callable[[], object] | None = None
) -> float:
    """The median of ``repeat`` timed calls, each after ``before`` (untimed)."""
    samples = []
    for _ in range(repeat):
        if before is not None:
            before()
        started = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def our_check(store: Any, messages: Sequence[Message], repeat: int) -> tuple[float, float]:
    """The no-op check reading the store, and right after a read (a step's write, a check) it reuses."""
    counter = TiktokenCounter()
    tokens = [counter.count(m) for m in messages]
    for start in range(0, len(messages), 5_000):
        await store.append("bench", messages[start : start + 5_000], tokens[start : start + 5_000])
    compactor = Compactor(store, options=NEVER, counter=counter)

    async def check() -> None:
        assert await compactor.maybe_compact("bench") is None

    await check()
    reused = await amedian_time(check, repeat=repeat)  # each within 10 ms of the last one's read

    def forget() -> None:  # as if no read of the thread stood: more than 10 ms ago, or a write since
        compactor._forget_seen("bench")

    return await amedian_time(check, repeat=repeat, before=forget), reused


def langchain_check(messages: Sequence[Message], repeat: int) -> float | None:
    try:
        from langchain.agents.middleware import SummarizationMiddleware
        from langchain_core.language_models import BaseChatModel
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

    converted = to_langchain(messages)
    middleware = SummarizationMiddleware(model=NeverInvoked(), trigger=("tokens", 10**12))
    state = {"messages": converted}

    def check() -> None:
        assert middleware.before_model(state, None) is None  # type: ignore[arg-type]

    check()
    return median_time(check, repeat=repeat)


BUDGET = RunOptions(
    max_history_tokens=128_000,
    compaction=SummarizeOptions(trigger_token_budget=32_000, min_recent_messages=8, max_summary_tokens=400),
)
"""The whole-session runs' 32k-token budget."""

SUMMARY = "Summary: the agent fixed retry logic across several modules; all tests pass."


async def instant(messages: Sequence[Message], previous: str | None, max_tokens: int) -> str:
    """A summarizer that costs nothing, so the rows measure contextfold's own work."""
    return SUMMARY


@dataclass(frozen=True)
class SessionRow:
    """One run of the whole session: where its time went."""

    run: str
    hook: float
    append: float
    context: float
    folds: int
    floor: float = 0.0
    """The tokenize-once floor of this run's own minutes (see :func:`floored`)."""
    spread: tuple[float, float] = (0.0, 0.0)
    """The lowest and highest ratio of the runs a row stands for (see :func:`median_of`)."""

    @property
    def total(self) -> float:
        return self.hook + self.append + self.context

    @property
    def ratio(self) -> float:
        return self.total / self.floor


def tokenize_once_floor(messages: Sequence[Message]) -> float:
    """Seconds to tokenize each message's text exactly once with tiktoken: the floor of any counting.

    The collector is off meanwhile: a collection would walk whatever heap the
    runs around it left, which is not the floor's cost.
    """
    encode = TiktokenCounter().encoding.encode_ordinary
    texts = [m.text + "".join(c.arguments for c in m.tool_calls) for m in messages]
    collecting = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        for text in texts:
            encode(text)
        return time.perf_counter() - started
    finally:
        if collecting:
            gc.enable()


def floored(row: SessionRow, before: float, messages: Sequence[Message]) -> SessionRow:
    """``row`` against the mean of the floor measured ``before`` it and the floor measured now.

    On a shared machine the same loop's speed drifts by half within a minute,
    more than the differences between runs; each run is set against the floor
    of its own minutes, measured while nothing of the run is still working
    (call this once its store is closed).
    """
    return replace(row, floor=(before + tokenize_once_floor(messages)) / 2)


def median_of(runs: Sequence[SessionRow]) -> SessionRow:
    """The run whose ratio to the floors right before and after it is the median of the runs'.

    Each run is set against its own minutes' floor (see :func:`floored`), and
    the middle one stands for the row: one slow or fast minute of a shared
    machine moves a single run's ratio by a third, the median far less. Not
    the fastest run against the fastest floor: a floor takes a third of a
    second and a run seconds, so the least floor catches a quiet moment no
    run lasts through. The lowest and highest ratio stay in ``spread``.
    """
    ranked = sorted(runs, key=lambda row: row.ratio)
    middle = ranked[len(ranked) // 2]  # of an even number, the higher of the two middle ones
    return replace(middle, spread=(ranked[0].ratio, ranked[-1].ratio))


@asynccontextmanager
async def open_backend(name: str, folder: Path, postgres_url: str | None) -> AsyncIterator[Any]:
    """An open store of the named backend, its data thrown away afterwards."""
    if name == "memory":
        async with MemoryStore() as store:
            yield store
    elif name.startswith("sqlite"):
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL" if name.endswith("NORMAL") else "FULL"
        async with SQLiteStore(folder / f"{name}.db", synchronous=synchronous) as store:
            yield store
    else:
        from contextfold.stores import PostgresStore

        assert postgres_url is not None
        schema = f"bench_{uuid.uuid4().hex[:10]}"
        try:
            async with PostgresStore(postgres_url, schema=schema) as store:
                yield store
        finally:
            await drop_schema(postgres_url, schema)


async def drop_schema(url: str, schema: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def contextfold_session(
    store: Any, run: str, messages: Sequence[Message], *, fast: bool = True
) -> SessionRow:
    """One step per message: the hook, the context the request would send, then the append.

    ``fast``: the counter's own (``TiktokenCounter(fast=...)``); ``False`` counts with tiktoken alone.
    """
    counter = TiktokenCounter(fast=fast)
    await counter.aload()  # loaded before anything is timed
    compactor = Compactor(store, options=BUDGET, summarizer=FunctionSummarizer(instant), counter=counter)
    clock = time.perf_counter
    hook = append = context = 0.0
    folds = 0
    for message in messages:
        started = clock()
        result = await compactor.maybe_compact("session")
        checked = clock()
        await compactor.context("session")
        loaded = clock()
        await compactor.append("session", [message])
        appended = clock()
        hook += checked - started
        context += loaded - checked
        append += appended - loaded
        folds += result is not None and result.compacted
    return SessionRow(run, hook, append, context, folds)


def to_langchain(messages: Sequence[Message]) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

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
    return converted


def langchain_middleware() -> Any:
    """LangChain's SummarizationMiddleware at the same 32k budget and kept tail, with a fixed summary."""
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    model = FakeListChatModel(responses=[SUMMARY])
    return SummarizationMiddleware(model=model, trigger=("tokens", 32_000), keep=("messages", 8))


def langchain_in_memory(messages: Sequence[Message]) -> SessionRow:
    """The middleware's before_model on a list held in memory: LangChain's cheapest possible step."""
    middleware = langchain_middleware()
    state: dict[str, Any] = {"messages": []}
    hook = append = 0.0
    folds = 0
    clock = time.perf_counter
    for message in to_langchain(messages):
        started = clock()
        update = middleware.before_model(state, None)
        checked = clock()
        if update is not None:
            state["messages"] = list(update["messages"][1:])  # after RemoveMessage(REMOVE_ALL_MESSAGES)
            folds += 1
        state["messages"].append(message)
        hook += checked - started
        append += clock() - checked
    return SessionRow("langchain, state in memory", hook, append, 0.0, folds)


def langgraph_session(run: str, checkpointer: Any, messages: Sequence[Message]) -> SessionRow:
    """One graph step per message (the middleware as the node), its state in ``checkpointer``."""
    from langchain_core.runnables import RunnableConfig
    from langgraph.graph import END, START, MessagesState, StateGraph

    middleware = langchain_middleware()
    folds = 0

    def summarize(state: MessagesState) -> dict[str, Any]:
        nonlocal folds
        update = middleware.before_model(state, None)
        folds += update is not None
        return update or {}

    graph = StateGraph(MessagesState)
    graph.add_node("summarize", summarize)
    graph.add_edge(START, "summarize")
    graph.add_edge("summarize", END)
    app = graph.compile(checkpointer=checkpointer)
    config: RunnableConfig = {"configurable": {"thread_id": "session"}}
    started = time.perf_counter()
    for message in to_langchain(messages):
        app.invoke({"messages": [message]}, config)  # loads the state, appends, runs the hook, saves
    return SessionRow(run, time.perf_counter() - started, 0.0, 0.0, folds)


def langgraph_runs(
    messages: Sequence[Message], folder: Path, postgres_url: str | None, repeat: int
) -> list[SessionRow]:
    """LangGraph's SQLite and PostgreSQL checkpointers as the persistent peers, ``repeat`` runs each."""
    rows: list[SessionRow] = []
    try:
        from langgraph.checkpoint.sqlite import SqliteSaver
    except ImportError:
        print("  (langgraph-checkpoint-sqlite missing: pip install 'contextfold[bench]')", file=sys.stderr)
    else:
        runs: list[SessionRow] = []
        for n in range(repeat):
            before = tokenize_once_floor(messages)
            with SqliteSaver.from_conn_string(str(folder / f"langgraph-{n}.db")) as saver:
                row = langgraph_session("langgraph, SqliteSaver", saver, messages)
            runs.append(floored(row, before, messages))
        rows.append(median_of(runs))
    if postgres_url is None:
        return rows
    try:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row
    except ImportError:
        print("  (langgraph-checkpoint-postgres missing: pip install 'contextfold[bench]')", file=sys.stderr)
        return rows
    runs = []
    for _ in range(repeat):
        schema = f"bench_lg_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            with psycopg.connect(
                postgres_url,
                autocommit=True,
                prepare_threshold=0,
                row_factory=dict_row,
                options=f"-c search_path={schema}",
            ) as conn:
                pg_saver = PostgresSaver(conn)
                pg_saver.setup()
                before = tokenize_once_floor(messages)
                row = langgraph_session("langgraph, PostgresSaver", pg_saver, messages)
                runs.append(floored(row, before, messages))
        finally:
            with psycopg.connect(postgres_url, autocommit=True) as admin:
                admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    rows.append(median_of(runs))
    return rows


async def contextfold_runs(
    messages: Sequence[Message], postgres_url: str | None, repeat: int = 1
) -> list[SessionRow]:
    """(a) One thread growing to ``len(messages)`` messages, one step each, on every backend.

    The backends take turns, ``repeat`` rounds of them, so a slow minute of the
    machine falls on each of them alike; each row is the median of its runs.
    """
    backends = ["memory", "sqlite FULL", "sqlite NORMAL"] + (["postgres"] if postgres_url else [])
    rows = [(f"contextfold {backend}", backend, True) for backend in backends]
    if TiktokenCounter().backend != "tiktoken":  # the same work, counted by tiktoken alone
        rows += [(f"contextfold {name}, tiktoken counting", name, False) for name in FAST_ALSO_WITHOUT]
    runs: dict[str, list[SessionRow]] = {label: [] for label, _, _ in rows}
    with tempfile.TemporaryDirectory() as folder:
        for n in range(repeat):
            round_folder = Path(folder) / f"round-{n}"
            round_folder.mkdir()
            for label, backend, fast in rows:
                before = tokenize_once_floor(messages)
                async with open_backend(backend, round_folder, postgres_url) as store:
                    row = await contextfold_session(store, label, messages, fast=fast)
                runs[label].append(floored(row, before, messages))  # the store closed first
    return [median_of(runs[label]) for label, _, _ in rows]


FAST_ALSO_WITHOUT = ("memory", "sqlite NORMAL")
"""The backends also run with ``TiktokenCounter(fast=False)`` when the fast counter is installed."""


def peer_runs(messages: Sequence[Message], postgres_url: str | None, repeat: int = 1) -> list[SessionRow]:
    """The same session through LangChain and LangGraph, on the main thread as ours ran (no event loop)."""
    try:
        with tempfile.TemporaryDirectory() as folder:
            runs = []
            for _ in range(repeat):
                before = tokenize_once_floor(messages)
                runs.append(floored(langchain_in_memory(messages), before, messages))
            return [median_of(runs), *langgraph_runs(messages, Path(folder), postgres_url, repeat)]
    except ImportError:
        print("  (LangChain missing: pip install 'contextfold[bench]' for its rows)", file=sys.stderr)
        return []


def print_session(rows: Sequence[SessionRow], count: int, repeat: int) -> None:
    """Each row the run with the median ratio to its own floor (see :func:`median_of`)."""
    floors = sorted(row.floor for row in rows)
    print(
        f"\nwhole session: {count:,} messages, one step each, 32k-token budget, instant summarizer; "
        f"{repeat} runs each, the rows taking turns; each run against the floor (tokenize each message "
        f"once with tiktoken) measured right before and after it, {floors[0] * 1e3:.0f}-"
        f"{floors[-1] * 1e3:.0f} ms; each row is the run with the median ratio, 'runs' the range of all "
        f"of them; contextfold counts with {TiktokenCounter().backend} unless the row says otherwise"
    )
    print(
        f"{'run':<40} {'x floor':>8} {'floor ms':>9} {'hook s':>8} {'append s':>9} "
        f"{'context s':>10} {'folds':>6} {'runs':>12}"
    )
    for row in rows:
        split = row.append or row.context
        low, high = row.spread
        print(
            f"{row.run:<40} {row.ratio:8.1f} {row.floor * 1e3:9.0f} {row.hook:8.2f} "
            + (f"{row.append:9.2f} {row.context:10.2f}" if split else f"{'(in hook)':>9} {'(in hook)':>10}")
            + f" {row.folds:6d} {f'{low:.1f}-{high:.1f}':>12}"
        )


async def main_async(
    sizes: Sequence[int], session: int, repeat: int, postgres_url: str | None, session_repeat: int = 1
) -> tuple[list[Message], list[SessionRow]]:
    """The check table, then contextfold's session runs: the session's messages and their rows."""
    print(f"maybe_compact with no trigger firing, reading the store (median of {repeat} calls)")
    print(
        f"{'messages':>9} {'memory µs':>11} {'sqlite µs':>11} {'langchain µs':>13} "
        f"{'vs memory':>10} {'vs sqlite':>10}"
    )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        async with SQLiteStore(Path(folder) / "warm-up.db") as warm_up:  # first-use costs, untimed
            await our_check(warm_up, history(10), 10)
        reused: dict[str, list[float]] = {"memory": [], "sqlite": []}
        for size in sizes:
            messages = history(size)
            async with MemoryStore() as memory:
                mem, mem_reused = await our_check(memory, messages, repeat)
            async with SQLiteStore(Path(folder) / f"bench-{size}.db") as sqlite:
                sql, sql_reused = await our_check(sqlite, messages, repeat)
            reused["memory"].append(mem_reused)
            reused["sqlite"].append(sql_reused)
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
    print(
        "within 10 ms of a read of the thread (the step's own write, a check) it reads nothing: "
        + ", ".join(
            f"{name} {min(times) * 1e6:.1f}-{max(times) * 1e6:.1f} µs" for name, times in reused.items()
        )
    )
    if session:
        # The last history (100,000 messages) would otherwise stay alive through the session
        # runs, and every full garbage collection in them would walk it.
        del messages
        gc.collect()
        steps = agent_session(session)
        return steps, await contextfold_runs(steps, postgres_url, session_repeat)
    return [], []


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000,10000,100000")
    parser.add_argument("--session", type=int, default=5_000, help="messages in the session run (0 skips)")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument(
        "--session-repeat", type=int, default=3, help="runs of each session row; each row is their median"
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("CONTEXTFOLD_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL),
        help="PostgreSQL for the session rows; 'none' skips them",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    postgres_url = None if args.postgres_url == "none" else args.postgres_url
    if args.session_repeat < 1:
        parser.error(f"--session-repeat must be at least 1, got {args.session_repeat}")
    steps, rows = anyio.run(main_async, sizes, args.session, args.repeat, postgres_url, args.session_repeat)
    if args.session:
        peers = peer_runs(steps, postgres_url, args.session_repeat)
        print_session([*rows, *peers], args.session, args.session_repeat)


if __name__ == "__main__":
    main()
