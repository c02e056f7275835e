"""Per-step latency with a 2-second summarizer, with and without background folding.

A loopback HTTP server in its own process (as a real summarizer is) answers
OpenAI chat completions after sleeping ``--summary-seconds`` (2 s by default),
and ``OpenAICompatibleSummarizer`` talks to it. One thread runs ``--steps``
steps; each step appends a turn, awaits ``maybe_compact`` and reads the
context, then spends ``--agent-seconds`` in the agent's own model call. The
step overhead (check + context) is timed per step in three runs of the same
session, side by side: with a budget no step reaches (the no-op check, the
baseline), with the summary in the step, and with
``SummarizeOptions(background_at=0.8)``. The folding runs must summarize each
message once and lose none.

Run it:  python benchmarks/bench_background.py [--steps 300] [--summary-seconds 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise

import anyio

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall, conversation
from contextfold.episodes import SummaryCheckpoint
from contextfold.stores import MemoryStore
from contextfold.summarizers import OpenAICompatibleSummarizer
from contextfold.tokens import TiktokenCounter


@contextmanager
def slow_openai_server(delay: float) -> Iterator[str]:
    """A chat-completions endpoint on 127.0.0.1 that takes ``delay`` seconds per request."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", 0))
            request = json.loads(self.rfile.read(length))
            time.sleep(delay)
            chars = len(json.dumps(request["messages"]))
            body = json.dumps(
                {
                    "id": "bench",
                    "object": "chat.completion",
                    "model": request["model"],
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": f"Summary of {chars} characters."},
                        }
                    ],
                    "usage": {
                        "prompt_tokens": chars // 4,
                        "completion_tokens": 8,
                        "total_tokens": chars // 4 + 8,
                    },
                }
            ).encode()
            try:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a summary still under way when its compactor closed was cancelled

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def summarizer_process(delay: float) -> Iterator[str]:
    """``slow_openai_server`` in a child process, so its threads never compete for this one's GIL."""
    command = [sys.executable, __file__, "--serve", str(delay)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            url = child.stdout.readline().strip()
            if not url.startswith("http://"):
                raise RuntimeError(f"the summarizer process did not start (it printed {url!r})")
            yield url
        finally:
            child.terminate()


def serve(delay: float) -> int:
    with slow_openai_server(delay) as url:
        print(url, flush=True)
        threading.Event().wait()
    return 0


@dataclass
class Run:
    label: str
    overheads: list[float]
    folds: int
    messages: int
    logged: int
    summarized_once: bool

    def percentile(self, q: float) -> float:
        ordered = sorted(self.overheads)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def turn(n: int) -> list[Message]:
    call = ToolCall(id=f"c{n}", name="read_file", arguments=json.dumps({"path": f"src/m{n}.py"}))
    return [
        Message.user(f"step {n}: what does src/m{n}.py do?"),
        Message.assistant(None, tool_calls=[call]),
        Message.tool(call.id, f"src/m{n}.py: " + "def f(): return 1\n" * 20),
    ]


async def session(
    url: str, steps: int, agent_seconds: float, budget: int | None, background_at: float | None, label: str
) -> Run:
    """One thread stepped ``steps`` times; ``budget=None`` is a budget no step reaches."""
    trigger = budget if budget is not None else 10**9
    options = RunOptions(
        max_history_tokens=trigger * 4,
        compaction=SummarizeOptions(trigger_token_budget=trigger, background_at=background_at),
    )
    counter = TiktokenCounter()
    overheads: list[float] = []
    folds = 0
    async with (
        MemoryStore() as store,
        OpenAICompatibleSummarizer(
            "bench-summarizer", base_url=url, api_key="bench", timeout=30
        ) as summarizer,
        Compactor(store, options=options, summarizer=summarizer, counter=counter) as compactor,
    ):
        for n in range(steps):
            await compactor.append("t", turn(n))
            started = time.perf_counter()
            result = await compactor.maybe_compact("t")
            await compactor.context("t")
            overheads.append(time.perf_counter() - started)
            folds += result is not None and result.compacted
            await anyio.sleep(agent_seconds)  # the agent's own model call
        log = [r async for r in store.replay("t")]
    checkpoints = [r.episode for r in log if isinstance(r.episode, SummaryCheckpoint)]
    ranges = [(c.from_seq, c.through_seq) for c in checkpoints]
    once = all(a[1] < b[0] for a, b in pairwise(ranges))
    return Run(label, overheads, folds, 3 * steps, len(conversation(log)), once)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--summary-seconds", type=float, default=2.0)
    parser.add_argument("--agent-seconds", type=float, default=0.3)
    parser.add_argument("--budget", type=int, default=8_000, help="trigger_token_budget")
    parser.add_argument("--serve", type=float, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve)
    library = logging.getLogger("contextfold")
    level = library.level
    library.setLevel(logging.ERROR)  # restored below: a test calls main() in its own process
    try:
        with summarizer_process(args.summary_seconds) as url:
            steps, agent_seconds = args.steps, args.agent_seconds
            noop = anyio.run(
                session, url, steps, agent_seconds, None, None, "no-op check (budget never reached)"
            )
            runs = [
                noop,
                anyio.run(session, url, steps, agent_seconds, args.budget, None, "summary in the step"),
                anyio.run(session, url, steps, agent_seconds, args.budget, 0.8, "background_at=0.8"),
            ]
    finally:
        library.setLevel(level)
    print(f"{args.steps} steps, summarizer {args.summary_seconds:g} s, agent call {args.agent_seconds:g} s")
    print("step overhead = maybe_compact + context, timed per step")
    print(
        "| run | folds | p50 | p99 | max | p99 / no-op p99 | p99 / no-op p50 "
        "| messages kept in the log | summarized once |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    base50, base99 = noop.percentile(0.5), noop.percentile(0.99)
    for r in runs:
        p50, p99, worst = r.percentile(0.5), r.percentile(0.99), max(r.overheads)
        print(
            f"| {r.label} | {r.folds} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {worst * 1e3:.1f} ms "
            f"| {p99 / base99:.1f}x | {p99 / base50:.1f}x | {r.logged}/{r.messages} | {r.summarized_once} |"
        )
    ok = all(r.logged == r.messages and r.summarized_once for r in runs) and noop.folds == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
