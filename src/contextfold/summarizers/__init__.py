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

from ._anthropic import AnthropicSummarizer
from ._base import FunctionSummarizer, Summarizer, Summary
from ._chat import ChatSummarizer
from ._extractive import ExtractiveSummarizer
from ._openai import OpenAICompatibleSummarizer
from ._retry import SummarizerRetry

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
