"""Add contextfold to a pydantic-ai agent as one capability that compacts before each model request.

``CompactionCapability`` records the run's messages in the thread named by the
run's ``conversation_id`` and, when the budget is reached, rewrites the
request and the run's history into a summary (a ``CompactionPart``) and the
recent turns; the log keeps every original message. pydantic-ai's own
``FunctionModel`` plays the model, so this runs offline.

Run it:  python examples/pydantic_ai_agent.py   (needs contextfold[pydantic-ai])
"""

from __future__ import annotations

import itertools

import anyio
from pydantic_ai import Agent
from pydantic_ai.messages import (
    CompactionPart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from contextfold import Compactor, RunOptions, SummarizeOptions
from contextfold.episodes import SummaryCheckpoint
from contextfold.integrations.pydantic_ai import CompactionCapability
from contextfold.stores import MemoryStore

CALL_IDS = itertools.count(1)


def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Read a file after each question, then answer."""
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(part, ToolReturnPart) for part in last.parts):
        return ModelResponse(parts=[TextPart("It retries 3 times, 2 s apart.")])
    call = ToolCallPart("read_file", {"path": "src/retry.py"}, tool_call_id=f"call_{next(CALL_IDS)}")
    return ModelResponse(parts=[call])


async def main() -> None:
    options = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_000))
    async with MemoryStore() as store:
        agent = Agent(
            FunctionModel(model), capabilities=[CompactionCapability(Compactor(store, options=options))]
        )

        @agent.tool_plain
        def read_file(path: str) -> str:
            """Read a file of the repository."""
            return f"# {path}\n" + "ATTEMPTS = 3\nDELAY_S = 2\n" * 30

        history: list[ModelMessage] = []
        for n in range(6):
            result = await agent.run(
                f"How does retry.py retry? ({n})", message_history=history, conversation_id="repo"
            )
            history = result.all_messages()
        folds = sum([isinstance(r.episode, SummaryCheckpoint) async for r in store.replay("repo")])
    print(f"last reply: {result.output!r}")
    opening = history[0].parts[0]
    print(
        f"{folds} folds; the history now holds {len(history)} messages, "
        f"the first part a summary: {isinstance(opening, CompactionPart)}"
    )


if __name__ == "__main__":
    anyio.run(main)
