"""Summarizer calls per 100 steps on the two sessions where folds used to pile up.

* ``pinned``: a 4,500-token system prompt under an 8,000-token budget, 60
  steps. The head alone is over the 4,000-token target, so no fold can help;
  the compactor must say so instead of summarizing on every step.
* ``big_tools``: tool results of about 970 tokens under a 4,000-token budget,
  32 requests. Folds must be amortized: at most one per ``budget - target``
  tokens of growth.

Each session is run with the preset a user would write
(``SummarizeOptions(trigger_token_budget=...)``), on a MemoryStore with the
exact tiktoken counter and a summarizer that answers at once, so the figures
count policy decisions, not summarizer speed.

Run it:  python benchmarks/bench_policy.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import MemoryStore
from contextfold.summarizers import FunctionSummarizer
from contextfold.tokens import TiktokenCounter

BEFORE = {"pinned": 51 / 60 * 100, "big_tools": 24 / 32 * 100}
"""Summarizer calls per 100 steps before this policy, as measured on the previous release."""


@dataclass
class Outcome:
    name: str
    steps: int
    summarizer_calls: int
    folds: int
    stalls: int
    growth_tokens: int
    budget: int
    target: int
    peak_request: int

    @property
    def calls_per_100(self) -> float:
        return 100 * self.summarizer_calls / self.steps

    @property
    def allowed_folds(self) -> int:
        return self.growth_tokens // (self.budget - self.target) + 1


async def run_session(name: str, steps: int, budget: int, system_words: int, tool_words: int) -> Outcome:
    calls = 0

    async def summarize(messages: Sequence[Message], previous: str | None, limit: int) -> str:
        nonlocal calls
        calls += 1
        return f"{(previous or '')[:400]} + {len(messages)} messages about the task"

    counter = TiktokenCounter()
    options = RunOptions(
        max_history_tokens=budget * 4, compaction=SummarizeOptions(trigger_token_budget=budget)
    )
    target = budget // 2
    growth = folds = stalls = peak = 0
    async with MemoryStore() as store:
        compactor = Compactor(
            store, options=options, summarizer=FunctionSummarizer(summarize), counter=counter
        )
        if system_words:
            await compactor.append(
                name, [Message.system("You follow the house rules. " * (system_words // 5))]
            )
        for n in range(steps):
            call = ToolCall(id=f"c{n}", name="read_file", arguments=json.dumps({"path": f"src/m{n}.py"}))
            turn = [
                Message.user(f"step {n}: read src/m{n}.py and tell me what it does"),
                Message.assistant(None, tool_calls=[call]),
                Message.tool(call.id, f"src/m{n}.py line " * tool_words),
            ]
            growth += sum(counter.count(m) for m in turn)
            await compactor.append(name, turn)
            result = await compactor.maybe_compact(name)
            if result is not None:
                folds += result.compacted
                stalls += result.stalled
            _, tokens = await compactor.context_tokens(name)
            peak = max(peak, tokens)
    return Outcome(name, steps, calls, folds, stalls, growth, budget, target, peak)


async def main(quick: bool) -> list[Outcome]:
    scale = 4 if quick else 1
    return [
        await run_session("pinned", 60 // scale, 8_000, 4_500, 40),
        await run_session("big_tools", 32 // scale, 4_000, 0, 320),
    ]


def report(outcomes: list[Outcome]) -> None:
    print(
        "| session | steps | summarizer calls / 100 steps (before -> now) | folds | allowed folds | stalls |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for o in outcomes:
        print(
            f"| {o.name} | {o.steps} | {BEFORE[o.name]:.0f} -> {o.calls_per_100:.0f} | {o.folds} | "
            f"{o.allowed_folds} | {o.stalls} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a quarter of the steps (the test suite's smoke run)"
    )
    args = parser.parse_args()
    logging.getLogger("contextfold").setLevel(logging.ERROR)
    outcomes = anyio.run(main, args.quick)
    report(outcomes)
    for o in outcomes:
        assert o.folds <= o.allowed_folds, f"{o.name}: {o.folds} folds for {o.allowed_folds} allowed"
