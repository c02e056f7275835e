"""Drive an ``AsyncOpenAI`` model with contextfold's step loop: tool schemas sent, model and usage logged.

``contextfold.integrations.openai.chat_llm`` turns an ``AsyncOpenAI`` client
into the model callable that ``StepLoop.run`` drives (``llm.stream`` for
``StepLoop.stream``). The client here talks to a fake Chat Completions
endpoint served on 127.0.0.1, so this runs offline; pass a real
client and model name to talk to OpenAI.

Run it:  python examples/openai_chat_llm.py   (needs contextfold[openai])
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
from openai import AsyncOpenAI

from contextfold import Compactor, RunOptions, StepLoop, SummarizeOptions
from contextfold.episodes import LlmCallEpisode, SummaryCheckpoint
from contextfold.integrations.openai import chat_llm
from contextfold.stores import MemoryStore

CALL_IDS = itertools.count(1)


def reply(body: dict[str, Any]) -> dict[str, Any]:
    """The fake model: call read_file once per question, then answer."""
    messages = body["messages"]
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


async def read_file(path: str) -> str:
    """Read a file of the repository."""
    return f"# {path}\n" + "ATTEMPTS = 3\nDELAY_S = 2\n" * 30


async def main() -> None:
    client = AsyncOpenAI(api_key="sk-fake", base_url=serve() + "/v1")
    options = RunOptions(max_history_tokens=4_000, compaction=SummarizeOptions(trigger_token_budget=1_000))
    tools = {"read_file": read_file}
    async with MemoryStore() as store:
        loop = StepLoop(Compactor(store, options=options))
        llm = chat_llm(client, "gpt-4o-mini", tools=tools)
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
