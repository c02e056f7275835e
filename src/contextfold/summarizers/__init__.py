"""Summarizers: the protocol and its implementations."""

from ._base import FunctionSummarizer, Summarizer, Summary

__all__ = ["FunctionSummarizer", "Summarizer", "Summary"]
