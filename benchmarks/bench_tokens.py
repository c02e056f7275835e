"""Token counting costs: per message as history grows, and exact counting against raw tiktoken.

Run it with ``python benchmarks/bench_tokens.py`` (``--help`` lists the options).

(a) A step loop counts only the message it appends and keeps a running total.
    The cost of that per message must not grow with the history: the median
    per-message cost at the largest size is compared with the smallest.
(b) Counting one new (uncached) message exactly must stay within 1.5x of
    tiktoken's own ``encode_ordinary`` of the same text (every text the
    message carries: content, tool names and arguments, call id); both run
    side by side, batch by batch, over the same messages.
(c) A message carrying a ~150 KB base64 PNG: its count under each provider's
    image rule against what counting its JSON text would say, and the cost
    of counting it the first time and again (a cache hit).

Every figure is a median over repetitions; sizes and repetitions interleave so
that drift on the machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from functools import partial

from contextfold import Message, ToolCall
from contextfold._tokens import EncodingName, load_encoding
from contextfold.tokens import ApproximateCounter, TiktokenCounter

GROWTH_LIMIT = 1.5
"""Largest accepted ratio of per-message cost at the largest history size to the smallest."""

EXACT_LIMIT = 1.5
"""Largest accepted ratio of exact counting of a new message to raw tiktoken encoding of its text."""

BATCH = 10
"""Messages timed together, so that timer overhead is small next to the work measured."""

SENTENCES = [
    "Let me look at the failing test and the stack trace it prints.",
    "The function returns None when the cache is cold, which the caller does not expect.",
    "Running `pytest -q tests/test_store.py::test_replace_prefix` now; it took 0.42s last time.",
    "日本語の説明: キャッシュが空のときに None を返します。",
    '{"path": "src/app/handlers.py", "line": 118, "error": "KeyError: \'user_id\'"}',
    "Sure — I'll refactor the handler, add a regression test, and re-run the suite. 🚀",
]


def message_text(serial: int, sentences: int) -> str:
    """A distinct text of about ``sentences`` sentences; ``serial`` makes it unique, so it is never cached."""
    picked = [SENTENCES[(serial + n) % len(SENTENCES)] for n in range(sentences)]
    return f"[{serial}] " + " ".join(picked)


def history(size: int, start: int = 0, sentences: int = 4) -> list[Message]:
    """``size`` distinct messages cycling through user, assistant-with-call and tool-result turns."""
    messages: list[Message] = []
    for serial in range(start, start + size):
        text = message_text(serial, sentences)
        kind = serial % 3
        if kind == 0:
            messages.append(Message.user(text))
        elif kind == 1:
            call = ToolCall(
                id=f"call_{serial}", name="read_file", arguments=f'{{"path": "src/m{serial}.py"}}'
            )
            messages.append(Message.assistant(text, tool_calls=[call]))
        else:
            messages.append(Message.tool(f"call_{serial - 1}", text))
    return messages


def growing_history_ns(size: int, first: int, count: Callable[[Message], int]) -> list[float]:
    """Per-message cost of appending ``size`` new messages one at a time with a running total.

    Like a step loop, each message is built just before it is counted (the
    building is not timed); the counter's state is all that grows.
    """
    costs: list[float] = []
    total = 0
    clock = time.perf_counter_ns
    for start in range(first, first + size - BATCH + 1, BATCH):
        batch = history(BATCH, start=start)
        began = clock()
        for message in batch:
            total += count(message)
        costs.append((clock() - began) / BATCH)
    if total < 0:  # keeps the running total observable
        raise AssertionError(total)
    return costs


def count_all(counter: TiktokenCounter, messages: Sequence[Message]) -> list[int]:
    return [counter.count(m) for m in messages]


def growth(sizes: Sequence[int], repeat: int, encoding: EncodingName) -> dict[str, dict[int, float]]:
    """Median per-message cost of a growing history, per counter and size."""
    results: dict[str, dict[int, list[float]]] = {"tiktoken": {}, "approximate": {}}
    for rep in range(repeat):
        for size in sizes:
            for name, counter in (
                ("tiktoken", TiktokenCounter(encoding)),
                ("approximate", ApproximateCounter()),
            ):
                counter.count_messages(history(50, start=2 * 10**9))  # warm up, then measure new messages
                costs = growing_history_ns(size, (rep + 1) * 10**7, counter.count)
                results[name].setdefault(size, []).append(statistics.median(costs))
    return {
        name: {size: statistics.median(v) for size, v in by_size.items()} for name, by_size in results.items()
    }


def texts_of(message: Message) -> list[str]:
    """Every text a message carries: its content, each call's name and arguments, its call id and name."""
    texts = [message.text]
    for call in message.tool_calls:
        texts += [call.name, call.arguments]
    texts += [t for t in (message.tool_call_id, message.name) if t]
    return texts


