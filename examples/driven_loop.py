"""Let contextfold drive your model and tools, blocking or streaming, with the same compaction.

``StepLoop.run`` calls an async LLM callable and your tools until the model
answers without a tool call; ``StepLoop.stream`` does the same and yields
events (text deltas, tool calls, compactions) as they happen. A scripted model
from ``contextfold.testing`` plays the LLM, so this runs offline.

Run it:  python examples/driven_loop.py
"""

from __future__ import annotations

import anyio

from contextfold import Compactor, Message, RunOptions, StepLoop, SummarizeOptions
from contextfold.loop import Compacted, TextDelta
from contextfold.stores import MemoryStore
from contextfold.testing import ScriptedModel, tool_step


def script(messages: list[Message]) -> Message:
    """Read a file after each user request, then answer."""
    if messages[-1].role.value == "tool":
        return Message.assistant("The file defines the retry policy: 3 attempts, 2 s apart.")
    return tool_step("read_file", '{"path": "src/retry.py"}', call_id=f"call-{len(messages)}")


async def read_file(path: str) -> str:
    return f"# {path}\n" + "\n".join(f"ATTEMPTS = 3  # line {n}" for n in range(25))


async def main() -> None:
    options = RunOptions(
        max_history_tokens=3_000,
        compaction=SummarizeOptions(trigger_token_budget=1_200, max_summary_tokens=250),
    )
    tools = {"read_file": read_file}
    async with MemoryStore() as store:
        loop = StepLoop(Compactor(store, options=options))

        blocking = ScriptedModel(script)
        for n in range(5):
            result = await loop.run("blocking", f"What does retry.py do? ({n})", llm=blocking, tools=tools)
        print(f"blocking: last reply {result.reply.text!r}")

        streaming = ScriptedModel(script)
        compactions = 0
        for n in range(5):
            text = []
            async for event in loop.stream(
                "streaming", f"What does retry.py do? ({n})", llm=streaming.stream, tools=tools
            ):
                if isinstance(event, TextDelta):
                    text.append(event.text)
                elif isinstance(event, Compacted):
                    compactions += 1
        print(f"streaming: last reply {''.join(text)!r}, {compactions} compactions")

        same = [m.text for m in await loop.compactor.context("blocking")] == [
            m.text for m in await loop.compactor.context("streaming")
        ]
        print(f"both paths left the same working context: {same}")
        assert same and compactions > 0


if __name__ == "__main__":
    anyio.run(main)
