"""The ``contextfold`` command: ``demo``, ``inspect`` and ``compact``.

Every error is one clear line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._compactor import Compactor
from ._config import RunOptions, SummarizeOptions
from ._demo import DemoStats, run_session
from ._episodes import (
    EpisodeRecord,
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    ToolCallEpisode,
    conversation,
)
from ._errors import ContextfoldError
from ._loop import StepLoop
from ._tokens import TiktokenCounter
from .stores import SQLiteStore
from .summarizers import AnthropicSummarizer, ExtractiveSummarizer, OpenAICompatibleSummarizer, Summarizer

__all__ = ["main"]

T = TypeVar("T")

_SUMMARIZERS = ("extractive", "openai", "anthropic")


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine, turning contextfold's errors into one line and exit status 1."""
    try:
        return anyio.run(fn)
    except ContextfoldError as exc:
        raise click.ClickException(str(exc)) from None


def _summarizer(kind: str, model: str | None, base_url: str | None, api_key: str | None) -> Summarizer:
    if kind == "extractive":
        return ExtractiveSummarizer()
    if model is None:
        raise click.UsageError(f"--summarizer {kind} needs --model, for example --model gpt-4o-mini")
    try:
        if kind == "openai":
            return OpenAICompatibleSummarizer(
                model, base_url=base_url or "https://api.openai.com/v1", api_key=api_key
            )
        return AnthropicSummarizer(model, base_url=base_url or "https://api.anthropic.com", api_key=api_key)
    except ContextfoldError as exc:
        raise click.ClickException(str(exc)) from None


_budget = click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=12000,
    show_default=True,
    help="Compact when the working context is above this many tokens.",
)


