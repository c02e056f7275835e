"""The public face: a small top level, documented public modules, nothing private leaking."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import contextfold

PUBLIC_MODULES = [
    "contextfold",
    "contextfold.episodes",
    "contextfold.events",
    "contextfold.loop",
    "contextfold.messages",
    "contextfold.planning",
    "contextfold.stores",
    "contextfold.summarizers",
    "contextfold.testing",
    "contextfold.tokens",
]


REEXPORTING = [m for m in PUBLIC_MODULES if m not in ("contextfold", "contextfold.testing")]


@pytest.mark.parametrize("name", REEXPORTING)
def test_all_is_every_public_name_the_module_has(name: str) -> None:
    """Each re-exporting public module's __all__ lists exactly the public names it holds."""
    module = importlib.import_module(name)
    found = {n for n, v in vars(module).items() if not n.startswith("_") and not inspect.ismodule(v)}
    found -= {"annotations", "TYPE_CHECKING", "Any"}
    found |= {"PostgresStore"} if name == "contextfold.stores" else set()  # loaded on first use
    found |= set(getattr(module, "_HOMES", ()))  # contextfold.summarizers: loaded on first use
    assert set(module.__all__) == found
    assert len(module.__all__) == len(set(module.__all__))


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_exported_name_resolves_and_is_documented(name: str) -> None:
    """Every name a public module exports can be read from it, and each class and function has a docstring."""
    module = importlib.import_module(name)
    assert module.__doc__
    undocumented = []
    for item in module.__all__:
        value = getattr(module, item)
        if (inspect.isclass(value) or inspect.isfunction(value)) and not inspect.getdoc(value):
            undocumented.append(item)
    assert undocumented == []


def test_the_top_level_holds_what_a_user_calls() -> None:
    """The top level stays small: about forty names, the ones the README's programs use."""
    names = [n for n in contextfold.__all__ if not inspect.ismodule(getattr(contextfold, n))]
    assert len(names) <= 42
    assert set(dir(contextfold)) == set(contextfold.__all__)
    for name in ("Compactor", "StepLoop", "Message", "SQLiteStore", "SummarizeOptions", "TokenCount"):
        assert name in contextfold.__all__
    for internal in ("group_units", "split_head", "Unit", "Orphan", "load_encoding", "PINNED_SHA256"):
        assert internal not in contextfold.__all__


def test_the_window_multiple_is_exported_and_documented_beside_the_budget_rule() -> None:
    """WINDOW_MULTIPLE_OF_TRIGGER, the 4 of budget * 4 >= max_history_tokens, is a top-level name."""
    from contextfold._config import WINDOW_MULTIPLE_OF_TRIGGER

    assert "WINDOW_MULTIPLE_OF_TRIGGER" in contextfold.__all__
    assert contextfold.WINDOW_MULTIPLE_OF_TRIGGER == WINDOW_MULTIPLE_OF_TRIGGER == 4
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    budgets = readme.split("## Options and budgets", 1)[1].split("\n## ", 1)[0]
    assert "WINDOW_MULTIPLE_OF_TRIGGER" in budgets


def test_each_backend_is_importable_from_one_public_path() -> None:
    """Backends are re-exported at the top level from contextfold.stores, the one module that defines them."""
    from contextfold import stores

    assert contextfold.SQLiteStore is stores.SQLiteStore
    assert contextfold.MemoryStore is stores.MemoryStore


def test_importing_contextfold_imports_no_optional_dependency_and_little_else() -> None:
    """import contextfold loads none of the extras, nor httpx, pydantic or tiktoken, until a name is used."""
    code = (
        "import sys, contextfold\n"
        "heavy = ['psycopg', 'click', 'rich', 'httpx', 'pydantic', 'tiktoken', 'opentelemetry',"
        " 'langchain', 'pydantic_ai', 'agents', 'openai', 'anthropic']\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "contextfold.Compactor\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_folding_with_the_offline_summarizer_imports_no_http_client(tmp_path: Path) -> None:
    """A Compactor on SQLite folding with the default summarizer never imports httpx, tenacity, click or rich.

    ``contextfold.summarizers`` imported its two HTTP clients with the package,
    so the compactor's first use brought in httpx and tenacity, and through
    httpx's command line click, rich and pygments: about 11,000 more objects
    for every full garbage collection of the process to walk.
    """
    code = (
        "import asyncio, gc, sys\n"
        "from contextfold import Compactor, Message, RunOptions, SummarizeOptions\n"
        "from contextfold.stores import SQLiteStore\n"
        "from contextfold.summarizers import ExtractiveSummarizer, FunctionSummarizer, Summarizer\n"
        "async def main():\n"
        f"    async with SQLiteStore({str(tmp_path / 'cf.db')!r}) as store:\n"
        "        options = RunOptions(\n"
        "            max_history_tokens=2_000,\n"
        "            compaction=SummarizeOptions(trigger_token_budget=600, min_recent_messages=2),\n"
        "        )\n"
        "        compactor = Compactor(store, options=options)\n"
        "        assert isinstance(compactor.summarizer, ExtractiveSummarizer)\n"
        "        folds = 0\n"
        "        for n in range(40):\n"
        "            result = await compactor.maybe_compact('t')\n"
        "            folds += result is not None and result.compacted\n"
        "            await compactor.append('t', [Message.user(f'step {n}: ' + 'words ' * 30)])\n"
        "        assert folds, 'no fold ran'\n"
        "asyncio.run(main())\n"
        "heavy = ['httpx', 'tenacity', 'click', 'rich', 'pygments']\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "from contextfold.summarizers import OpenAICompatibleSummarizer\n"
        "assert 'httpx' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_summarizers_package_names_every_export_and_no_other() -> None:
    """Each name in contextfold.summarizers.__all__ resolves (loaded on first use); an unknown one raises."""
    from contextfold import summarizers

    assert sorted(dir(summarizers)) == sorted(summarizers.__all__)
    for name in summarizers.__all__:
        assert getattr(summarizers, name).__name__ == name
    with pytest.raises(AttributeError, match="Summariser"):
        summarizers.Summariser  # noqa: B018


def test_every_error_derives_from_the_root() -> None:
    """Every exported exception is a ContextfoldError."""
    errors = [
        e
        for n in contextfold.__all__
        if n.endswith("Error") and isinstance(e := getattr(contextfold, n), type)
    ]
    assert errors and all(issubclass(e, contextfold.ContextfoldError) for e in errors)


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    """Looking up a name the package does not have raises AttributeError naming it."""
    with pytest.raises(AttributeError, match="maybe_compact"):
        contextfold.maybe_compact  # noqa: B018
