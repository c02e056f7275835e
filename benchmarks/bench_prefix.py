"""Prefix stability: how much of each request a provider's prompt cache could reuse.

Over one long session (``--session`` messages of a tool-using agent, one request
per message, 32k-token budget), every request is compared with the one before
it: the tokens of the leading messages the two share unchanged are what a
provider's prompt cache reuses. contextfold (memory store, instant summarizer)
and LangChain's ``SummarizationMiddleware`` (its state in memory, a fixed
summary; the system prompt kept outside the state, as ``create_agent`` does)
see the same session.

Printed per run: the share of all request tokens that were a reused prefix,
the median and 10th-percentile share per request, the requests whose prefix
broke (under half reused), the folds, and the mean request size in tokens
(what a run keeps in context is the other side of how often it folds).

Run it:  python benchmarks/bench_prefix.py [--session 5000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio

from contextfold import Compactor, Message
from contextfold.stores import MemoryStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.testing import agent_session
from contextfold.tokens import TiktokenCounter

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import BUDGET, instant, langchain_middleware, to_langchain

Key = tuple[str, str, str]
"""A message as the provider sees it: role, text, tool calls."""


@dataclass(frozen=True)
class Stability:
    run: str
    shares: list[float]
    reused_tokens: int
    request_tokens: int
    folds: int


def stability(run: str, requests: Sequence[Sequence[Key]], folds: int, tokens: Any) -> Stability:
    """Each request's share of tokens in the leading messages it shares with the request before it."""
    shares: list[float] = []
    reused_total = sent_total = 0
    for previous, request in pairwise(requests):
        sizes = [tokens(key) for key in request]
        reused = 0
        for index, key in enumerate(request):
            if index >= len(previous) or previous[index] != key:
                break
            reused += sizes[index]
        sent = sum(sizes)
        shares.append(reused / sent if sent else 1.0)
        reused_total += reused
        sent_total += sent
    return Stability(run, shares, reused_total, sent_total, folds)


def key_of(message: Message) -> Key:
    return (message.role.value, message.text, "".join(c.id + c.arguments for c in message.tool_calls))


async def contextfold_requests(messages: Sequence[Message]) -> tuple[list[list[Key]], int]:
    requests: list[list[Key]] = []
    folds = 0
    async with MemoryStore() as store:
        compactor = Compactor(
            store, options=BUDGET, summarizer=FunctionSummarizer(instant), counter=TiktokenCounter()
        )
        for message in messages:
            await compactor.append("session", [message])
            result = await compactor.maybe_compact("session")
            folds += result is not None and result.compacted
            requests.append([key_of(m) for m in await compactor.context("session")])
    return requests, folds


def langchain_requests(messages: Sequence[Message]) -> tuple[list[list[Key]], int]:
    middleware = langchain_middleware()
    system = key_of(messages[0])
    state: dict[str, Any] = {"messages": []}
    requests: list[list[Key]] = []
    folds = 0
    for message in to_langchain(messages[1:]):
        state["messages"].append(message)
        update = middleware.before_model(state, None)
        if update is not None:
            state["messages"] = list(update["messages"][1:])  # after RemoveMessage(REMOVE_ALL_MESSAGES)
            folds += 1
        request = [system]
        for lc in state["messages"]:
            calls = "".join(c["id"] + str(c["args"]) for c in getattr(lc, "tool_calls", []) or [])
            request.append((lc.type, str(lc.content), calls))
        requests.append(request)
    return requests, folds


async def main_async(count: int) -> int:
    messages = agent_session(count)
    encode = TiktokenCounter().encoding.encode_ordinary
    cache: dict[Key, int] = {}

    def tokens(key: Key) -> int:
        if key not in cache:
            cache[key] = len(encode(key[1] + key[2])) + 4
        return cache[key]

    results = [stability("contextfold", *await contextfold_requests(messages), tokens)]
    try:
        lc = await anyio.to_thread.run_sync(langchain_requests, messages)
    except ImportError:
        print("  (LangChain missing: pip install 'contextfold[bench]' for its row)", file=sys.stderr)
    else:
        results.append(stability("langchain SummarizationMiddleware", *lc, tokens))
    print(f"prefix stability over {count:,} requests, 32k-token budget")
    print(
        f"{'run':<34} {'reused tokens':>13} {'median':>7} {'p10':>6} {'broken':>7} {'folds':>6} "
        f"{'mean request':>13}"
    )
    for r in results:
        ordered = sorted(r.shares)
        p10 = ordered[len(ordered) // 10] if ordered else float("nan")
        broken = sum(share < 0.5 for share in r.shares)
        print(
            f"{r.run:<34} {r.reused_tokens / max(1, r.request_tokens):13.1%} "
            f"{statistics.median(r.shares):7.1%} {p10:6.1%} {broken:7d} {r.folds:6d} "
            f"{r.request_tokens / max(1, len(r.shares)):13,.0f}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--session", type=int, default=5_000, help="messages (and requests) in the session")
    args = parser.parse_args(argv)
    return anyio.run(main_async, args.session)


if __name__ == "__main__":
    sys.exit(main())
