"""How many planted facts survive a long session: summarizing compaction against a sliding window.

A synthetic, seeded tool-using session (2,000 messages by default) carries
100 planted facts — ids, paths and numbers — spread evenly through user
turns, tool results, tool-call arguments and the URLs of images the user
attaches, among realistic noise (file paths, test names, URLs, counts). It
is fed step by step through the real ``Compactor`` on a ``MemoryStore``
twice, at the same token budget:

* ``summarize``: dropped turns are folded by the offline ``ExtractiveSummarizer``;
* ``drop``: a plain sliding window; it keeps the tokens the summary would take
  as extra recent history, so both working contexts are the same size.

It prints the share of the facts still present in the final working context
for each (and of the attached images, named by their placeholder), and the
summarizer's input over the run: every token it was sent (the dropped
messages and the previous summary), divided by the tokens of all messages of
the session, next to what re-summarizing the whole dropped history at each
compaction would have cost.

Run it:  python benchmarks/bench_summary_retention.py [--messages 2000] [--facts 100] [--budget 8000]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from contextfold import Compactor, Message, RunOptions, SummarizeOptions, ToolCall
from contextfold.stores import MemoryStore
from contextfold.summarizers import ExtractiveSummarizer, Summarizer, Summary
from contextfold.summarizers._prompt import content_text
from contextfold.tokens import TiktokenCounter, TokenCounter

WORDS = (
    "alpha beta gamma delta ledger invoice refund payout shard replica index cache queue worker "
    "schema migration tenant region bucket export report metric latency budget quota"
).split()


@dataclass(frozen=True)
class Session:
    """The messages, grouped into the steps they are appended in, and the facts planted in them."""

    steps: list[list[Message]]
    facts: list[str]

    @property
    def messages(self) -> list[Message]:
        return [message for step in self.steps for message in step]

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the images attached in the session, each a planted fact too."""
        return [
            part["image_url"]["url"]
            for message in self.messages
            if isinstance(message.content, list)
            for part in message.content
            if part.get("type") == "image_url"
        ]


def _fact(rng: random.Random, index: int) -> str:
    kind = index % 3
    if kind == 0:
        return f"{rng.choice(['TCK', 'ORD', 'INV', 'CASE'])}-{rng.randrange(10**6, 10**7)}"
    if kind == 1:
        return f"/mnt/archive/{rng.choice(WORDS)}/{rng.choice(WORDS)}-{rng.randrange(10**5, 10**6)}.parquet"
    return str(rng.randrange(10**8, 10**9))


def _noise_result(rng: random.Random, tool: str, n: int) -> str:
    if tool == "read_file":
        lines = [f"def {rng.choice(WORDS)}_{n}_{i}(x):" for i in range(rng.randrange(6, 14))]
        body = "\n".join(
            f"{line}\n    return x * {rng.randrange(2, 9)}  # {rng.choice(WORDS)}" for line in lines
        )
        return body
    if tool == "run_tests":
        passed = rng.randrange(20, 90)
        failed = rng.randrange(0, 3)
        return (
            f"collected {passed + failed} items\n"
            + "\n".join(
                f"tests/test_{rng.choice(WORDS)}.py::test_{rng.choice(WORDS)} PASSED" for _ in range(8)
            )
            + f"\n{passed} passed, {failed} failed in {rng.randrange(1, 60)}.{rng.randrange(10, 99)}s"
        )
    if tool == "search":
        return "\n".join(
            f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py:{rng.randrange(1, 999)}: {rng.choice(WORDS)}"
            for _ in range(rng.randrange(4, 10))
        )
    return json.dumps(
        {
            "id": f"item-{n}",
            "status": rng.choice(["ok", "pending", "stale"]),
            "owner": rng.choice(WORDS),
            "items": [rng.choice(WORDS) for _ in range(6)],
        }
    )


