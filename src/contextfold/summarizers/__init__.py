"""Summarizers: the protocol, a fake, a base for chat models, two HTTP clients and an offline default.

Swap the provider with one argument::

    ExtractiveSummarizer()                                   # offline, deterministic
    OpenAICompatibleSummarizer("gpt-4o-mini")                # OPENAI_API_KEY
    OpenAICompatibleSummarizer("llama3.1", base_url="http://127.0.0.1:11434/v1")
    AnthropicSummarizer("claude-3-5-haiku-latest")           # ANTHROPIC_API_KEY

Any other chat model is one subclass of :class:`ChatSummarizer` away: it
implements ``complete(system, user, max_tokens)`` and gets contextfold's
prompt, chunking and checks.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._base import FunctionSummarizer, Summarizer, Summary

if TYPE_CHECKING:
    from ._anthropic import AnthropicSummarizer
    from ._chat import ChatSummarizer
    from ._extractive import ExtractiveSummarizer
    from ._openai import OpenAICompatibleSummarizer
    from ._retry import SummarizerRetry

# Imported on first use: the HTTP clients bring httpx and tenacity (and httpx its
# command line's click, rich and pygments when they are installed), tens of
# thousands of objects that a process folding with its own summarizer never needs
# and that every full garbage collection would walk.
_HOMES: dict[str, str] = {
    "AnthropicSummarizer": "_anthropic",
    "ChatSummarizer": "_chat",
    "ExtractiveSummarizer": "_extractive",
    "OpenAICompatibleSummarizer": "_openai",
    "SummarizerRetry": "_retry",
}

__all__ = [
    "AnthropicSummarizer",
    "ChatSummarizer",
    "ExtractiveSummarizer",
    "FunctionSummarizer",
    "OpenAICompatibleSummarizer",
    "Summarizer",
    "SummarizerRetry",
    "Summary",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
