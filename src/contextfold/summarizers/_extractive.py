"""An offline, deterministic summarizer that keeps what a model would need verbatim.

It copies lines rather than writing prose: the user's requests and
constraints, decisions, identifiers (paths, ids, URLs, numbers) and
``key: value`` facts — from text, tool-call arguments and tool results alike —
and each tool call with the head of its result. Lines are ranked by value
(the user's identifiers first, then facts and identifiers from tool calls and
results), then round-robin over their kinds (a fact's key, a tool's name) so
that no one recurring kind fills the budget, newest first within each kind;
the summary keeps the best lines that fit ``max_summary_tokens``, so the
oldest low-value lines go first. Identifiers under one label or key are
written on one line (``read_file(path): a.py, b.py``) and compete one by one.
Every non-text part (an image, a file, audio) becomes a fact of its own, its
placeholder kept whole (``user attachment: [image: https://…/a.png]``), so
the summary still says what was shown and where to find it. It writes the
same sections as the model prompt, and reads a previous summary back by those
sections to merge with it. The work runs in a worker thread: it is the
default summarizer and the fallback, and a large fold takes a while.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import anyio.to_thread

from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._messages import Message, Role
from .._tokens import TiktokenCounter, TokenCounter, check_counter
from ._base import Summary
from ._parts import REASONING_PARTS, segments
from ._prompt import SECTIONS, cut_around, cut_middle, tool_names_of
from ._threads import Breather

__all__ = ["ExtractiveSummarizer", "find_identifiers"]

GOAL, DECISIONS, FACTS, TOOLS, OPEN = range(len(SECTIONS))

_URL = r"\b[a-z][a-z0-9+.-]*://[^\s<>\"'`)\]},;]+"
_VERSION = r"\bv\d+(?:\.\d+)+\b"
_EMAIL = r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b"
_ABS_PATH = r"(?<![\w/.])(?:~|\.{1,2})?/[\w.@+-]+(?:/[\w.@+-]+)*/?"
_REL_PATH = r"\b[\w.-]+(?:/[\w.@+-]+)+"
_FILE = r"\b[\w-]+(?:\.[\w-]+)*\.[A-Za-z][A-Za-z0-9]{0,7}\b(?=[^\w/]|$)"
_ID = r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9][\w-]*[A-Za-z0-9]\b"
_NUMBER = r"(?<![\w.])-?\d[\d,_]*(?:\.\d+)+(?![\w.])|(?<![\w.])-?\d{3,}(?:[,_]\d{3})*(?![\w.])"
_IDENTIFIER = re.compile(
    "|".join(f"(?:{p})" for p in (_URL, _EMAIL, _ABS_PATH, _REL_PATH, _VERSION, _ID, _NUMBER))
)
_FILENAME = re.compile(_FILE)
# Every identifier pattern needs a digit, a slash, a dot or an at sign: words without one are skipped.
_MAY_IDENTIFY = re.compile(r"[\d/.@]").search
_FILE_SUFFIXES = frozenset(
    "py js ts tsx jsx json yaml yml toml md txt csv tsv log sql rs go java kt c h cc cpp hpp sh cfg "
    "ini conf xml html css parquet lock env pdf png jpg zip gz tar db sqlite ipynb rb php swift".split()
)
# The key is taken possessively: a line of code fails at its first bracket instead of at every length.
_KEY_VALUE = re.compile(r"^\s*[-*•]?\s*\"?([A-Za-z][\w -]{0,39}+)\"?\s*[:=]\s*(\S.*?)\s*,?$")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_CONSTRAINT = re.compile(
    r"\b(must|never|always|only|do not|don't|dont|should not|shouldn't|avoid|without|at most|"
    r"at least|no more than|required?|constraint|deadline|before)\b",
    re.IGNORECASE,
)
_DECISION = re.compile(
    r"\b(decided?|decision|chose|choose|chosen|going to|we will|i will|i'll|we'll|switch(?:ed)? to|"
    r"instead|settled on|concluded?|root cause|the fix|approach|opted)\b",
    re.IGNORECASE,
)
_NEXT = re.compile(
    r"\b(next|todo|to do|remaining|still need|pending|follow[- ]up|not yet|then i|then we|after that|"
    r"open question|blocked)\b",
    re.IGNORECASE,
)
_WHITESPACE = re.compile(r"\s+")
_HEADING = re.compile(r"^\s*#{1,6}\s*(.+?)\s*#*\s*$")

_MAX_IDS_PER_MESSAGE = 16
_MAX_IDENTIFIER_CHARS = 400
_MAX_IDENTIFIERS_SCANNED = 64
_MAX_KEY_VALUE_LINE_CHARS = 500
_MAX_FACTS_PER_MESSAGE = 10
_OPEN_LINES_KEPT = 3
_COST_CACHE_SIZE = 32_768
_CHARS_PER_TOKEN = 4
"""The estimate where no tokenizer may be loaded: the headings are English and markdown."""
_ROOM_FOR_LINES = 64
"""Tokens past the headings advised for the first lines a summary keeps: the goal, a few identifiers."""
_ATTACHMENT = " attachment"
"""The end of the label of a fact that is a non-text part's placeholder."""
_BETWEEN_PLACEHOLDERS = re.compile(r"(?<=\]), (?=\[)")
_NOT_JSON: Any = object()
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of half a UTF-16 pair, which decodes to no character if it stands alone."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def _one_line(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip()


