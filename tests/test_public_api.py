"""The public face: a curated ``__all__`` in every public module, and nothing private leaking."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import contextfold

PUBLIC_MODULES = ["contextfold", "contextfold.stores", "contextfold.summarizers", "contextfold.testing"]

EXPECTED_TOP_LEVEL = {
    # messages and wire formats
    "Message",
    "Role",
    "ToolCall",
    "SUMMARY_METADATA_KEY",
    "TOOL_ERROR_METADATA_KEY",
    "from_openai",
    "to_openai",
    "from_anthropic",
    "to_anthropic",
    # tokens
    "TokenCounter",
    "TiktokenCounter",
    "ApproximateCounter",
    "EncodingName",
    "PINNED_SHA256",
    "load_encoding",
    # policy
    "Pressure",
    "Trigger",
    "TurnCount",
    "TokenCount",
    "AnyOf",
    "AllOf",
    "EpisodicPolicy",
    "EpisodicCompactionConfig",
    "EpisodicCompactionPressure",
    "EpisodicCompactionTrigger",
    "episodic_compaction_trigger",
    # planning
    "CompactionConfig",
    "CompactionPlan",
    "Strategy",
    "SlidingWindow",
    "TokenBudget",
    "ObservationMasking",
    "Unit",
    "Orphan",
    "group_units",
    "split_head",
    "MASKED_METADATA_KEY",
    # config
    "RunOptions",
    "SummarizeOptions",
    "WINDOW_MULTIPLE_OF_TRIGGER",
    "CompactionMode",
    "OnSummarizerError",
    # episodes
    "Episode",
    "EpisodeKind",
    "EpisodeRecord",
    "UserMessageEpisode",
    "SystemMessageEpisode",
    "LlmCallEpisode",
    "ToolCallEpisode",
    "ToolResultEpisode",
    "RunCompletedEpisode",
    "SummaryCheckpoint",
    "ManualRecoveryBoundary",
    "Usage",
    "conversation",
    "episode_for",
    # errors
    "ContextfoldError",
    "ConfigError",
    "InvalidMessageError",
    "StoreError",
    "ConflictError",
    "StoreClosedError",
    "SummarizerError",
    # compaction and the loop
    "Compactor",
    "CompactionResult",
    "SUMMARY_PREFIX",
    "TRUNCATED_METADATA_KEY",
    "StepLoop",
    "Step",
    "Hook",
    "CompactionHook",
    "LLM",
    "StreamingLLM",
    "Tool",
    "RunResult",
    "StepEvent",
    "Compacted",
    "TextDelta",
    "ToolStarted",
    "ToolFinished",
    "StepFinished",
    "RunFinished",
    # subpackages and version
    "stores",
    "summarizers",
    "__version__",
}


def test_top_level_all_is_the_curated_list() -> None:
    """contextfold.__all__ is exactly the documented names plus what the subpackages export."""
    from contextfold import stores, summarizers

    backends = {
        "MemoryStore",
        "SQLiteStore",
        "PostgresStore",
        "ShortTermStore",
        "EpisodicStore",
        "ContextWindow",
    }
    backends |= {"StoredMessage", "ThreadStats", "Summarizer", "Summary", "FunctionSummarizer"}
    backends |= {
        "ExtractiveSummarizer",
        "OpenAICompatibleSummarizer",
        "AnthropicSummarizer",
        "SummarizerRetry",
    }
    expected = EXPECTED_TOP_LEVEL | backends
    assert backends <= set(stores.__all__) | set(summarizers.__all__)
    assert set(contextfold.__all__) == expected
    assert len(contextfold.__all__) == len(set(contextfold.__all__))


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_exported_name_exists(name: str) -> None:
    """Each name a public module lists in __all__ can be imported from it."""
    module = importlib.import_module(name)
    missing = [item for item in module.__all__ if not hasattr(module, item)]
    assert missing == []


def test_stores_and_summarizers_export_the_backends() -> None:
    """The store and summarizer packages export every backend by name."""
    from contextfold import stores, summarizers

    assert {"MemoryStore", "SQLiteStore", "PostgresStore", "ShortTermStore", "EpisodicStore"} <= set(
        stores.__all__
    )
    assert {
        "Summarizer",
        "Summary",
        "FunctionSummarizer",
        "ExtractiveSummarizer",
        "OpenAICompatibleSummarizer",
        "AnthropicSummarizer",
    } <= set(summarizers.__all__)


def test_importing_contextfold_does_not_import_psycopg() -> None:
    """psycopg is an optional extra: importing contextfold leaves it unimported."""
    code = "import sys, contextfold; assert 'psycopg' not in sys.modules; contextfold.PostgresStore"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_error_derives_from_the_root() -> None:
    """Every exported exception is a ContextfoldError."""
    errors = [
        e
        for n in contextfold.__all__
        if n.endswith("Error") and isinstance(e := getattr(contextfold, n), type)
    ]
    assert errors and all(issubclass(e, contextfold.ContextfoldError) for e in errors)
