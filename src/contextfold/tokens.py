"""Token counters: exact tiktoken counting that works offline, and the ~4-bytes-per-token estimate."""

from ._tokens import ApproximateCounter, TiktokenCounter, TokenCounter

__all__ = ["ApproximateCounter", "TiktokenCounter", "TokenCounter"]
