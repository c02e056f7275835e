"""The commands of ``contextfold``: ``demo``, ``threads``, ``inspect`` and ``compact``.

Every problem is one line on stderr and a non-zero exit status. Warnings the
library logs while a command runs are collected and printed once each at the
end, with how often they happened, instead of once per occurrence.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import sqlite3
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ._compactor import CompactionResult, Compactor
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
from ._errors import ConfigError, ContextfoldError, StoreError
from ._loop import StepLoop
from ._resource import AsyncResource
from ._secrets import url_passwords
from ._tokens import TiktokenCounter
from .cli import open_store, redact_url
from .stores import SQLiteStore
from .stores._base import Store, StoredMessage
from .summarizers import AnthropicSummarizer, ExtractiveSummarizer, OpenAICompatibleSummarizer, Summarizer

__all__ = ["app"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Provider:
    env_var: str
    example_model: str
    official_url: str


_PROVIDERS = {
    "openai": _Provider("OPENAI_API_KEY", "gpt-4o-mini", "https://api.openai.com/v1"),
    "anthropic": _Provider("ANTHROPIC_API_KEY", "claude-haiku-4-5", "https://api.anthropic.com"),
}
_OFFLINE = "extractive"
_LINE_CHARS = 160
_SHORTEST_SECRET = 3
"""Shorter passwords are not looked for in free text: masking them would garble it."""


class _Problems(logging.Handler):
    """Collects the library's warnings while a command runs, one entry per distinct problem."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, tuple[str, int]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().splitlines()[0]
        key = re.sub(r"\d+", "N", text)  # the same problem on another thread, seq or attempt
        first, count = self.seen.get(key, (text, 0))
        self.seen[key] = (first, count + 1)

    def lines(self, *, besides: str = "") -> list[str]:
        """One line per problem, leaving out any that ``besides`` already reported."""
        out = []
        for text, count in self.seen.values():
            if besides and besides in text:
                continue
            out.append(f"warning: {text}" + (f" ({count} times)" if count > 1 else ""))
        return out


@contextmanager
def _collect_problems() -> Iterator[_Problems]:
    # Without a handler of ours, logging's last-resort handler would print every warning
    # as it happens, beside the command's own report of the same problem.
    problems = _Problems()
    library = logging.getLogger("contextfold")
    propagate = library.propagate
    library.addHandler(problems)
    library.propagate = False
    try:
        yield problems
    finally:
        library.removeHandler(problems)
        library.propagate = propagate


def _echo_problems(problems: _Problems, *, besides: str = "", url: str | None = None) -> None:
    for line in problems.lines(besides=besides):
        click.echo(_hidden(line, url), err=True)


def _run(fn: Callable[[], Awaitable[T]], *, url: str | None = None, store_flag: str = "STORE") -> T:
    """Run a coroutine, turning contextfold's errors into one line and exit status 1.

    ``url`` is the store's: its password is masked wherever an error quotes it.
    ``store_flag`` is the argument that named it, which a hint then names.
    """
    try:
        return anyio.run(fn)
    except ContextfoldError as exc:
        raise click.ClickException(_hidden(_cli_words(str(exc), store_flag), url)) from None


