"""Adapters for the agent frameworks and model SDKs people already use, one module each.

Each module imports its framework only when it is itself imported, so
``import contextfold`` never imports a framework; install the matching extra
(``contextfold[langchain]``, ``[pydantic-ai]``, ``[openai-agents]``,
``[openai]``, ``[anthropic]``). Every adapter is built on
:func:`contextfold._sync.sync`: record the framework's unrecorded messages,
compact when due, hand back the context when it changed.
"""

__all__: list[str] = []
