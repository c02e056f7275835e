"""Wrap an agent loop you already have: one ``async with loop.step(thread)`` per request.

Your loop keeps calling its own model; contextfold hands it the compacted
working context and records what it does (episodic log first, then the
working context). Runs offline on a SQLite file with the extractive summarizer.

Run it:  python examples/wrap_existing_loop.py [path/to/file.db]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

from contextfold import Compactor, Message, RunOptions, StepLoop, SummarizeOptions, ToolCall, conversation
from contextfold.stores import SQLiteStore


async def my_model(messages: list[Message]) -> Message:
    """Stands in for your own LLM call; it asks for a tool once per user request."""
    last = messages[-1]
    if last.role.value == "user" and not last.is_summary:
        call = ToolCall(
            id=f"call-{len(messages)}", name="grep", arguments='{"pattern": "TODO", "path": "src/"}'
        )
        return Message.assistant(None, tool_calls=[call])
    return Message.assistant("Found them; the TODOs are listed above.")


async def grep(pattern: str, path: str) -> str:
    return "\n".join(f"{path}module_{n}.py:{10 * n}: # {pattern} tidy this up" for n in range(40))


async def main(db: Path) -> None:
    options = RunOptions(
        max_history_tokens=4_000,
        compaction=SummarizeOptions(trigger_token_budget=1_500, max_summary_tokens=300),
    )
    async with SQLiteStore(db) as store:
        loop = StepLoop(Compactor(store, options=options))
        thread = "wrap-example"
        await loop.append(thread, Message.system("You are a code-tidying agent."))
        compactions = 0
        for request in range(12):
            await loop.append(thread, Message.user(f"Request {request}: find the TODOs in src/."))
            while True:
                async with loop.step(thread) as step:  # compaction happens here, before the request
                    compactions += step.compaction is not None and step.compaction.compacted
                    reply = await my_model(step.messages)
                    results = [
                        Message.tool(call.id, await grep(**call.parsed_arguments()))
                        for call in reply.tool_calls
                    ]
                    # The whole step in one transaction; started= notes each tool's run in the log.
                    await step.record(reply, *results, started=reply.tool_calls)
                if not reply.tool_calls:
                    break
            await loop.complete_run(thread)
        context = await loop.compactor.context(thread)
        replayed = conversation([record async for record in store.replay(thread)])
        print(f"compactions: {compactions}")
        print(f"working context: {len(context)} messages, {(await store.stats(thread)).total_tokens} tokens")
        print(f"episodic log replays {len(replayed)} original messages")
        assert compactions > 0 and len(replayed) > len(context)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as folder:
            anyio.run(main, Path(folder) / "wrap.db")
