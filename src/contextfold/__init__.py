"""contextfold: keep long-running LLM agents inside their context window without losing anything.

The names users call are here; the building blocks live in documented submodules
(``contextfold.planning``, ``contextfold.episodes``, ``contextfold.loop``,
``contextfold.events``, ``contextfold.messages``, ``contextfold.tokens``,
``contextfold.stores``, ``contextfold.summarizers``, ``contextfold.testing``,
``contextfold.integrations``). Everything is imported on first use, so
``import contextfold`` itself costs next to nothing.
"""

import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import (
        episodes,
        events,
        integrations,
        loop,
        messages,
        planning,
        stores,
        summarizers,
        testing,
        tokens,
    )
    from ._compactor import CompactionResult, Compactor
    from ._config import WINDOW_MULTIPLE_OF_TRIGGER, RunOptions, SummarizeOptions
    from ._episodes import Usage, conversation
    from ._errors import (
        ConfigError,
        ConflictError,
        ContextfoldError,
        InvalidMessageError,
        StoreClosedError,
        StoreError,
        SummarizerError,
    )
    from ._loop import Hook, Reply, Step, StepLoop
    from ._messages import Message, Role, ToolCall, from_anthropic, from_openai, to_anthropic, to_openai
    from ._policy import EpisodicCompactionConfig, Reason, TokenCount, TurnCount
    from ._strategies import ObservationMasking, SlidingWindow, TokenBudget
    from .stores import MemoryStore, PostgresStore, SQLiteStore
    from .summarizers import (
        AnthropicSummarizer,
        ChatSummarizer,
        ExtractiveSummarizer,
        FunctionSummarizer,
        OpenAICompatibleSummarizer,
        Summarizer,
    )

__version__ = "0.1.0.dev0"

# A library adds no handler of its own: the application decides where logs go.
logging.getLogger("contextfold").addHandler(logging.NullHandler())

_HOMES: dict[str, str] = {
    "AnthropicSummarizer": "summarizers",
    "ChatSummarizer": "summarizers",
    "CompactionResult": "_compactor",
    "Compactor": "_compactor",
    "ConfigError": "_errors",
    "ConflictError": "_errors",
    "ContextfoldError": "_errors",
    "EpisodicCompactionConfig": "_policy",
    "ExtractiveSummarizer": "summarizers",
    "FunctionSummarizer": "summarizers",
    "Hook": "_loop",
    "InvalidMessageError": "_errors",
    "MemoryStore": "stores",
    "Message": "_messages",
    "ObservationMasking": "_strategies",
    "OpenAICompatibleSummarizer": "summarizers",
    "PostgresStore": "stores",
    "Reason": "_policy",
    "Reply": "_loop",
    "Role": "_messages",
    "RunOptions": "_config",
    "SQLiteStore": "stores",
    "SlidingWindow": "_strategies",
    "Step": "_loop",
    "StepLoop": "_loop",
    "StoreClosedError": "_errors",
    "StoreError": "_errors",
    "SummarizeOptions": "_config",
    "Summarizer": "summarizers",
    "SummarizerError": "_errors",
    "TokenBudget": "_strategies",
    "TokenCount": "_policy",
    "ToolCall": "_messages",
    "TurnCount": "_policy",
    "Usage": "_episodes",
    "WINDOW_MULTIPLE_OF_TRIGGER": "_config",
    "conversation": "_episodes",
    "from_anthropic": "_messages",
    "from_openai": "_messages",
    "to_anthropic": "_messages",
    "to_openai": "_messages",
}

_SUBMODULES = frozenset(
    {
        "episodes",
        "events",
        "integrations",
        "loop",
        "messages",
        "planning",
        "stores",
        "summarizers",
        "testing",
        "tokens",
    }
)

__all__ = [
    "WINDOW_MULTIPLE_OF_TRIGGER",
    "AnthropicSummarizer",
    "ChatSummarizer",
    "CompactionResult",
    "Compactor",
    "ConfigError",
    "ConflictError",
    "ContextfoldError",
    "EpisodicCompactionConfig",
    "ExtractiveSummarizer",
    "FunctionSummarizer",
    "Hook",
    "InvalidMessageError",
    "MemoryStore",
    "Message",
    "ObservationMasking",
    "OpenAICompatibleSummarizer",
    "PostgresStore",
    "Reason",
    "Reply",
    "Role",
    "RunOptions",
    "SQLiteStore",
    "SlidingWindow",
    "Step",
    "StepLoop",
    "StoreClosedError",
    "StoreError",
    "SummarizeOptions",
    "Summarizer",
    "SummarizerError",
    "TokenBudget",
    "TokenCount",
    "ToolCall",
    "TurnCount",
    "Usage",
    "__version__",
    "conversation",
    "episodes",
    "events",
    "from_anthropic",
    "from_openai",
    "integrations",
    "loop",
    "messages",
    "planning",
    "stores",
    "summarizers",
    "testing",
    "to_anthropic",
    "to_openai",
    "tokens",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(import_module(f".{home}", __name__), name)
    elif name in _SUBMODULES:
        value = import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
