"""Summarizers: the protocol, a function-backed fake, two HTTP clients and an offline default.

Swap the provider with one argument::

    ExtractiveSummarizer()                                   # offline, deterministic
    OpenAICompatibleSummarizer("gpt-4o-mini")                # OPENAI_API_KEY
    OpenAICompatibleSummarizer("llama3.1", base_url="http://127.0.0.1:11434/v1")
    AnthropicSummarizer("claude-3-5-haiku-latest")           # ANTHROPIC_API_KEY
"""

from ._anthropic import AnthropicSummarizer
from ._base import FunctionSummarizer, Summarizer, Summary
from ._extractive import ExtractiveSummarizer, find_identifiers
from ._http import SummarizerRetry
from ._openai import OpenAICompatibleSummarizer
from ._prompt import SECTIONS, SYSTEM_PROMPT, render_messages

__all__ = [
    "SECTIONS",
    "SYSTEM_PROMPT",
    "AnthropicSummarizer",
    "ExtractiveSummarizer",
    "FunctionSummarizer",
    "OpenAICompatibleSummarizer",
    "Summarizer",
    "SummarizerRetry",
    "Summary",
    "find_identifiers",
    "render_messages",
]