def _hidden(text: str, url: str | None) -> str:
    """``text`` with the password of a store ``url`` masked, whoever wrote the text."""
    if url is None:
        return text
    text = text.replace(url, redact_url(url))
    for secret in sorted(_passwords(url), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _passwords(url: str) -> set[str]:
    """The passwords a store URL carries, as written and decoded, but those too short to look for."""
    return {secret for secret in url_passwords(url) if len(secret) >= _SHORTEST_SECRET}


def _cli_words(text: str, store_flag: str = "STORE") -> str:
    """A library message with its keyword arguments named as this command's flags.

    ``store_flag`` is the argument that named the store (``STORE``, or ``--db`` for demo).
    """
    for words, flag in (
        ("api_key=...", "--api-key"),
        ("base_url", "--base-url"),
        ("pass PostgresStore the DSN", f"pass {store_flag} the URL"),  # a server it cannot reach
    ):
        text = text.replace(words, flag)
    return text


def _store(url: str, *, create: bool = False, store_flag: str = "STORE") -> Store:
    """The store ``url`` names; ``store_flag`` is the argument that gave it, which an error names."""
    try:
        return open_store(url, create=create)
    except ConfigError as exc:
        if exc.key == "url" and not create and "://" not in url and url.strip():
            if not Path(url).is_file():
                raise click.ClickException(
                    f"no database at {url}: pass the SQLite file a run wrote"
                ) from None
            raise click.ClickException(f"{url} {exc.reason}") from None
        if exc.key in ("url", "dsn"):  # the library's keyword is this command's argument
            raise click.ClickException(_hidden(f"{store_flag} {url!r}: {exc.reason}", url)) from None
        raise click.ClickException(_hidden(str(exc), url)) from None
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None


class _FlagError(click.ClickException):
    """A flag's value, or a mix of flags, that the command cannot use: one line, exit status 2.

    Unlike click's ``UsageError`` it prints no usage block: the line names the
    flag and the fix. Click keeps its usage block for a command line it cannot
    parse (an unknown option, a missing argument).
    """

    exit_code = 2


def _summarizer(kind: str, model: str | None, base_url: str | None, api_key: str | None) -> Summarizer:
    """The summarizer the options name; every problem is named by its flag."""
    if kind == _OFFLINE:
        flags = (("--model", model), ("--base-url", base_url), ("--api-key", api_key))
        given = [flag for flag, value in flags if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise _FlagError(
                f"{', '.join(given)} {verb} only to --summarizer openai or anthropic; the offline "
                f"summarizer ({_OFFLINE}, the default) calls no model. Add --summarizer openai or "
                f"--summarizer anthropic, or drop {', '.join(given)}"
            )
        return ExtractiveSummarizer()
    provider = _PROVIDERS[kind]
    if model is None:
        raise _FlagError(
            f"--summarizer {kind} needs --model, for example --model {provider.example_model}"
            + (" (or the model your server at --base-url serves)" if base_url else "")
        )
    url = base_url or provider.official_url
    try:
        if kind == "openai":
            return OpenAICompatibleSummarizer(model, base_url=url, api_key=api_key)
        return AnthropicSummarizer(model, base_url=url, api_key=api_key)
    except ConfigError as exc:
        if exc.key == "api_key" and "needs an API key" in exc.reason:
            raise _FlagError(
                f"--summarizer {kind} at {url} needs an API key: pass --api-key or set "
                f"{provider.env_var} (a local server given with --base-url may need none)"
            ) from None
        if exc.key == "base_url":
            raise _FlagError(
                f"--base-url {base_url!r} is not an http(s) URL; use one such as "
                f"http://127.0.0.1:11434/v1 (a local server) or {provider.official_url}"
            ) from None
        raise _FlagError(_cli_words(str(exc))) from None


def _summarizer_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The four options that choose the summarizer, shared by demo and compact."""
    options = [
        click.option(
            "--summarizer",
            type=click.Choice([_OFFLINE, *_PROVIDERS]),
            default=_OFFLINE,
            show_default=True,
            help="Who writes the summaries: the offline extractive summarizer, any OpenAI-compatible "
            "server (OpenAI, Ollama, vLLM, LM Studio, OpenRouter) or Anthropic.",
        ),
        click.option(
            "--model",
            default=None,
            help="Summarizer model, for openai (e.g. gpt-4o-mini, llama3.1 on Ollama) or anthropic "
            "(e.g. claude-haiku-4-5).",
        ),
        click.option(
            "--base-url",
            default=None,
            help="Provider endpoint, e.g. http://127.0.0.1:11434/v1 for Ollama "
            "(default: the provider's own API).",
        ),
        click.option(
            "--api-key", default=None, help="Provider key (default: $OPENAI_API_KEY / $ANTHROPIC_API_KEY)."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


_SUMMARY_SHARE = 4
"""A summary may take ``--budget // _SUMMARY_SHARE`` tokens (at most 800)."""
_LEAST_SUMMARY = ExtractiveSummarizer().least_summary_tokens()
"""The smallest summary the offline summarizer can write: its section headings. It writes the summary
whenever the chosen ``--summarizer`` fails, so the ``Compactor`` holds every choice to this size."""
_LEAST_BUDGET = _SUMMARY_SHARE * _LEAST_SUMMARY
"""The least ``--budget`` whose summary holds those headings: below it every fold would fail."""


class _Budget(click.IntRange):
    """``--budget``'s type: its least value shown in the help, and a smaller one refused in one line.

    Click's own range error would come with the usage block, and would not say
    why the least is what it is.
    """

    def __init__(self) -> None:
        super().__init__(min=_LEAST_BUDGET)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        budget = click.INT.convert(value, param, ctx)
        if budget < _LEAST_BUDGET:
            raise _FlagError(
                f"--budget {budget} is below {_LEAST_BUDGET}, the least that works: a summary gets a "
                "quarter of --budget, and the offline summarizer (which also stands in when "
                f"openai or anthropic fails) needs {_LEAST_SUMMARY} tokens for its section headings; "
                f"use --budget {_LEAST_BUDGET} or more"
            )
        return budget


_budget = click.option(
    "--budget",
    type=_Budget(),
    default=12000,
    show_default=True,
    help="Compact when the working context is above this many tokens. A summary gets a quarter of it, "
    f"so {_LEAST_BUDGET} is the least, with any --summarizer: the offline one stands in when another fails.",
)


def _options(budget: int) -> RunOptions:
    """The CLI's compaction settings for a token budget."""
    return RunOptions(
        max_history_tokens=budget * 2,
        compaction=SummarizeOptions(
            trigger_token_budget=budget, max_summary_tokens=min(800, budget // _SUMMARY_SHARE)
        ),
    )


def _compactor(
    store: Store, budget: int, summarizer: Summarizer, counter: TiktokenCounter | None = None
) -> Compactor:
    """The command's ``Compactor``, built before the store is opened: a setting it refuses writes nothing.

    ``--budget`` is checked when it is parsed, so nothing the CLI passes
    should be refused here; should it be, the error is one line all the same.
    """
    try:
        return Compactor(store, options=_options(budget), summarizer=summarizer, counter=counter)
    except ConfigError as exc:
        raise _FlagError(f"--budget {budget}: {_cli_words(str(exc))}") from None


def _describe(summarizer: Summarizer) -> str:
    model = getattr(summarizer, "model", None)
    url = getattr(summarizer, "base_url", None)
    return f"model {model} at {url}" if model and url else "the summarizer"


@click.group()
@click.version_option(package_name="contextfold")
def app() -> None:
    """Keep long-running LLM agents inside their context window without losing anything.

    STORE is sqlite:///PATH or a file path, or postgresql://USER@HOST/DB (add
    ?schema=NAME for a schema other than contextfold).
    """


@app.command()
@click.option(
    "--db",
    "db",
    default=None,
    metavar="STORE",
    help="Store the demo writes to: a SQLite file or a store URL (default: a new temporary file, named "
    "in the output).",
)
@click.option(
    "--thread",
    default=None,
    help="Thread to write (default: a new demo-... thread). An existing thread is continued: the session "
    "follows its messages, without a second system prompt, and the 'without' column counts its history.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=300, show_default=True, help="LLM requests to simulate."
)
@_budget
@click.option("--seed", type=int, default=7, show_default=True, help="Seed of the simulated session.")
@click.option(
    "--plot",
    type=click.Path(path_type=Path),
    default=None,
    help="Draw request tokens per step to this PNG, log scale, folds marked (needs contextfold[plot]).",
)
@_summarizer_options
def demo(
    db: str | None,
    thread: str | None,
    steps: int,
    budget: int,
    seed: int,
    plot: Path | None,
    summarizer: str,
    model: str | None,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Run a simulated tool-using agent session with compaction on.

    Exits 1 when the summarizer failed on every fold (each summary then came
    from the offline fallback); the demo stops at the first fold that shows it.
    """
    if plot is not None:
        _require_plot(plot)
    chosen = _summarizer(summarizer, model, base_url, api_key)
    temporary = db is None
    if db is None:
        handle, db = tempfile.mkstemp(prefix="contextfold-demo-", suffix=".db")
        os.close(handle)  # SQLite takes an empty file for an empty database
    counter = TiktokenCounter()
    try:
        store = _store(db, create=True, store_flag="--db")  # opened (a SQLite file created) by the session
        if not temporary and isinstance(store, SQLiteStore):
            _require_demo_file(db, store.path)
        compactor = _compactor(store, budget, chosen, counter)
    except click.ClickException:
        if temporary:
            Path(db).unlink()
        raise
    thread = thread or f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    console = Console(stderr=True)
    offline = summarizer == _OFFLINE

    def give_up(stats: DemoStats) -> bool:
        made = _summaries(stats)
        return not offline and len(made) == 1 and made[0].degraded

    async def session() -> DemoStats:
        async with AsyncExitStack() as stack:
            if isinstance(chosen, AsyncResource):  # the HTTP summarizers own a connection pool
                await stack.enter_async_context(chosen)
            try:
                await stack.enter_async_context(store)
            except StoreError as exc:  # what the check above cannot see, such as a file it may not write
                if temporary or not isinstance(store, SQLiteStore):
                    raise
                raise click.ClickException(
                    f"--db {db}: {exc}; pass a SQLite file you can write, or leave --db out for a new "
                    "temporary file"
                ) from None
            with Progress(
                TextColumn("[bold]simulating"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress:
                task = progress.add_task("steps", total=steps)
                return await run_session(
                    StepLoop(compactor),
                    thread,
                    steps=steps,
                    counter=counter,
                    seed=seed,
                    on_step=lambda done: progress.update(task, completed=done),
                    stop=give_up,
                )

    try:
        with _collect_problems() as problems:
            stats = _run(session, url=db, store_flag="--db")
        _echo_problems(problems, url=db)
        if give_up(stats):
            raise click.ClickException(
                f"the first summary fell back to the offline summarizer because {_describe(chosen)} "
                f"failed (see the warning above); stopped after {stats.requests} of {steps} steps. Check "
                "that the server is up at --base-url, the --model name and --api-key"
            )
    except BaseException as exc:
        if not temporary:
            raise
        # The temporary file is named however the demo ends, so none is left behind unknown.
        note = f"its store is the temporary file {db}: delete it when done"
        if not isinstance(exc, click.ClickException):  # Ctrl-C, or a bug's traceback
            click.echo(f"contextfold demo: {note}", err=True)
            raise
        if db in exc.message:
            raise
        raise click.ClickException(f"{exc.message.rstrip('.')}; {note}") from None
    Console().print(_summary_table(stats, thread, redact_url(db)))
    if stats.earlier_messages:
        click.echo(
            f"thread {thread} held {stats.earlier_messages:,} messages ({stats.earlier_tokens:,} tokens) "
            "before this run: 'without' counts them in each of this run's requests"
        )
    click.echo(f"inspect it: contextfold inspect {redact_url(db)} {thread}")
    if plot is not None:
        try:
            _plot(stats, plot, budget)
        except OSError as exc:
            raise click.ClickException(
                f"--plot {plot} could not be written ({exc.strerror or exc}); the session is saved in "
                f"{redact_url(db)}"
            ) from None
        click.echo(f"plot written to {plot}")
    made = _summaries(stats)
    if made and all(c.degraded for c in made):
        raise click.ClickException(
            f"every summary ({len(made)}) fell back to the offline summarizer: {_describe(chosen)} failed"
        )


def _require_demo_file(db: str, path: Path) -> None:
    """Fail before the demo runs when ``--db`` names no file a SQLite store can be written to.

    The file is only read, so one that is refused is left as it was.
    """
    try:
        folder_given = path.is_dir()
    except OSError:  # a name too long, say: opening the store words it
        return
    if folder_given:
        raise click.ClickException(
            f"--db {db} is a folder; name a file in it, such as {path / 'demo.db'} (created if missing), "
            "or leave --db out for a new temporary file"
        )
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise click.ClickException(f"--db {db}: {folder} {what}; pass a file in a folder that exists")
    if not path.is_file() or path.stat().st_size == 0:
        return  # a new or empty file: the store creates its tables there
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            conn.execute("PRAGMA user_version").fetchone()  # reads the file's header
        finally:
            conn.close()
    except sqlite3.Error as exc:
        notadb = getattr(exc, "sqlite_errorname", "") == "SQLITE_NOTADB"
        what = "is not a SQLite database" if notadb else f"cannot be read as a SQLite database ({exc})"
        raise click.ClickException(
            f"--db {db} {what}, so the demo cannot write its store there (the file is left as it is); "
            "pass a new file, such as demo.db, or the SQLite file of an earlier demo, or leave --db out "
            "for a new temporary file"
        ) from None


def _summaries(stats: DemoStats) -> list[CompactionResult]:
    """The folds that asked the summarizer for a summary.

    A fold that only cut oversized tool outputs folds no message, so it calls no
    summarizer and cannot be degraded: it says nothing about whether the
    summarizer works.
    """
    return [c for c in stats.compactions if not c.stalled and c.dropped_messages > 0]


def _summary_table(stats: DemoStats, thread: str, db: str) -> Table:
    table = Table(title=f"contextfold demo: thread {thread} in {db}")
    table.add_column("measure")
    table.add_column("with compaction", justify="right")
    table.add_column("without", justify="right")
    folds = [c for c in stats.compactions if not c.stalled]
    table.add_row("requests", str(stats.requests), str(stats.requests))
    table.add_row("compactions", str(len(folds)), "0")
    table.add_row("degraded summaries", str(sum(1 for c in folds if c.degraded)), "0")
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


def _require_plot(path: Path) -> None:
    """Fail before the demo runs when the plot could not be drawn or saved to ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'contextfold[plot]'") from None
    try:
        folder_given = path.is_dir()
    except OSError:  # a name too long, say: the write test below words it
        folder_given = False
    if folder_given:
        example = path / "tokens.png"
        raise click.ClickException(f"--plot {path} is a folder; name a file in it, such as {example}")
    suffix = path.suffix.lower().removeprefix(".")
    if suffix and suffix not in FigureCanvasAgg.get_supported_filetypes():
        raise click.ClickException(
            f"--plot {path}: cannot draw a .{suffix} file; name a .png file (or .svg, .pdf)"
        )
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise click.ClickException(f"--plot {path}: {folder} {what}; pass a file in a folder that exists")
    try:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            with path.open("r+b"):  # the plot will replace it; opened without truncating
                pass
        else:
            path.unlink()
    except OSError as exc:
        raise click.ClickException(
            f"--plot {path} cannot be written ({exc.strerror or exc}); pass a file you can write to"
        ) from None


def _plot(stats: DemoStats, path: Path, budget: int) -> Any:
    """Draw the session to ``path`` and return the figure's axes (closed figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    steps = range(1, stats.requests + 1)
    axes.plot(steps, stats.uncompacted_tokens, label="without compaction", color="#c44e52")
    axes.plot(steps, stats.request_tokens, label="with contextfold", color="#4c72b0")
    axes.axhline(budget, linestyle="--", color="grey", linewidth=1, label=f"trigger budget ({budget:,})")
    folds = [step for step, c in zip(stats.compaction_steps, stats.compactions, strict=True) if not c.stalled]
    for n, step in enumerate(folds):
        axes.axvline(step, color="#55a868", linewidth=0.6, alpha=0.6, label="fold" if n == 0 else None)
    # Without a log axis the compacted line is flattened against zero next to the growing one.
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("request tokens (log scale)")
    axes.set_title(f"Request tokens per step: {len(folds)} folds")
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    return axes


async def _require_thread(store: Store, thread: str) -> None:
    stats = await store.stats(thread)
    if stats.message_count == 0 and await store.latest_checkpoint(thread) is None:
        async for _ in store.replay(thread, from_seq=0):
            return
        raise click.ClickException(
            f"no thread {thread!r} in the store; `contextfold threads STORE` lists the threads it holds"
        )


@app.command()
@click.argument("store_url", metavar="STORE")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def threads(store_url: str, as_json: bool) -> None:
    """List the threads a store holds, newest activity first."""
    store = _store(store_url)

    async def listing() -> list[Any]:
        async with store:
            return list(await store.threads())

    found = _run(listing, url=store_url)
    if as_json:
        click.echo(json.dumps([info.model_dump(mode="json") for info in found], indent=2))
        return
    table = Table(title=f"{len(found)} threads in {redact_url(store_url)}")
    for column in ("thread", "messages", "tokens", "episodes", "last activity"):
        table.add_column(column, justify="left" if column == "thread" else "right")
    for info in found:
        last = info.last_activity.strftime("%Y-%m-%d %H:%M:%S") if info.last_activity else "-"
        table.add_row(
            info.thread, f"{info.message_count:,}", f"{info.total_tokens:,}", f"{info.episodes:,}", last
        )
    Console().print(table)


def _one_line(text: str, full: bool) -> Text:
    if full:
        return Text(text)
    return Text(text.replace("\n", " ⏎ ")[:_LINE_CHARS], no_wrap=True, overflow="ellipsis")


def _message_text(stored: StoredMessage) -> str:
    message = stored.message
    text = message.text
    if message.tool_calls:
        text += (" " if text else "") + ", ".join(f"{c.name}({c.arguments})" for c in message.tool_calls)
    return text


def _episode_detail(record: EpisodeRecord) -> tuple[str, str | None]:
    """One line on what an episode holds, and the text to show whole, if any."""
    episode = record.episode
    if isinstance(episode, SummaryCheckpoint):
        if episode.log_from_seq is not None and episode.log_through_seq is not None:
            covers = f"log seqs {episode.log_from_seq}..{episode.log_through_seq}"
        else:
            covers = "log seqs not recorded"
        line = (
            f"{episode.trigger}: {covers} (context seqs {episode.from_seq}..{episode.through_seq}), "
            f"{episode.dropped_messages} messages, {episode.tokens_before:,} -> {episode.tokens_after:,} "
            f"tokens, by {episode.model or 'no summarizer'}" + (" (degraded)" if episode.degraded else "")
        )
        return line, episode.summary
    if isinstance(episode, ToolCallEpisode):
        return f"{episode.call.name}({episode.call.arguments})", None
    if isinstance(episode, ManualRecoveryBoundary):
        return f"{episode.reason} through context seq {episode.through_seq}", None
    if isinstance(episode, RunCompletedEpisode):
        return ("clean" if episode.clean else "unclean"), None
    messages = conversation([record])
    if not messages:
        return "", None
    message = messages[0]
    text = message.text or ", ".join(f"{c.name}({c.arguments})" for c in message.tool_calls)
    return text, None


def _shown(total: int, shown: int, what: str) -> str:
    if shown == total:
        return ""
    return f" (the last {shown} of {total} {what}; --last N or --full for more)"


@app.command()
@click.argument("store_url", metavar="STORE")
@click.argument("thread")
@click.option(
    "--last",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Show the newest N context messages and N log episodes.",
)
@click.option("--full", is_flag=True, help="Show every message and episode, each text whole.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (of what --last / --full select).")
@click.option("--log/--no-log", default=True, show_default=True, help="Also show the episodic log.")
def inspect(store_url: str, thread: str, last: int, full: bool, as_json: bool, log: bool) -> None:
    """Show a thread's working context and its episodic log, newest last.

    Summaries and checkpoints are shown whole; other texts are cut to one line
    unless --full is given.
    """
    store = _store(store_url)

    async def read() -> tuple[Any, list[EpisodeRecord], int]:
        async with store:
            await _require_thread(store, thread)
            window = await store.load(thread)
            records: deque[EpisodeRecord] = deque(maxlen=None if full else last)
            count = 0
            if log:
                async for record in store.replay(thread, from_seq=0):
                    records.append(record)
                    count += 1
            return window, list(records), count

    window, records, count = _run(read, url=store_url)
    messages = list(window.messages if full else window.messages[-last:])
    if as_json:
        document = {
            "thread": thread,
            "context": {
                "message_count": len(window.messages),
                "total_tokens": window.total_tokens,
                "messages": [m.model_dump(mode="json") for m in messages],
            },
            "log": {"episodes": count, "records": [r.model_dump(mode="json") for r in records]}
            if log
            else None,
        }
        click.echo(json.dumps(document, indent=2, ensure_ascii=False))
        return
    console = Console()
    table = Table(
        title=f"working context of {thread!r}: {len(window.messages)} messages, "
        f"{window.total_tokens:,} tokens" + _shown(len(window.messages), len(messages), "messages"),
    )
    table.add_column("seq", justify="right")
    table.add_column("role")
    table.add_column("tokens", justify="right")
    table.add_column("content", ratio=1)
    for stored in messages:
        summary = stored.message.is_summary
        role = stored.message.role.value + (" (summary)" if summary else "")
        table.add_row(
            str(stored.seq), role, f"{stored.tokens:,}", _one_line(_message_text(stored), full or summary)
        )
    console.print(table)
    if not log:
        return
    table = Table(
        title=f"episodic log of {thread!r}: {count} episodes" + _shown(count, len(records), "episodes")
    )
    table.add_column("seq", justify="right")
    table.add_column("at")
    table.add_column("kind")
    table.add_column("detail", ratio=1)
    for record in records:
        line, whole = _episode_detail(record)
        detail = _one_line(line, full) if whole is None else Text(f"{line}\n{whole}")
        table.add_row(str(record.seq), record.at.strftime("%Y-%m-%d %H:%M:%S"), record.episode.kind, detail)
    console.print(table)


@app.command()
@click.argument("store_url", metavar="STORE")
@click.argument("thread")
@click.option(
    "--manual-recovery",
    is_flag=True,
    help="Write an operator's clean-slate boundary: fold every turn into the summary.",
)
@_budget
@_summarizer_options
def compact(
    store_url: str,
    thread: str,
    manual_recovery: bool,
    budget: int,
    summarizer: str,
    model: str | None,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Compact a thread now, whatever its triggers say.

    Exits 1 when there was nothing to fold, when another worker holds the
    thread, or when the summary had to fall back to the offline summarizer.
    """
    chosen = _summarizer(summarizer, model, base_url, api_key)
    store = _store(store_url)
    options = _options(budget)
    compactor = _compactor(store, budget, chosen)  # before the store is opened, which may migrate it

    waiting = False  # whether what a stalled recovery left holds a tool call without its result

    async def fold() -> CompactionResult | None:
        nonlocal waiting
        async with AsyncExitStack() as stack:
            if isinstance(chosen, AsyncResource):
                await stack.enter_async_context(chosen)
            await stack.enter_async_context(store)
            await _require_thread(store, thread)
            if not manual_recovery:
                return await compactor.compact_now(thread)
            result = await compactor.manual_recovery(thread)
            if result is not None and result.stalled:
                waiting = _unanswered((await store.load(thread)).messages)
            return result

    with _collect_problems() as problems:
        result = _run(fold, url=store_url)
    if result is None:
        _echo_problems(problems, url=store_url)
        raise click.ClickException(f"thread {thread!r} is being compacted by another worker; try again")
    if result.stalled:
        # The compactor logged the stall too; it is reported here once, in the command's own words.
        _echo_problems(problems, besides=result.detail, url=store_url)
        if manual_recovery:
            raise click.ClickException(_recovered_line(result, waiting))
        raise click.ClickException(_stall_line(result, options))
    _echo_problems(problems, url=store_url)
    grew = (
        f" (the summary is longer than the {result.dropped_messages} messages it replaced)"
        if result.tokens_after > result.tokens_before
        else ""
    )
    click.echo(
        f"compacted {thread!r} ({result.reason}): {result.dropped_messages} messages folded, "
        f"{result.tokens_before:,} -> {result.tokens_after:,} tokens{grew}"
    )
    if result.degraded:
        raise click.ClickException(
            f"the summary fell back to the offline summarizer because {_describe(chosen)} failed "
            "(see the warning above); the fold was applied"
        )


def _unanswered(messages: Sequence[StoredMessage]) -> bool:
    """Whether a tool call in ``messages`` has no result among them."""
    answered = {m.message.tool_call_id for m in messages if m.message.tool_call_id}
    return any(call.id not in answered for m in messages for call in m.message.tool_calls)


def _recovered_line(result: CompactionResult, waiting: bool) -> str:
    """Why --manual-recovery folded nothing: it folds every turn, and none is left to fold."""
    # Recovery folds every turn but a tool step still waiting for its result, so all that
    # can be left is the pinned head, the summary, and that step.
    step = (
        ", and a tool step still waiting for its result, which recovery always keeps; once the "
        "result is recorded that step can be folded"
        if waiting
        else ""
    )
    return (
        f"nothing to fold in {result.thread!r}: --manual-recovery folds every turn, and none is left; "
        f"its {result.tokens_before:,} tokens are its pinned messages and the summary of its earlier "
        f"turns{step}"
    )


_KEPT_STALL = "nothing can be folded: the protected recent turns"
"""How the compactor's stall detail opens when the turns it always keeps are what is left."""
_EMPTY_STALL = "nothing left to fold"
"""How it opens when nothing but the pinned head and the summary is left."""


def _stall_line(result: CompactionResult, options: RunOptions) -> str:
    """Why a manual compaction folded nothing, in the command's terms.

    Only the stalls at what a fold always keeps are worded here, in the
    command's flags; any other (the pinned head alone over the target, a
    failed summarizer) is the compactor's own detail, which knows its cause.
    """
    opts = options.compaction
    assert opts is not None
    detail = result.detail
    within = result.tokens_before <= opts.trigger_token_budget
    if not (detail.startswith(_KEPT_STALL) or (within and detail.startswith(_EMPTY_STALL))):
        detail = detail.removesuffix("; nothing folded")
        detail = detail.replace("raise the target", "raise --budget (the target is half of it)")
        return f"nothing folded in {result.thread!r}: {detail}"
    kept = (
        f"the newest turns always kept ({opts.min_recent_turns} turns, {opts.min_recent_messages} messages)"
    )
    if within:
        return (
            f"nothing to fold in {result.thread!r}: its {result.tokens_before:,} tokens are within the "
            f"{opts.trigger_token_budget:,}-token --budget, and a fold would keep all of them (they fit "
            f"the {opts.effective_target_tokens:,}-token target a fold aims for, or are {kept}); "
            "--manual-recovery folds every turn into the summary"
        )
    return (
        f"nothing to fold in {result.thread!r}: {kept} alone hold most of its {result.tokens_before:,} "
        f"tokens, over the {opts.trigger_token_budget:,}-token --budget; raise --budget or use "
        "--manual-recovery"
    )