def _arguments(rng: random.Random, tool: str, n: int) -> dict[str, object]:
    if tool == "read_file":
        return {"path": f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{n}.py"}
    if tool == "run_tests":
        return {"target": f"tests/test_{rng.choice(WORDS)}.py", "verbose": True}
    if tool == "search":
        return {"query": f"{rng.choice(WORDS)} {rng.choice(WORDS)}"}
    return {"url": f"https://api.internal.example/v2/items/{n}"}


def build_session(messages: int, facts: int, seed: int = 20260101) -> Session:
    """A deterministic session of exactly ``messages`` messages with ``facts`` planted facts."""
    rng = random.Random(seed)
    planted: list[str] = []
    while len(planted) < facts:
        candidate = _fact(rng, len(planted))
        if candidate not in planted:
            planted.append(candidate)
    # Fact i goes into the first step that starts at or after its slot.
    slots = [int((i + 0.5) * messages / max(1, facts)) for i in range(facts)]
    steps: list[list[Message]] = [[Message.system("You are a data engineering agent. Work carefully.")]]
    count = 1
    n = 0
    next_fact = 0
    tools = ["read_file", "run_tests", "search", "http_get"]
    while count < messages:
        due = next_fact < facts and count >= slots[next_fact]
        fact = planted[next_fact] if due else None
        where = next_fact % 4 if due else -1
        if due:
            next_fact += 1
        if where == 3:  # an image the user attaches, known only by its URL
            url = f"https://files.example.com/scans/{fact}.png"
            image = {"type": "image_url", "image_url": {"url": url}}
            text_part = {"type": "text", "text": f"Here is the scan for step {n}."}
            steps.append([Message(role="user", content=[text_part, image])])
            count += 1
            n += 1
            continue
        if n % 6 == 0 or where == 0:
            text = f"Next, look at the {rng.choice(WORDS)} {rng.choice(WORDS)} step {n}."
            if where == 0:
                text += f" Keep this for later: the reference is {fact}."
            steps.append([Message.user(text)])
            count += 1
            if where == 0 or count >= messages:
                n += 1
                continue
        tool = rng.choice(tools)
        arguments = _arguments(rng, tool, n)
        result = _noise_result(rng, tool, n)
        if where == 1:
            arguments = {**arguments, "reference": fact}
        if where == 2:
            result += f"\nchecksum: {fact}"
        call = ToolCall(id=f"call_{n}", name=tool, arguments=json.dumps(arguments))
        step = [Message.assistant(f"Running {tool} for step {n}.", tool_calls=[call])]
        step.append(Message.tool(call.id, result))
        if rng.random() < 0.5:
            step.append(Message.assistant(f"Step {n} looks {rng.choice(['fine', 'odd', 'done'])}."))
        steps.append(step[: messages - count])
        count += len(steps[-1])
        n += 1
    session = Session(steps, planted[:next_fact])
    texts = [_visible(m) for m in session.messages]
    for fact in session.facts:
        assert sum(fact in text for text in texts) == 1, f"fact {fact} must be planted exactly once"
    return session


def _visible(message: Message) -> str:
    """What a model reads of a message: its text, placeholders for its images, and its tool calls."""
    return "\n".join([content_text(message), *(f"{c.name} {c.arguments}" for c in message.tool_calls)])


class CountingSummarizer:
    """Passes calls through, counting with ``counter`` the tokens each one was sent."""

    def __init__(self, inner: Summarizer, counter: TokenCounter) -> None:
        self.inner = inner
        self.counter = counter
        self.calls = 0
        self.message_tokens = 0
        self.previous_tokens = 0
        self.sent: Counter[str] = Counter()

    async def summarize(
        self, messages: Sequence[Message], *, previous_summary: str | None, max_summary_tokens: int
    ) -> Summary:
        self.calls += 1
        self.message_tokens += sum(self.counter.count(m) for m in messages)
        if previous_summary:
            self.previous_tokens += self.counter.count_text(previous_summary)
        self.sent.update(m.model_dump_json() for m in messages)
        return await self.inner.summarize(
            messages, previous_summary=previous_summary, max_summary_tokens=max_summary_tokens
        )


@dataclass(frozen=True)
class Outcome:
    mode: str
    retained: int
    facts: int
    images_retained: int
    images: int
    context_tokens: int
    compactions: int
    summarizer: CountingSummarizer | None
    from_scratch_tokens: int

    @property
    def retention(self) -> float:
        return self.retained / self.facts if self.facts else 1.0


async def run(session: Session, mode: str, budget: int, summary_tokens: int) -> Outcome:
    """Feed ``session`` step by step through a Compactor and measure its final working context."""
    counter = TiktokenCounter()
    target = budget // 2
    if mode == "summarize":
        compaction = SummarizeOptions(
            trigger_token_budget=budget, target_tokens=target, max_summary_tokens=summary_tokens
        )
    else:
        compaction = SummarizeOptions(
            trigger_token_budget=budget, target_tokens=target + summary_tokens, mode="drop"
        )
    options = RunOptions(max_history_tokens=budget, compaction=compaction)
    counting = CountingSummarizer(ExtractiveSummarizer(counter), counter) if mode == "summarize" else None
    compactions = 0
    from_scratch = 0
    async with MemoryStore() as store:
        compactor = Compactor(store, options=options, summarizer=counting, counter=counter)
        for step in session.steps:
            await compactor.append("bench", step)
            result = await compactor.maybe_compact("bench")
            if result is not None and result.compacted:
                compactions += 1
                if counting is not None:  # re-summarizing from scratch re-sends everything dropped so far
                    from_scratch += counting.message_tokens
        context = await compactor.context("bench")
    text = "\n".join(_visible(m) for m in context)
    return Outcome(
        mode=mode,
        retained=sum(fact in text for fact in session.facts),
        facts=len(session.facts),
        images_retained=sum(f"[image: {url}]" in text for url in session.image_urls),
        images=len(session.image_urls),
        context_tokens=sum(counter.count(m) for m in context),
        compactions=compactions,
        summarizer=counting,
        from_scratch_tokens=from_scratch,
    )


async def main_async(messages: int, facts: int, budget: int, summary_tokens: int) -> dict[str, Outcome]:
    session = build_session(messages, facts)
    counter = TiktokenCounter()
    total = sum(counter.count(m) for m in session.messages)
    outcomes = {mode: await run(session, mode, budget, summary_tokens) for mode in ("summarize", "drop")}
    print(
        f"session: {len(session.messages):,} messages, {total:,} tokens, {len(session.facts)} planted facts; "
        f"budget {budget:,} tokens (summary up to {summary_tokens:,})"
    )
    print(
        f"{'approach':<34} {'facts kept':>10} {'share':>7} {'images kept':>12} {'final context':>14} "
        f"{'compactions':>12}"
    )
    labels = {"summarize": "compaction + ExtractiveSummarizer", "drop": "sliding window (drop)"}
    for mode, outcome in outcomes.items():
        print(
            f"{labels[mode]:<34} {outcome.retained:>4}/{outcome.facts:<5} {outcome.retention:>7.0%} "
            f"{outcome.images_retained:>6}/{outcome.images:<5} {outcome.context_tokens:>14,} "
            f"{outcome.compactions:>12}"
        )
    counting = outcomes["summarize"].summarizer
    if counting is not None and total:
        sent = counting.message_tokens + counting.previous_tokens
        print(
            f"summarizer input: {sent:,} tokens over {counting.calls} calls = {sent / total:.2f} x the "
            f"session's message tokens ({counting.message_tokens / total:.2f} x from dropped messages, "
            f"{counting.previous_tokens / total:.2f} x from previous summaries); "
            f"most times one message was sent: {max(counting.sent.values(), default=0)}"
        )
        scratch = outcomes["summarize"].from_scratch_tokens
        print(f"re-summarizing the whole dropped history each time would send {scratch / total:.1f} x")
    return outcomes


def main(argv: Sequence[str] | None = None) -> dict[str, Outcome]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages in the session")
    parser.add_argument("--facts", type=int, default=100, help="facts planted in it")
    parser.add_argument(
        "--budget", type=int, default=8000, help="trigger token budget of the working context"
    )
    parser.add_argument("--summary-tokens", type=int, default=1024, help="max_summary_tokens")
    args = parser.parse_args(argv)
    return anyio.run(main_async, args.messages, args.facts, args.budget, args.summary_tokens)


if __name__ == "__main__":
    main()