def encode_all(encode: Callable[[str], list[int]], texts: Sequence[list[str]]) -> list[int]:
    return [len(encode(t)) for ts in texts for t in ts]


def exact_versus_raw(
    sentence_counts: Sequence[int], messages: int, repeat: int, encoding: EncodingName
) -> dict[int, tuple[float, float, int]]:
    """Median ns per message for exact counting and for raw ``encode_ordinary`` of its texts, and the length.

    The two sides alternate batch by batch over the same messages, so machine
    noise lands on both; each repetition uses new messages and a new counter,
    so every counted message is new to the cache.
    """
    encode = load_encoding(encoding).encode_ordinary
    clock = time.perf_counter_ns

    def raw(message: Message) -> int:
        return sum(len(encode(text)) for text in texts_of(message))

    out: dict[int, tuple[float, float, int]] = {}
    for sentences in sentence_counts:
        ours: list[float] = []
        theirs: list[float] = []
        lengths: list[int] = []
        for rep in range(repeat):
            first = (rep + 1) * 10**6 + sentences * 10**5
            batch = history(messages, start=first, sentences=sentences)
            # An identical twin built separately: raw tiktoken gets fresh string objects too, so
            # neither side finds a hash or a UTF-8 form the other side already computed.
            twin = [texts_of(m) for m in history(messages, start=first, sentences=sentences)]
            lengths += [sum(len(t) for t in texts) for texts in twin]
            counter = TiktokenCounter(encoding)
            raw(Message.user("warm up"))
            counter.count(Message.user("warm up"))
            for start in range(0, messages - BATCH + 1, BATCH):
                group = batch[start : start + BATCH]
                group_texts = twin[start : start + BATCH]
                sides = (
                    (ours, partial(count_all, counter, group)),
                    (theirs, partial(encode_all, encode, group_texts)),
                )
                for sink, run in sides if start // BATCH % 2 == 0 else reversed(sides):
                    began = clock()
                    run()
                    sink.append((clock() - began) / BATCH)
            if counter.misses != 1 + messages - messages % BATCH:
                raise AssertionError("every measured message must have been new to the cache")
        out[sentences] = (statistics.median(ours), statistics.median(theirs), int(statistics.median(lengths)))
    return out