_SCAN_CHARS = 32_768
"""The most text one regex call of a summary scans.

A call holds the GIL until it returns (3 MB took 70-200 ms a pattern), and the
summary runs in a worker thread so that the event loop goes on meanwhile:
between calls it does. A longer text is read a piece at a time.
"""


def _cut_line(text: str, limit: int) -> str:
    """``cut_middle(_one_line(text), limit)``, with no regex pass over more of ``text`` than can show."""
    if len(text) <= _SCAN_CHARS:
        return cut_middle(_one_line(text), limit)
    head = _one_line(text[: 2 * limit])[: max(1, (limit * 2) // 3)]
    tail = _one_line(text[-2 * limit :])[len(head) - limit :] if limit > len(head) else ""
    return cut_around(head, tail, len(text))


def _sentences(text: str) -> Iterator[str]:
    """``_SENTENCE.split(text)``, split ``_SCAN_CHARS`` at most at a time (at a line's end where one is)."""
    start, end = 0, len(text)
    while end - start > _SCAN_CHARS:
        newline = text.rfind("\n", start, start + _SCAN_CHARS)
        cut = newline + 1 if newline > start else start + _SCAN_CHARS
        yield from _SENTENCE.split(text[start:cut])
        start = cut
    yield from _SENTENCE.split(text[start:end])


def find_identifiers(text: str, *, limit: int = _MAX_IDENTIFIERS_SCANNED) -> list[str]:
    """Paths, URLs, e-mail addresses, ids, file names and long numbers in ``text``, in order, once each.

    An identifier inside a longer one (the number in a path) is not repeated.
    Identifiers hold no whitespace, so the text is scanned word by word, and
    words too long to be one (a base64 blob) are skipped: the cost stays
    linear in the text. Scanning stops at the word where ``limit`` distinct
    identifiers have been seen.
    """
    return _identifiers_in(text.split(), limit)


def _identifiers_in(words: Iterable[str], limit: int) -> list[str]:
    """:func:`find_identifiers` over ``words``, read only as far as the ``limit``-th identifier."""
    found: dict[str, None] = {}
    scanned: set[str] = set()  # a word repeated (a log line's prefix) is scanned once
    for word in words:
        if len(word) > _MAX_IDENTIFIER_CHARS or word in scanned or not _MAY_IDENTIFY(word):
            continue
        scanned.add(word)
        for match in _IDENTIFIER.finditer(word):
            value = match.group(0).rstrip(".:")
            if len(value) >= 3:
                found.setdefault(value)
        for match in _FILENAME.finditer(word):
            if match.group(0).rsplit(".", 1)[-1].lower() in _FILE_SUFFIXES:
                found.setdefault(match.group(0))
        if len(found) >= limit:
            break
    # One substring search over the longer identifiers seen so far, instead of one per pair.
    kept: set[str] = set()
    longer = ""
    for value in sorted(found, key=len, reverse=True):
        if value not in longer:
            kept.add(value)
        longer += "\0" + value
    return [value for value in found if value in kept]


def _is_identifier(text: str) -> bool:
    """Whether ``text`` is one identifier and nothing more."""
    return bool(text) and len(text.split(None, 1)) == 1 and find_identifiers(text) == [text]


def _fact_priority(text: str) -> tuple[int, str | None, bool]:
    """How much a line of the facts section is worth, its label when it lists identifiers, and if bare.

    A bare list (``user: a, b``) holds identifiers seen in a message; a keyed
    one (``read_file(path): a.py, b.py``) a fact whose every value is one
    identifier, so the facts under one key are written on one line.

    What the user said ranks highest; then facts whose value holds an
    identifier, whether the assistant passed it to a tool or a tool returned
    it (a result holds what the agent cannot know otherwise), and identifiers
    the assistant passed to its tools; bare identifiers seen in tool output
    rank with decisions, as do facts whose value holds no identifier.
    Extraction and re-reading a previous summary both use this, so a line
    keeps its rank across merges.
    """
    label, colon, rest = text.partition(": ")
    if colon and label.endswith(_ATTACHMENT):  # what the user attached ranks with what the user said
        return (5 if label in ("user attachment", "system attachment") else 4), None, False
    if colon and label in ("user", "system"):
        return 5, label, True
    if colon and label.endswith(" arguments"):
        return 4, label, True
    if colon and (label == "assistant" or label.endswith(" result")):
        return 2, label, True
    if colon and all(_is_identifier(part) for part in rest.split(", ")):
        return 4, label, False
    return (4 if find_identifiers(rest if colon else text, limit=1) else 2), None, False


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, inner in enumerate(value[:_MAX_FACTS_PER_MESSAGE]):
            yield from _flatten(inner, f"{prefix}[{index}]")
    elif value is not None and value != "":
        yield prefix or "value", value if isinstance(value, str) else json.dumps(value)


def _decoded(text: str) -> Any:
    """``text`` decoded when it is a JSON object or array, else ``_NOT_JSON``.

    A lone escaped surrogate becomes U+FFFD: as it is, no store could encode
    the summary holding it. JSON nested deeper than the parser can follow is
    read as text.
    """
    stripped = text.strip()
    if stripped[:1] not in ("{", "["):
        return _NOT_JSON
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        return _NOT_JSON
    if _SURROGATE_ESCAPE.search(stripped):  # rare: pay for a second pass only then
        # json.loads has joined every whole pair, so any surrogate left stands alone.
        value = json.loads(_SURROGATE.sub("\ufffd", json.dumps(value, ensure_ascii=False)))
    return value


def _as_shown(text: str, decoded: Any) -> str:
    """``text``, or when it is JSON with ``\\u`` escapes, the same JSON with the characters they stand for."""
    if decoded is _NOT_JSON or "\\u" not in text:
        return text
    return json.dumps(decoded, ensure_ascii=False)


def _json_words(value: Any) -> Iterator[str]:
    """The words of decoded JSON's keys and values, in order: the text its escapes stood for.

    Lazy, so a scan that has found enough identifiers walks no further.
    """
    stack = [value]
    while stack:  # a loop, not recursion: the parser follows deeper nesting than Python calls can
        item = stack.pop()
        if isinstance(item, str):
            yield from item.split()
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                stack.append(inner)
                stack.append(key)
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, int | float) and not isinstance(item, bool):
            yield str(item)


def _key_values(text: str, decoded: Any) -> list[tuple[str, str]]:
    """``key: value`` pairs of decoded JSON, or of ``key: value`` / ``key=value`` lines of ``text``."""
    if decoded is not _NOT_JSON:
        try:
            return list(islice(_flatten(decoded), _MAX_FACTS_PER_MESSAGE))
        except RecursionError:  # nested deeper than the recursion _flatten can follow
            return []
    pairs: list[tuple[str, str]] = []
    for line in text.splitlines():
        if len(line) > _MAX_KEY_VALUE_LINE_CHARS:
            continue
        match = _KEY_VALUE.match(line)
        if match and not match.group(2).startswith("//"):
            pairs.append((match.group(1).strip(), match.group(2).strip().strip('"')))
            if len(pairs) == _MAX_FACTS_PER_MESSAGE:
                break
    return pairs


@dataclass(slots=True)
class _Line:
    section: int
    text: str
    priority: int
    order: int
    ids: tuple[str, ...] = ()
    """For a line of an identifier list, its one identifier; the lines of a label are written as one."""
    label: str = ""
    bare: bool = False
    """A bare identifier list's identifier is left out when a line kept earlier holds it."""


def _kind(line: _Line) -> tuple[int, str]:
    """What a line is one of: a fact's label or key, a tool's name, or its section."""
    if line.section == FACTS:
        return FACTS, line.label or line.text.partition(": ")[0]
    if line.section == TOOLS:
        return TOOLS, line.text.partition("(")[0]
    return line.section, ""


def _ranked(lines: list[_Line]) -> list[_Line]:
    """The lines best first: by priority, then round-robin over their kinds, newest first within each.

    Without the round-robin the kind that recurs most (the path every
    ``read_file`` call carries) would fill the budget with its newest lines
    and push out rarer kinds of the same priority. A line repeated word for
    word counts once, and only the newest open tasks are candidates at all.
    """
    newest_first = sorted(lines, key=lambda ln: -ln.order)
    seen: set[str] = set()
    repeats: Counter[tuple[int, str]] = Counter()
    open_lines = 0
    keyed: list[tuple[int, int, int, int, _Line]] = []
    for line in newest_first:
        if line.section == OPEN:
            open_lines += 1
            if open_lines > _OPEN_LINES_KEPT:
                continue
        if line.text in seen:
            continue
        seen.add(line.text)
        kind = _kind(line)
        # Sections before age: re-reading a summary renumbers its lines section by section.
        keyed.append((-line.priority, repeats[kind], line.section, -line.order, line))
        repeats[kind] += 1
    keyed.sort(key=lambda item: item[:4])
    return [item[4] for item in keyed]


class ExtractiveSummarizer:
    """Summarizes without a model: deterministic, offline, and within ``max_summary_tokens``.

    ``counter`` measures the budget (exact ``TiktokenCounter`` by default).
    Lines are cut to ``max_line_chars`` characters, and a tool result's head
    to ``result_head_chars``.
    """

    model = "extractive"

    def __init__(
        self,
        counter: TokenCounter | None = None,
        *,
        max_line_chars: int = 240,
        result_head_chars: int = 160,
    ) -> None:
        if isinstance(max_line_chars, bool) or not isinstance(max_line_chars, int) or max_line_chars < 40:
            raise ConfigError(
                "max_line_chars", "must be at least 40 characters, for example 240", value=max_line_chars
            )
        if (
            isinstance(result_head_chars, bool)
            or not isinstance(result_head_chars, int)
            or (result_head_chars < 0)
        ):
            raise ConfigError(
                "result_head_chars", "must be a whole number >= 0, for example 160", value=result_head_chars
            )
        if counter is not None:
            check_counter(counter)
        self._counter = counter
        self.max_line_chars = max_line_chars
        self.result_head_chars = result_head_chars
        # A summary's lines come back in the next merge: each is tokenized once, not at every merge.
        self._costs: dict[str, int] = {}
        self._last: tuple[str, int] = ("", 0)

    @property
    def counter(self) -> TokenCounter:
        if self._counter is None:
            self._counter = TiktokenCounter()
        return self._counter

    def __repr__(self) -> str:
        return f"ExtractiveSummarizer(counter={self._counter!r})"

    def least_summary_tokens(self) -> int:
        """The smallest ``max_summary_tokens`` this summarizer can write to: its section headings alone.

        Estimated at four characters a token, so no tokenizer is loaded (a
        ``Compactor`` asks when it is built, perhaps on the event loop). The
        first fold measures the headings exactly; a size below them is a
        :class:`SummarizerError` there.
        """
        return -(-_skeleton_chars() // _CHARS_PER_TOKEN)

    def advised_summary_tokens(self) -> int:
        """The least ``max_summary_tokens`` with room for a few lines beside the section headings."""
        return self.least_summary_tokens() + _ROOM_FOR_LINES

    def check_summary_room(self, max_summary_tokens: int, *, key: str = "max_summary_tokens") -> None:
        """Refuse a summary size below :meth:`least_summary_tokens`, at which every fold would fail.

        ``key`` names the option as it was given. A ``Compactor`` makes the
        same check when it is built, in words that fit how it was configured
        (a preset's ``max_summary_tokens``, or a strategy's target or the
        fallback when the size is derived from triggers and strategies).
        """
        least = self.least_summary_tokens()
        if max_summary_tokens >= least:
            return
        advised = self.advised_summary_tokens()
        raise ConfigError(
            key,
            f"is below the {least} tokens the extractive summarizer needs for its section headings alone, "
            f"so every fold would fail; give it {advised} or more, room for a few lines beside them "
            f"(unset, it is half of target_tokens, by default a quarter of trigger_token_budget: a budget "
            f"of {4 * advised} or more), or pass a summarizer that writes shorter summaries, such as a "
            "FunctionSummarizer",
            value=max_summary_tokens,
        )

    async def summarize(
        self,
        messages: Sequence[Message],
        *,
        previous_summary: str | None,
        max_summary_tokens: int,
    ) -> Summary:
        """The best lines of ``previous_summary`` and ``messages`` that fit ``max_summary_tokens``.

        The work is done in a worker thread, so the event loop keeps running.
        """
        if (
            isinstance(max_summary_tokens, bool)
            or not isinstance(max_summary_tokens, int)
            or (max_summary_tokens <= 0)
        ):
            raise ConfigError(
                "max_summary_tokens",
                "must be a positive token count, for example 1024",
                value=max_summary_tokens,
            )
        return await anyio.to_thread.run_sync(
            self._summarize, tuple(messages), previous_summary, max_summary_tokens
        )

    def _summarize(
        self, messages: Sequence[Message], previous_summary: str | None, max_summary_tokens: int
    ) -> Summary:
        lines = self._parse_previous(previous_summary or "")
        for message in messages:
            if message.is_summary:
                lines.extend(self._parse_previous(message.text, start=len(lines)))
        lines.extend(self._extract(messages, start=len(lines)))
        skeleton = self._cost(self._render([]))
        if skeleton > max_summary_tokens:  # cutting would leave "" or a stub of a heading
            raise SummarizerError(
                f"extractive summarizer: max_summary_tokens={max_summary_tokens} cannot hold even the "
                f"section headings ({skeleton} tokens); give it at least {skeleton + _ROOM_FOR_LINES}"
            )
        text = self._select(lines, max_summary_tokens)
        counter = self.counter
        input_tokens = sum(counter.count(m) for m in messages)
        if previous_summary:
            input_tokens += self._count_summary(previous_summary)
        return Summary(
            text=text,
            model=self.model,
            usage=Usage(input_tokens=input_tokens, output_tokens=self._count_summary(text)),
        )

    def _count_summary(self, text: str) -> int:
        """Tokens of a summary; the last one written is usually the next call's previous summary."""
        if self._last[0] != text:
            self._last = (text, self.counter.count_text(text))
        return self._last[1]

    def _cost(self, text: str) -> int:
        cost = self._costs.get(text)
        if cost is None:
            if len(self._costs) >= _COST_CACHE_SIZE:
                self._costs.clear()
            cost = self._costs[text] = self.counter.count_text(text)
        return cost

    # reading ---------------------------------------------------------------

    def _head(self, text: str) -> str:
        return _one_line(text[: self.result_head_chars * 4])[: self.result_head_chars]

    def _line(self, section: int, text: str, priority: int, order: int) -> _Line:
        return _Line(section, _cut_line(text, self.max_line_chars), priority, order)

    def _fact(self, text: str, order: int, *, most: int | None = None) -> list[_Line]:
        """One line for a fact; for a list of identifiers one line per identifier (the first ``most``).

        The identifiers under one label are candidates one by one and are
        written back as one line, ``label: a, b, c``.
        """
        priority, label, bare = _fact_priority(text)
        owner, _, rest = text.partition(": ")
        if owner.endswith(_ATTACHMENT):  # placeholders are kept whole (their URL is the point), one row each
            pieces = [_one_line(piece) for piece in _BETWEEN_PLACEHOLDERS.split(rest) if piece.strip()]
            return [
                _Line(FACTS, f"{owner}: {piece}", priority, order + index, (piece,), owner)
                for index, piece in enumerate(pieces)
            ]
        if label is None:
            return [self._line(FACTS, text, priority, order)]
        ids = [part.strip() for part in text.partition(": ")[2].split(", ") if part.strip()]
        return [
            _Line(FACTS, f"{label}: {one}", priority, order + index, (one,), label, bare)
            for index, one in enumerate(ids[:most])
        ]

    def _fact_lines(
        self,
        label: str,
        text: str,
        order: int,
        *,
        key_prefix: str | None = None,
        decoded: Any = None,
    ) -> list[_Line]:
        """``key: value`` facts, then one line listing the identifiers those facts do not hold.

        With ``key_prefix`` (a tool's name) facts are written ``tool(key): value``.
        Text that is JSON is read decoded (``decoded``, when the caller has
        it): ``"gr\\u00f6\\u00dfe"`` is ``größe``, not an id ``u00f6``.
        """
        if decoded is None:
            decoded = _decoded(text)
        out: list[_Line] = []
        held = ""
        for key, value in _key_values(text, decoded):
            shown = f"{key_prefix}({key})" if key_prefix else key
            if _fact_priority(f"{shown}: x")[2]:  # a key such as "user" must not read as a label
                shown = f"'{shown}'"
            lines = self._fact(f"{shown}: {value}", order)
            out.extend(lines)
            held += "".join(line.text + "\n" for line in lines)
        # Enough for the identifiers one message lists, past those its facts already hold.
        words = text.split() if decoded is _NOT_JSON else _json_words(decoded)
        found = _identifiers_in(words, _MAX_IDS_PER_MESSAGE + 2 * len(out))
        ids = [i for i in found if i not in held]
        if ids:
            out.extend(self._fact(f"{label}: {', '.join(ids)}", order, most=_MAX_IDS_PER_MESSAGE))
        return out

    def _extract(self, messages: Sequence[Message], start: int) -> list[_Line]:
        names = tool_names_of(messages)
        results = {m.tool_call_id: m.text for m in messages if m.role is Role.TOOL and m.tool_call_id}
        decoded_results: dict[str, Any] = {}  # a result is decoded once, for its head and its facts

        def result_head(text: str) -> str:
            if "\\u" in text[: self.result_head_chars * 4]:
                decoded = decoded_results[text] = _decoded(text)
                text = _as_shown(text, decoded)
            return self._head(text)

        first_goal = start == 0
        out: list[_Line] = []
        breathe = Breather()
        for offset, message in enumerate(messages):
            breathe()
            order = start + offset
            text = message.text
            if message.is_summary:
                continue
            if isinstance(message.content, list):
                owner = message.role.value
                if message.role is Role.TOOL:
                    owner = f"{names.get(message.tool_call_id or '') or 'tool'} result"
                for is_text, piece in segments(message):
                    if not is_text and piece.strip("[]").partition(":")[0] not in REASONING_PARTS:
                        out.extend(self._fact(f"{owner}{_ATTACHMENT}: {piece}", order))
            if message.role is Role.USER or message.role is Role.SYSTEM:
                if message.role is Role.USER and text.strip():
                    priority = 5 if first_goal else 2
                    first_goal = False
                    out.append(self._line(GOAL, f"{message.role.value}: {text}", priority, order))
                for sentence in _sentences(text):
                    if _CONSTRAINT.search(sentence) and len(sentence) > 12:
                        out.append(self._line(GOAL, sentence, 3, order))
                ids = find_identifiers(text)
                if ids:  # the user's own words: identifiers only, the sentence is in the goal section
                    out.extend(self._fact(f"{message.role.value}: {', '.join(ids)}", order))
            elif message.role is Role.ASSISTANT:
                for sentence in _sentences(text):
                    if _NEXT.search(sentence):
                        out.append(self._line(OPEN, sentence, 2, order))
                    elif _DECISION.search(sentence):
                        out.append(self._line(DECISIONS, sentence, 2, order))
                out.extend(self._fact_lines("assistant", text, order))
                for call in message.tool_calls:
                    decoded = _decoded(call.arguments)
                    arguments = _cut_line(_as_shown(call.arguments, decoded), self.max_line_chars // 2)
                    head = result_head(results.get(call.id, ""))
                    shown = f"{call.name}({arguments})"
                    out.append(self._line(TOOLS, f"{shown} -> {head}" if head else shown, 1, order))
                    out.extend(
                        self._fact_lines(
                            f"{call.name} arguments",
                            call.arguments,
                            order,
                            key_prefix=call.name,
                            decoded=decoded,
                        )
                    )
            else:
                name = names.get(message.tool_call_id or "")
                if name is None:
                    head = result_head(text)
                    out.append(self._line(TOOLS, f"result of call {message.tool_call_id}: {head}", 1, order))
                decoded = decoded_results.get(text)
                out.extend(self._fact_lines(f"{name or 'tool'} result", text, order, decoded=decoded))
        # One order per line, as when the summary is read back: of two lines, the later is newer.
        for index, line in enumerate(out):
            line.order = start + index
        return out

    def _parse_previous(self, summary: str, start: int = 0) -> list[_Line]:
        """The lines of a previous summary, each in its section, ranked as when first written."""
        out: list[_Line] = []
        section = FACTS
        seen_goal = start > 0
        known = {heading.lower(): index for index, heading in enumerate(SECTIONS)}
        breathe = Breather()
        for raw in summary.splitlines():
            breathe()
            heading = _HEADING.match(raw)
            if heading:
                section = known.get(heading.group(1).lower(), FACTS)
                continue
            text = raw.strip()
            if text.startswith(("- ", "* ")):
                text = text[2:].strip()
            if not text or text.lower() == "none":
                continue
            order = start + len(out)
            if section == GOAL:  # the first request is the goal; other requests rank below constraints
                priority = 5 if not seen_goal else 2 if text.startswith(("user: ", "system: ")) else 3
                seen_goal = True
            elif section == FACTS:
                out.extend(self._fact(text, order))
                continue
            elif section == TOOLS:
                priority = 1
            else:
                priority = 2
            out.append(_Line(section, cut_middle(text, self.max_line_chars), priority, order))
        return out

    # writing -----------------------------------------------------------------

    def _select(self, lines: list[_Line], budget: int) -> str:
        count = self.counter.count_text
        ranked = _ranked(lines)
        used = self._cost(self._render([]))
        chosen: list[_Line] = []
        kept_ids: set[str] = set()
        labels: set[str] = set()
        breathe = Breather()
        for line in ranked:
            breathe()
            if used >= budget:  # every line costs a token at least
                break
            if line.bare and line.ids[0] in kept_ids:
                continue
            # An identifier joins its label's line when one is already written.
            if line.label in labels:
                cost = self._cost(f", {line.ids[0]}")
            else:
                cost = self._cost(f"- {line.text}\n") + 1
            if used + cost > budget:
                continue
            used += cost
            chosen.append(line)
            if line.label:
                labels.add(line.label)
            if line.section == FACTS:  # other sections may be dropped first, so facts repeat their ids
                kept_ids.update(line.ids or find_identifiers(line.text))
        text = self._render(chosen)
        # Joined text can tokenize a little differently from its lines: drop the lowest-ranked until it fits.
        while chosen and count(text) > budget:
            chosen.pop()
            text = self._render(chosen)
        while text and count(text) > budget:
            text = text[: max(0, len(text) * 3 // 4)].rstrip()
        return text

    @staticmethod
    def _render(chosen: list[_Line]) -> str:
        blocks: list[str] = []
        for index, heading in enumerate(SECTIONS):
            section = sorted((ln for ln in chosen if ln.section == index), key=lambda ln: ln.order)
            # A label's identifiers form one row, placed where its oldest one is.
            rows: dict[tuple[bool, str], list[str]] = {}
            for ln in section:
                if ln.label:
                    rows.setdefault((True, ln.label), []).append(ln.ids[0])
                else:
                    rows[False, ln.text] = []
            body = (
                "\n".join(
                    f"- {row}: {', '.join(ids)}" if listed else f"- {row}"
                    for (listed, row), ids in rows.items()
                )
                or "- none"
            )
            blocks.append(f"## {heading}\n{body}")
        return "\n\n".join(blocks)


@functools.cache
def _skeleton_chars() -> int:
    """The length of a summary of no lines: its section headings (asked at every fold)."""
    return len(ExtractiveSummarizer._render([]))
