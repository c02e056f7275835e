"""Give an OpenAI Agents SDK agent a session that compacts before every model call.

``CompactingSession`` is an Agents SDK ``Session`` over a contextfold store;
its ``model_input_filter`` (``RunConfig(call_model_input_filter=...)``)
records what each model call is about to send, folds when the budget is
reached, and sends the working context instead, so requests stay small
within one long ``Runner.run`` too. The agent's model talks to a fake Chat
Completions endpoint served on 127.0.0.1, so this runs offline.

Run it:  python examples/openai_agents_session.py   (needs contextfold[openai-agents])
"""

from __future__ import annotations

import itertools
import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openai import AsyncOpenAI

from contextfold import Compactor, RunOptions, SummarizeOptions
from contextfold.episodes import SummaryCheckpoint
from contextfold.integrations.openai_agents import CompactingSession
from contextfold.stores import SQLiteStore

SENT: list[int] = []
"""Characters of each request the fake model received."""


CALL_IDS = itertools.count(1)


def reply(body: dict[str, Any]) -> dict[str, Any]:
    """The fake model: call read_file once per question, then answer."""
    messages = body["messages"]
    SENT.append(len(json.dumps(messages)))
    if messages[-1]["role"] == "tool":
        message = {"role": "assistant", "content": "It retries 3 times, 2 s apart."}
    else:
        call = {
            "id": f"call_{next(CALL_IDS)}",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "src/retry.py"}'},
        }
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "gpt-4o-mini-fake",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 20 * len(messages), "completion_tokens": 12, "total_tokens": 0},
    }


class FakeAPI(BaseHTTPRequestHandler):
    """A stand-in for the provider's endpoint on 127.0.0.1, answering with ``reply``."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = json.dumps(reply(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def serve() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"


@function_tool
def read_file(path: str) -> str:
    """Read a file of the repository."""
    return f"# {path}\n" + "ATTEMPTS = 3\nDELAY_S = 2\n" * 30


async def main() -> None:
    client = AsyncOpenAI(api_key="sk-fake", base_url=serve() + "/v1")
    model = OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=client)
    agent = Agent(name="repo", instructions="Answer from the files.", tools=[read_file], model=model)
    options = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_500))
    with tempfile.TemporaryDirectory() as folder:
        async with SQLiteStore(Path(folder) / "agent.db") as store:
            session = CompactingSession("repo", Compactor(store, options=options))
            config = RunConfig(call_model_input_filter=session.model_input_filter, tracing_disabled=True)
            for n in range(6):
                result = await Runner.run(
                    agent, f"How does retry.py retry? ({n})", session=session, run_config=config
                )
            folds = sum([isinstance(r.episode, SummaryCheckpoint) async for r in store.replay("repo")])
    print(f"last reply: {result.final_output!r}")
    print(f"{len(SENT)} model calls, {folds} folds, largest request {max(SENT)} characters")


if __name__ == "__main__":
    anyio.run(main)
