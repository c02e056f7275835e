"""Drive an ``AsyncAnthropic`` model with contextfold's step loop: tool schemas sent, model and usage logged.

``contextfold.integrations.anthropic.chat_llm`` turns an ``AsyncAnthropic``
client into the model callable that ``StepLoop.run`` drives (``llm.stream``
for ``StepLoop.stream``). The client here talks to a fake Messages endpoint
served on 127.0.0.1, so this runs offline; pass a real client and
model name to talk to Anthropic.

Run it:  python examples/anthropic_chat_llm.py   (needs contextfold[anthropic])
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
from anthropic import AsyncAnthropic

from contextfold import Compactor, RunOptions, StepLoop, SummarizeOptions
from contextfold.episodes import LlmCallEpisode, SummaryCheckpoint
from contextfold.integrations.anthropic import chat_llm
from contextfold.stores import MemoryStore

CALL_IDS = itertools.count(1)


def reply(body: dict[str, Any]) -> dict[str, Any]:
    """The fake model: call read_file once per question, then answer."""
    turns = body["messages"]
    last = turns[-1]["content"]
    if isinstance(last, list) and last[-1].get("type") == "tool_result":
        content = [{"type": "text", "text": "It retries 3 times, 2 s apart."}]
    else:
        content = [
            {
                "type": "tool_use",
                "id": f"toolu_{next(CALL_IDS)}",
                "name": "read_file",
                "input": {"path": "src/retry.py"},
            }
        ]
    return {
        "id": "msg",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": content,
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 20 * len(turns), "output_tokens": 12},
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


async def read_file(path: str) -> str:
    """Read a file of the repository."""
    return f"# {path}\n" + "ATTEMPTS = 3\nDELAY_S = 2\n" * 30


async def main() -> None:
    client = AsyncAnthropic(api_key="sk-fake", base_url=serve())
    options = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_000))
    tools = {"read_file": read_file}
    async with MemoryStore() as store:
        loop = StepLoop(Compactor(store, options=options))
        llm = chat_llm(client, "claude-sonnet-4-5", tools=tools, max_tokens=1024)
        for n in range(6):
            result = await loop.run("repo", f"How does retry.py retry? ({n})", llm=llm, tools=tools)
        episodes = [record.episode async for record in store.replay("repo")]
    calls = [episode for episode in episodes if isinstance(episode, LlmCallEpisode)]
    folds = sum(isinstance(episode, SummaryCheckpoint) for episode in episodes)
    print(f"last reply: {result.reply.text!r}")
    print(
        f"{len(calls)} model calls logged, model {calls[-1].model!r}, "
        f"{sum(c.usage.total_tokens for c in calls if c.usage)} tokens used, {folds} folds"
    )


if __name__ == "__main__":
    anyio.run(main)
