"""Call ``Compactor.maybe_compact`` from any code, without a step loop.

Record messages with a ``Compactor`` (the episodic log and the working
context together) and await one check before each request you build yourself.

Run it:  python examples/bare_maybe_compact.py
"""

from __future__ import annotations

import anyio

from contextfold import Compactor, Message, RunOptions, SummarizeOptions
from contextfold.stores import MemoryStore


async def main() -> None:
    options = RunOptions(
        max_history_tokens=2_000,
        compaction=SummarizeOptions(trigger_token_budget=800, max_summary_tokens=150, min_recent_messages=2),
    )
    async with MemoryStore() as store:
        compactor = Compactor(store, options=options)
        for n in range(20):
            await compactor.append("bare", [Message.user(f"Note {n}: the build id is B-{1000 + n}. " * 5)])
            result = await compactor.maybe_compact("bare")
            if result is not None:
                print(
                    f"after note {n}: {result.reason}, {result.dropped_messages} messages folded, "
                    f"{result.tokens_before} -> {result.tokens_after} tokens"
                )
        context = await compactor.context("bare")
        print(context[0].text.splitlines()[0])
        assert context[0].is_summary


if __name__ == "__main__":
    anyio.run(main)