def _options(budget: int) -> RunOptions:
    """The CLI's compaction settings for a token budget."""
    return RunOptions(
        max_history_tokens=budget * 2,
        compaction=SummarizeOptions(trigger_token_budget=budget, max_summary_tokens=min(800, budget // 4)),
    )


@click.group()
@click.version_option(package_name="contextfold")
def main() -> None:
    """Keep long-running LLM agents inside their context window without losing anything."""


@main.command()
@click.option(
    "--db",
    "db",
    type=click.Path(dir_okay=False, path_type=Path),
    default="contextfold-demo.db",
    show_default=True,
    help="SQLite file the demo writes to.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=300, show_default=True, help="LLM requests to simulate."
)
@_budget
@click.option("--seed", type=int, default=7, show_default=True, help="Seed of the simulated session.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw request tokens per step to this PNG (needs contextfold[plot]).",
)
@click.option("--summarizer", type=click.Choice(_SUMMARIZERS), default="extractive", show_default=True)
@click.option("--model", default=None, help="Summarizer model, for --summarizer openai/anthropic.")
@click.option("--base-url", default=None, help="Provider endpoint, e.g. http://127.0.0.1:11434/v1.")
@click.option("--api-key", default=None, help="Provider key (default: OPENAI_API_KEY / ANTHROPIC_API_KEY).")
def demo(
    db: Path,
    steps: int,
    budget: int,
    seed: int,
    plot: Path | None,
    summarizer: str,
    model: str | None,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Run a simulated tool-using agent session on SQLite with compaction on."""
    if plot is not None:
        _require_matplotlib()
    chosen = _summarizer(summarizer, model, base_url, api_key)
    console = Console()
    thread = f"demo-{int(time.time())}"
    options = _options(budget)

    async def session() -> DemoStats:
        counter = TiktokenCounter()
        async with AsyncExitStack() as stack:
            close = getattr(chosen, "aclose", None)
            if close is not None:  # the HTTP summarizers own a connection pool
                stack.push_async_callback(close)
            store = await stack.enter_async_context(SQLiteStore(db))
            compactor = Compactor(store, options=options, summarizer=chosen, counter=counter)
            loop = StepLoop(compactor)
            with Progress(
                TextColumn("[bold]simulating"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            ) as progress:
                task = progress.add_task("steps", total=steps)
                return await run_session(
                    loop,
                    thread,
                    steps=steps,
                    counter=counter,
                    seed=seed,
                    on_step=lambda done: progress.update(task, completed=done),
                )

    stats = _run(session)
    console.print(_summary_table(stats, thread, db))
    if plot is not None:
        _plot(stats, plot, budget)
        console.print(f"plot written to {plot}")


def _summary_table(stats: DemoStats, thread: str, db: Path) -> Table:
    table = Table(title=f"contextfold demo: thread {thread} in {db}")
    table.add_column("measure")
    table.add_column("with compaction", justify="right")
    table.add_column("without", justify="right")
    folds = [c for c in stats.compactions if not c.stalled]
    table.add_row("requests", str(stats.requests), str(stats.requests))
    table.add_row("compactions", str(len(folds)), "0")
    table.add_row(
        "peak request tokens", f"{max(stats.request_tokens):,}", f"{max(stats.uncompacted_tokens):,}"
    )
    table.add_row(
        "mean request tokens",
        f"{statistics.fmean(stats.request_tokens):,.0f}",
        f"{statistics.fmean(stats.uncompacted_tokens):,.0f}",
    )
    table.add_row(
        "total request tokens", f"{sum(stats.request_tokens):,}", f"{sum(stats.uncompacted_tokens):,}"
    )
    table.add_row("summarizer tokens", f"{stats.summarizer_tokens:,}", "0")
    table.add_row("messages folded", f"{sum(c.dropped_messages for c in folds):,}", "0")
    return table


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'contextfold[plot]'") from None


def _plot(stats: DemoStats, path: Path, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    steps = range(1, stats.requests + 1)
    axes.plot(steps, stats.uncompacted_tokens, label="without compaction", color="#c44e52")
    axes.plot(steps, stats.request_tokens, label="with contextfold", color="#4c72b0")
    axes.axhline(budget, linestyle="--", color="grey", linewidth=1, label=f"trigger budget ({budget:,})")
    axes.set_xlabel("step")
    axes.set_ylabel("request tokens")
    axes.set_title("Request tokens per step")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _existing_db(db: Path) -> Path:
    if not db.is_file():
        raise click.ClickException(f"no database at {db}: pass the SQLite file a run wrote")
    return db


async def _require_thread(store: Any, thread: str) -> None:
    stats = await store.stats(thread)
    if stats.message_count == 0 and await store.latest_checkpoint(thread) is None:
        async for _ in store.replay(thread):
            return
        raise click.ClickException(f"no thread {thread!r} in the database")


def _episode_detail(record: EpisodeRecord) -> str:
    """One line on what an episode holds."""
    episode = record.episode
    if isinstance(episode, SummaryCheckpoint):
        return (
            f"{episode.trigger}: seq {episode.from_seq}..{episode.through_seq}, "
            f"{episode.dropped_messages} messages, {episode.tokens_before}->{episode.tokens_after} tokens"
            + (" (degraded)" if episode.degraded else "")
        )
    if isinstance(episode, ToolCallEpisode):
        return f"{episode.call.name}({episode.call.arguments})"[:100]
    if isinstance(episode, ManualRecoveryBoundary):
        return f"{episode.reason} through seq {episode.through_seq}"
    if isinstance(episode, RunCompletedEpisode):
        return "clean" if episode.clean else "unclean"
    messages = conversation([record])
    if not messages:
        return ""
    message = messages[0]
    text = message.text or ", ".join(f"{c.name}({c.arguments})" for c in message.tool_calls)
    return text.replace("\n", " ")[:100]


@main.command()
@click.argument("db", type=click.Path(path_type=Path))
@click.argument("thread")
@click.option("--replay/--no-replay", default=True, show_default=True, help="Also replay the episodic log.")
def inspect(db: Path, thread: str, replay: bool) -> None:
    """Print a thread's working context and replay its episodic log."""
    _existing_db(db)
    console = Console()

    async def show() -> None:
        async with SQLiteStore(db) as store:
            await _require_thread(store, thread)
            window = await store.load(thread)
            table = Table(title=f"working context of {thread!r}: {window.total_tokens:,} tokens")
            for column in ("seq", "role", "tokens", "content"):
                table.add_column(column)
            for stored in window.messages:
                message = stored.message
                text = message.text.replace("\n", " ")
                if message.tool_calls:
                    text += " " + ", ".join(f"{c.name}({c.arguments})" for c in message.tool_calls)
                marker = " (summary)" if message.is_summary else ""
                table.add_row(str(stored.seq), message.role.value + marker, str(stored.tokens), text[:120])
            console.print(table)
            if not replay:
                return
            records = [record async for record in store.replay(thread)]
            log = Table(title=f"episodic log of {thread!r}: {len(records)} episodes")
            for column in ("seq", "at", "kind", "detail"):
                log.add_column(column)
            for record in records:
                log.add_row(
                    str(record.seq),
                    record.at.strftime("%Y-%m-%d %H:%M:%S"),
                    record.episode.kind,
                    _episode_detail(record),
                )
            console.print(log)

    _run(show)


@main.command()
@click.argument("db", type=click.Path(path_type=Path))
@click.argument("thread")
@click.option(
    "--manual-recovery",
    is_flag=True,
    help="Write an operator's clean-slate boundary: fold every turn into the summary.",
)
@_budget
def compact(db: Path, thread: str, manual_recovery: bool, budget: int) -> None:
    """Compact a thread now, whatever its triggers say."""
    _existing_db(db)
    console = Console()

    async def fold() -> None:
        async with SQLiteStore(db) as store:
            await _require_thread(store, thread)
            options = _options(budget)
            compactor = Compactor(store, options=options)
            if manual_recovery:
                result = await compactor.manual_recovery(thread)
            else:
                result = await compactor.compact_now(thread)
            if result is None:
                raise click.ClickException(
                    f"thread {thread!r} is being compacted by another worker; try again"
                )
            if result.stalled:
                console.print(f"nothing to fold in {thread!r}: {result.detail}")
                return
            console.print(
                f"compacted {thread!r} ({result.reason}): {result.dropped_messages} messages folded, "
                f"{result.tokens_before:,} -> {result.tokens_after:,} tokens"
            )

    _run(fold)
