"""Add contextfold to a LangChain v1 ``create_agent`` agent: one middleware, for ``invoke`` and ``ainvoke``.

``CompactionMiddleware`` records the agent's messages in the thread named by
the run config's ``thread_id`` and, when the budget is reached, replaces the
agent state's messages with a summary and the recent turns; the log keeps
every original message. ``LangChainSummarizer`` makes any LangChain chat model
the summarizer, with contextfold's incremental prompt. LangChain's own fake
chat model plays the agent and the summarizer, so this runs offline.

Run it:  python examples/langchain_agent.py   (needs contextfold[langchain])
"""

from __future__ import annotations

import itertools
from typing import Any

import anyio
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from contextfold import Compactor, RunOptions, SummarizeOptions
from contextfold.episodes import SummaryCheckpoint
from contextfold.integrations.langchain import CompactionMiddleware, LangChainSummarizer
from contextfold.stores import MemoryStore


class FakeToolModel(GenericFakeChatModel):
    """LangChain's fake chat model, accepting the agent's tools."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


def script() -> Any:
    """Read a file after each question, then answer, forever."""
    for n in itertools.count():
        yield AIMessage(
            "", tool_calls=[{"name": "read_file", "args": {"path": "src/retry.py"}, "id": f"call_{n}"}]
        )
        yield AIMessage("It retries 3 times, 2 s apart.")


@tool
def read_file(path: str) -> str:
    """Read a file of the repository."""
    return f"# {path}\n" + "ATTEMPTS = 3\nDELAY_S = 2\n" * 30


async def main() -> None:
    summaries = FakeToolModel(messages=itertools.repeat(AIMessage("## Facts and identifiers\nATTEMPTS = 3")))
    options = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_000))
    async with MemoryStore() as store:
        compactor = Compactor(store, options=options, summarizer=LangChainSummarizer(summaries))
        agent = create_agent(
            FakeToolModel(messages=script()),
            [read_file],
            middleware=[CompactionMiddleware(compactor)],
            checkpointer=InMemorySaver(),
        )
        config: Any = {"configurable": {"thread_id": "repo"}}
        for n in range(3):
            # A synchronous invoke, run in a worker thread here because this example is async.
            await anyio.to_thread.run_sync(
                lambda n=n: agent.invoke(
                    {"messages": [HumanMessage(f"How does retry.py retry? ({n})")]}, config
                )
            )
        for n in range(3, 6):
            state = await agent.ainvoke(
                {"messages": [HumanMessage(f"How does retry.py retry? ({n})")]}, config
            )
        folds = sum([isinstance(r.episode, SummaryCheckpoint) async for r in store.replay("repo")])
    print(f"last reply: {state['messages'][-1].text!r}")
    print(
        f"{folds} folds; the agent state now holds {len(state['messages'])} messages, "
        f"the first one the summary: {state['messages'][0].id.startswith('contextfold.summary:')}"
    )


if __name__ == "__main__":
    anyio.run(main)