def png(width: int, height: int, noise_bytes: int) -> bytes:
    """A valid RGB PNG of ``width`` x ``height`` whose first rows are noise, about ``noise_bytes`` in all."""
    rows = max(1, min(height, noise_bytes // (3 * width)))
    raw = random.Random(0).randbytes(rows * 3 * width) + bytes(3 * width * (height - rows))
    lines = b"".join(b"\x00" + raw[y * 3 * width : (y + 1) * 3 * width] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(lines))
        + chunk(b"IEND", b"")
    )


def image_costs(repeat: int, encoding: EncodingName) -> list[tuple[str, int, int, float, float]]:
    """Per rule: tokens of the image part, tokens of its JSON text, first and cached count in us."""
    data = base64.b64encode(png(1000, 700, 150_000)).decode()
    out: list[tuple[str, int, int, float, float]] = []
    for rule in ("openai", "anthropic"):
        firsts: list[float] = []
        hits: list[float] = []
        tokens = 0
        for rep in range(repeat):
            counter = TiktokenCounter(encoding, image_rule=rule)
            counter.count(Message.user("warm up"))
            text = {"type": "text", "text": f"what is in this picture? ({rep})"}
            image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
            message = Message(role="user", content=[text, image])
            began = time.perf_counter_ns()
            tokens = counter.count(message)
            firsts.append((time.perf_counter_ns() - began) / 1000)
            tokens -= counter.count(Message(role="user", content=[text]))
            began = time.perf_counter_ns()
            counter.count(message)
            hits.append((time.perf_counter_ns() - began) / 1000)
        as_json = TiktokenCounter(encoding).count_text(json.dumps(image))
        out.append((rule, tokens, as_json, statistics.median(firsts), statistics.median(hits)))
    return out


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        default="100,100000",
        help="comma-separated history sizes for (a); the first and last are compared (default: 100,100000)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per measurement (default: 5)")
    parser.add_argument(
        "--messages", type=int, default=2000, help="distinct messages per repetition in (b) (default: 2000)"
    )
    parser.add_argument(
        "--sentences",
        default="1,4,16",
        help="comma-separated message lengths for (b), in sentences of about 70 characters (default: 1,4,16)",
    )
    parser.add_argument("--encoding", choices=["o200k_base", "cl100k_base"], default="o200k_base")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a limit is exceeded")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.sentences = [int(s) for s in args.sentences.split(",")]
    if min(args.sizes) < BATCH or args.messages < BATCH or args.repeat < 1:
        parser.error(f"sizes and --messages must be at least {BATCH}, --repeat at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    within = True
    print(f"contextfold token counting benchmark ({args.encoding}, medians of {args.repeat} repetitions)")

    print("\n(a) growing history, counting only the appended message, per-message median")
    smallest, largest = args.sizes[0], args.sizes[-1]
    for name, by_size in growth(args.sizes, args.repeat, args.encoding).items():
        cells = "  ".join(f"{size:>7,} msgs: {ns / 1000:7.2f} us" for size, ns in by_size.items())
        ratio = by_size[largest] / by_size[smallest]
        ok = ratio <= GROWTH_LIMIT
        within &= ok
        print(
            f"  {name:<12} {cells}  ratio {largest:,}/{smallest:,} = {ratio:.2f} ({'ok' if ok else 'OVER'})"
        )

    print(
        f"\n(b) exact count of one new message vs raw tiktoken encode_ordinary of its texts "
        f"({args.messages} messages per repetition; TiktokenCounter counts with "
        f"{TiktokenCounter(args.encoding).backend})"
    )
    for ours, theirs, length in exact_versus_raw(
        args.sentences, args.messages, args.repeat, args.encoding
    ).values():
        ratio = ours / theirs
        ok = ratio <= EXACT_LIMIT
        within &= ok
        print(
            f"  ~{length:>5} chars: count {ours / 1000:7.2f} us  encode_ordinary {theirs / 1000:7.2f} us"
            f"  ratio {ratio:.2f} ({'ok' if ok else 'OVER'}, limit {EXACT_LIMIT})"
        )

    print("\n(c) a message with a ~150 KB base64 PNG (1000x700), by image rule")
    for rule, tokens, as_json, first, hit in image_costs(args.repeat, args.encoding):
        print(
            f"  {rule:<10} image {tokens:>5,} tokens (its JSON text: {as_json:,}, {as_json / tokens:.0f}x)"
            f"  first count {first:8.1f} us  cached {hit:6.1f} us"
        )
    return 1 if args.check and not within else 0


if __name__ == "__main__":
    sys.exit(main())
