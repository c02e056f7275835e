"""Storage backends: the two protocols and their implementations."""

from ._base import ContextWindow, EpisodicStore, ShortTermStore, StoredMessage, ThreadStats

__all__ = [
    "ContextWindow",
    "EpisodicStore",
    "ShortTermStore",
    "StoredMessage",
    "ThreadStats",
]
