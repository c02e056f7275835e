"""A simulated tool-using coding agent, for the demo and the benchmarks.

The session is deterministic for a seed: a user hands the agent tasks; for
each task the agent reads files, searches and runs tests through tools whose
outputs look like the real thing (listings, source, logs with ids and paths),
then answers. The model is a :class:`~contextfold.testing.ScriptedModel`
function, so the same session runs through the real ``StepLoop``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ._callables import closing
from ._compactor import CompactionResult
from ._episodes import conversation
from ._loop import StepLoop, Tool
from ._messages import Message, Role, ToolCall
from ._tokens import TokenCounter
from .testing import ScriptedModel

__all__ = ["DemoStats", "SimulatedAgent", "run_session"]

_MODULES = ["billing", "auth", "search", "ingest", "export", "scheduler", "gateway", "ledger"]
_VERBS = ["fix the flaky test in", "add retries to", "profile", "document", "refactor", "add metrics to"]


@dataclass
class _Task:
    module: str
    request: str
    actions: list[tuple[str, dict[str, object]]]
    done: int = 0


class SimulatedAgent:
    """Plays a coding agent: a model function and its tools, sharing one random stream.

    ``calls`` is how many tool calls the thread already holds: the agent's are
    numbered after them, so a continued thread repeats no call id.
    """

    def __init__(self, seed: int = 7, *, calls: int = 0) -> None:
        self.random = random.Random(seed)
        self._task: _Task | None = None
        self._calls = calls
        self.model = ScriptedModel(self._reply)

    def next_request(self) -> str:
        """The user's next task; the agent plans its tool calls for it."""
        rng = self.random
        module = rng.choice(_MODULES)
        ticket = f"CF-{rng.randint(1000, 9999)}"
        request = f"{ticket}: please {rng.choice(_VERBS)} the {module} module (src/{module}/core.py)."
        actions: list[tuple[str, dict[str, object]]] = [
            ("read_file", {"path": f"src/{module}/core.py"}),
            ("search", {"query": f"{module}_handler", "path": f"src/{module}"}),
        ]
        actions += [
            ("read_file", {"path": f"src/{module}/{rng.choice(['api', 'models', 'util'])}.py"})
            for _ in range(rng.randint(0, 2))
        ]
        actions.append(("run_tests", {"target": f"tests/test_{module}.py", "ticket": ticket}))
        self._task = _Task(module, request, actions)
        return request

    def _reply(self, messages: list[Message]) -> Message:
        task = self._task
        if task is None or task.done >= len(task.actions):
            module = task.module if task else "the project"
            return Message.assistant(
                f"Done: the change to {module} is in place and the tests pass. "
                f"Touched src/{module}/core.py; see the test run above for details."
            )
        name, arguments = task.actions[task.done]
        task.done += 1
        self._calls += 1
        call = ToolCall(id=f"call_{self._calls:05d}", name=name, arguments=json.dumps(arguments))
        return Message.assistant(f"Next I will {name.replace('_', ' ')}.", tool_calls=[call])

    def tools(self) -> dict[str, Tool]:
        rng = self.random

        async def read_file(path: str) -> str:
            lines = [f"# {path}", "from __future__ import annotations", ""]
            for n in range(rng.randint(25, 70)):
                lines.append(
                    f"def handler_{n}(request, retries={rng.randint(1, 5)}):  "
                    f"# owner: team-{rng.randint(1, 9)}, id {rng.getrandbits(32):08x}"
                )
                lines.append(f"    return process(request, timeout={rng.randint(1, 30)})")
            return "\n".join(lines)

        async def search(query: str, path: str) -> str:
            hits = [
                f"{path}/{rng.choice(['core', 'api', 'util'])}.py:{rng.randint(1, 400)}: "
                f"{query}(ctx, item_{rng.randint(1, 999)})"
                for _ in range(rng.randint(5, 20))
            ]
            return "\n".join(hits)

        async def run_tests(target: str, ticket: str) -> str:
            cases = rng.randint(20, 60)
            lines = [f"collected {cases} items ({ticket})"]
            lines += [
                f"{target}::test_case_{n} PASSED [{100 * (n + 1) // cases}%] in 0.{rng.randint(10, 99)}s"
                for n in range(cases)
            ]
            lines.append(f"===== {cases} passed in {rng.randint(2, 40)}.{rng.randint(0, 99)}s =====")
            return "\n".join(lines)

        return {"read_file": read_file, "search": search, "run_tests": run_tests}


@dataclass
class DemoStats:
    """What a simulated session measured, step by step."""

    requests: int = 0
    request_tokens: list[int] = field(default_factory=list)
    """Tokens of each request as sent, after compaction."""
    uncompacted_tokens: list[int] = field(default_factory=list)
    """Tokens each request would have had without compaction: the whole history, ``earlier_tokens`` too."""
    earlier_messages: int = 0
    """Messages the thread's log held before the session: a continued thread's history."""
    earlier_tokens: int = 0
    """Tokens of those messages."""
    compactions: list[CompactionResult] = field(default_factory=list)
    compaction_steps: list[int] = field(default_factory=list)
    """The step (1-based request number) at which each of ``compactions`` happened."""

    @property
    def summarizer_tokens(self) -> int:
        return sum(c.usage.total_tokens for c in self.compactions)

    @property
    def stalls(self) -> int:
        return sum(1 for c in self.compactions if c.stalled)


async def run_session(
    loop: StepLoop,
    thread: str,
    *,
    steps: int,
    counter: TokenCounter,
    seed: int = 7,
    system_prompt: str = "You are a careful coding agent. Use the tools; never guess file contents.",
    on_step: Callable[[int], None] | None = None,
    stop: Callable[[DemoStats], bool] | None = None,
) -> DemoStats:
    """Run a simulated session of about ``steps`` requests through ``loop``.

    A thread that already holds messages is continued: the system prompt goes
    only at the start of a new thread, and the history the log holds counts in
    every request "without compaction" (``DemoStats.earlier_tokens``).
    ``stop`` is asked after every step and ends the session early when it says so.
    """
    async with closing(loop.compactor.episodic.replay(thread)) as records:
        earlier = conversation([record async for record in records])
    agent = SimulatedAgent(seed, calls=sum(len(m.tool_calls) for m in earlier))
    stats = DemoStats(earlier_messages=len(earlier), earlier_tokens=sum(counter.count(m) for m in earlier))
    history_tokens = stats.earlier_tokens
    if not earlier:
        system = Message.system(system_prompt)
        await loop.append(thread, system)
        history_tokens += counter.count(system)
    tools = agent.tools()
    while stats.requests < steps:
        user = Message.user(agent.next_request())
        await loop.append(thread, user)
        history_tokens += counter.count(user)
        while stats.requests < steps:
            async with loop.step(thread) as step:
                stats.requests += 1
                stats.request_tokens.append(step.request_tokens)
                stats.uncompacted_tokens.append(history_tokens)
                if step.compaction is not None:
                    stats.compactions.append(step.compaction)
                    stats.compaction_steps.append(stats.requests)
                reply = await agent.model(step.messages)
                results = [
                    Message.tool(call.id, await tools[call.name](**call.parsed_arguments()))
                    for call in reply.tool_calls
                ]
                # The reply, each tool's run and its result: one transaction.
                await step.record(reply, *results, started=reply.tool_calls)
                history_tokens += sum(counter.count(m) for m in (reply, *results))
            if on_step is not None:
                on_step(stats.requests)
            if stop is not None and stop(stats):
                return stats
            if reply.role is Role.ASSISTANT and not reply.tool_calls:
                await loop.complete_run(thread)
                break
    return stats
