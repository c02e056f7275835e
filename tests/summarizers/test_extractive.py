"""The offline extractive summarizer: what it keeps, its budget, determinism and incremental merging."""

from __future__ import annotations

import base64
import gc
import json
import re
import struct
import time
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextfold.summarizers._extractive as extractive
from contextfold import ConfigError, Message, SummarizerError, ToolCall
from contextfold.summarizers import ExtractiveSummarizer, Summarizer
from contextfold.summarizers._extractive import find_identifiers
from contextfold.summarizers._prompt import SECTIONS
from contextfold.tokens import TiktokenCounter

COUNTER = TiktokenCounter()


def call(call_id: str, name: str, **arguments: object) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=json.dumps(arguments))


SESSION = [
    Message.user("Migrate the billing service to Postgres 16. You must never touch /etc/prod/secrets.yaml."),
    Message.assistant(
        "I decided to start with the schema. Next I will check the replica.",
        tool_calls=[call("c1", "read_file", path="/srv/billing/config/db.toml")],
    ),
    Message.tool("c1", "host: db-7.internal\nport: 5432\nreplicas = 3"),
    Message.assistant(
        None, tool_calls=[call("c2", "http_get", url="https://status.example.com/api/v2/db-7")]
    ),
    Message.tool("c2", '{"status": "degraded", "incident": "INC-48213"}'),
]


async def summarize(
    messages: list[Message],
    previous: str | None = None,
    budget: int = 1000,
    summarizer: ExtractiveSummarizer | None = None,
) -> str:
    summary = await (summarizer or ExtractiveSummarizer(COUNTER)).summarize(
        messages, previous_summary=previous, max_summary_tokens=budget
    )
    return summary.text


async def test_writes_the_fixed_sections_in_order() -> None:
    """The summary has the prompt's five sections, in the prompt's order."""
    text = await summarize(SESSION)
    positions = [text.index(f"## {heading}") for heading in SECTIONS]
    assert positions == sorted(positions)


async def test_keeps_identifiers_found_only_in_tool_call_arguments() -> None:
    """A path and a URL that appear only in tool-call arguments are in the summary's facts."""
    text = await summarize(SESSION)
    facts = text.split("## Facts and identifiers")[1].split("## ")[0]
    assert "/srv/billing/config/db.toml" in facts
    assert "https://status.example.com/api/v2/db-7" in facts


async def test_keeps_requests_constraints_facts_and_tool_heads() -> None:
    """User requests, constraints, decisions, key: value facts and tool names with result heads survive."""
    text = await summarize(SESSION)
    assert "Migrate the billing service to Postgres 16" in text
    assert "- You must never touch /etc/prod/secrets.yaml." in text
    assert "- I decided to start with the schema." in text
    assert "- Next I will check the replica." in text.split("## Open tasks and next step")[1]
    for fact in ("host: db-7.internal", "port: 5432", "replicas: 3", "incident: INC-48213"):
        assert f"- {fact}" in text
    assert 'read_file({"path": "/srv/billing/config/db.toml"}) -> host: db-7.internal' in text


async def test_reports_the_extractive_model_and_the_tokens_it_read() -> None:
    """Usage counts the messages and previous summary read, and the summary written."""
    summary = await ExtractiveSummarizer(COUNTER).summarize(
        SESSION, previous_summary="earlier notes", max_summary_tokens=800
    )
    assert summary.model == "extractive"
    assert summary.usage.input_tokens == sum(COUNTER.count(m) for m in SESSION) + COUNTER.count_text(
        "earlier notes"
    )
    assert summary.usage.output_tokens == COUNTER.count_text(summary.text)


async def test_is_deterministic() -> None:
    """The same input gives the same summary, from one instance or two."""
    first = await summarize(SESSION, budget=120)
    assert await summarize(SESSION, budget=120) == first
    assert await summarize(SESSION, budget=120, summarizer=ExtractiveSummarizer(TiktokenCounter())) == first


async def test_incremental_merge_keeps_every_old_fact_when_there_is_room() -> None:
    """Updating a summary with new messages keeps all of its facts when the budget allows."""
    first = await summarize(SESSION[:3])
    later = [Message.user("The order id is ord_99812; deploy to eu-west-3 by 17:00.")]
    second = await summarize(later, previous=first, budget=2000)
    for identifier in find_identifiers(first):
        assert identifier in second
    assert "ord_99812" in second and "eu-west-3" in second
    assert second.count("## Facts and identifiers") == 1


async def test_a_tight_budget_drops_the_oldest_low_value_lines_first() -> None:
    """Under pressure old tool-result heads go before newer ones, and facts outlast both."""
    messages: list[Message] = []
    for n in range(12):
        messages.append(Message.assistant(None, tool_calls=[call(f"c{n}", "run_step")]))
        messages.append(Message.tool(f"c{n}", f"step {n} finished without trouble"))
    messages.append(Message.user("Remember: build id BLD-77123 and artifact s3://bucket/rel/app-9.tar.gz"))
    text = await summarize(messages, budget=170)
    assert COUNTER.count_text(text) <= 170
    assert "BLD-77123" in text and "s3://bucket/rel/app-9.tar.gz" in text
    kept_steps = [n for n in range(12) if f"step {n} finished" in text]
    assert kept_steps, "some tool heads should fit"
    assert kept_steps == list(range(12 - len(kept_steps), 12)), "the newest tool heads are the ones kept"


async def test_facts_from_the_previous_summary_outrank_new_low_value_lines() -> None:
    """An old identifier survives a merge that must drop lines, while new tool heads are dropped."""
    previous = await summarize([Message.user("The customer is cust_5512 at /data/cust_5512/export.csv")])
    noise = [
        Message.assistant("Checking.", tool_calls=[call("n", "noop")]),
        Message.tool("n", "nothing " * 40),
    ]
    text = await summarize(noise, previous=previous, budget=110)
    assert "/data/cust_5512/export.csv" in text
    assert COUNTER.count_text(text) <= 110


async def test_a_summary_message_among_the_input_is_merged_like_a_previous_summary() -> None:
    """A summary passed as a message is read back by its sections rather than quoted whole."""
    earlier = await summarize(SESSION[:3])
    summary_message = Message.user(earlier, metadata={"contextfold.summary": True})
    text = await summarize([summary_message, Message.user("also ord_1234")])
    assert text.count("## Goal and constraints") == 1
    assert "/srv/billing/config/db.toml" in text and "ord_1234" in text


@pytest.mark.parametrize("budget", [0, -5])
async def test_a_non_positive_budget_is_a_config_error(budget: int) -> None:
    """``max_summary_tokens`` must be positive."""
    with pytest.raises(ConfigError) as caught:
        await summarize(SESSION, budget=budget)
    assert caught.value.key == "max_summary_tokens"


def test_bad_options_fail_at_construction() -> None:
    """Line and head sizes are checked when the summarizer is built."""
    with pytest.raises(ConfigError, match="max_line_chars"):
        ExtractiveSummarizer(max_line_chars=5)
    with pytest.raises(ConfigError, match="result_head_chars"):
        ExtractiveSummarizer(result_head_chars=-1)


def test_a_summary_size_below_the_section_headings_is_refused_by_check_summary_room() -> None:
    """check_summary_room (the Compactor calls it when built) names the key, the size, the least, the fix."""
    summarizer = ExtractiveSummarizer()
    least = summarizer.least_summary_tokens()
    with pytest.raises(ConfigError) as caught:
        summarizer.check_summary_room(25, key="compaction.max_summary_tokens")
    assert caught.value.key == "compaction.max_summary_tokens" and caught.value.value == 25
    message = str(caught.value)
    assert message.startswith(
        f"compaction.max_summary_tokens=25: is below the {least} tokens the extractive summarizer needs "
        "for its section headings alone, so every fold would fail; give it 105 or more"
    )
    assert "a budget of 420 or more" in message and "such as a FunctionSummarizer" in message
    summarizer.check_summary_room(least)


async def test_the_least_summary_size_is_what_the_section_headings_take() -> None:
    """At its least the summarizer writes every heading; one token less and it cannot write a summary."""
    summarizer = ExtractiveSummarizer()
    least = summarizer.least_summary_tokens()
    summary = await summarizer.summarize(SESSION, previous_summary=None, max_summary_tokens=least)
    assert all(f"## {heading}" in summary.text for heading in SECTIONS)
    with pytest.raises(SummarizerError, match="cannot hold even the section headings"):
        await summarizer.summarize(SESSION, previous_summary=None, max_summary_tokens=least - 1)


def test_satisfies_the_protocol() -> None:
    """The extractive summarizer is a Summarizer."""
    assert isinstance(ExtractiveSummarizer(), Summarizer)


def test_find_identifiers_finds_paths_urls_ids_and_numbers_once() -> None:
    """Identifiers are found in order, and one inside a longer one is not repeated."""
    text = "see /a/b/c-2.py and src/x/y.py v1.2.3, 12, 1234, 0x9f3a22, ab12-cd, https://x.io/a?b=1. main.py"
    assert find_identifiers(text) == [
        "/a/b/c-2.py",
        "src/x/y.py",
        "v1.2.3",
        "1234",
        "0x9f3a22",
        "ab12-cd",
        "https://x.io/a?b=1",
        "main.py",
    ]


def test_find_identifiers_stops_at_the_limit() -> None:
    """With ``limit`` the scan ends at the word where that many identifiers were seen."""
    assert find_identifiers("ab12 cd34 ab12 ef56 gh78", limit=2) == ["ab12", "cd34"]
    assert find_identifiers("ab12 cd34 ab12 ef56 gh78") == ["ab12", "cd34", "ef56", "gh78"]


_words = st.text(alphabet="abcdefgh /:._-0123456789\n", min_size=0, max_size=120)
_message = st.one_of(
    _words.map(Message.user),
    _words.map(Message.assistant),
    st.tuples(st.text(alphabet="abcxyz_", min_size=1, max_size=8), _words).map(
        lambda p: Message.assistant(
            None, tool_calls=[ToolCall(id="t", name=p[0], arguments=json.dumps({"a": p[1]}))]
        )
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(_message, max_size=12),
    previous=st.one_of(st.none(), _words),
    budget=st.integers(41, 400),
)
async def test_never_exceeds_the_budget(messages: list[Message], previous: str | None, budget: int) -> None:
    """Whatever the input, the summary fits ``max_summary_tokens`` and holds every section heading."""
    text = await summarize(messages, previous=previous, budget=budget)
    assert COUNTER.count_text(text) <= budget
    assert all(f"## {heading}" in text for heading in SECTIONS)


@settings(max_examples=40, deadline=None)
@given(path=st.from_regex(r"/[a-z]{2,8}/[a-z0-9_]{2,8}/[a-z0-9]{2,8}\.(json|log|csv)", fullmatch=True))
async def test_an_argument_path_survives_whenever_the_budget_allows(path: str) -> None:
    """A path passed only as a tool argument is kept even under a small budget."""
    messages = [
        Message.user("please look around"),
        Message.assistant(None, tool_calls=[call("a", "open", target=path)]),
        Message.tool("a", "opened " + "blah " * 50),
    ]
    text = await summarize(messages, budget=90)
    assert path in text


async def test_a_huge_unbroken_blob_does_not_hide_the_identifiers_around_it() -> None:
    """A megabyte of base64-like text is skipped as one word; the ids next to it are still kept."""
    blob = "".join("Ab3+/x.9-" for _ in range(120_000))
    result = f"wrote /srv/out/report-77.json\n{blob}\nchecksum: 5f1e09a7c3"
    messages = [Message.assistant(None, tool_calls=[call("b", "export")]), Message.tool("b", result)]
    text = await summarize(messages, budget=300)
    assert "/srv/out/report-77.json" in text and "checksum: 5f1e09a7c3" in text
    assert COUNTER.count_text(text) <= 300


async def test_ranks_survive_a_round_trip_through_the_summary_text() -> None:
    """Re-reading a summary ranks each line as when it was written, so merging is stable."""
    summarizer = ExtractiveSummarizer(COUNTER)
    first = await summarize(SESSION, summarizer=summarizer)
    extracted = summarizer._select(summarizer._extract(SESSION, 0), 1000)
    assert extracted == first
    reread = summarizer._parse_previous(first)
    assert summarizer._select(reread, 1000) == first
    for budget in (60, 120, 200):
        assert summarizer._select(reread, budget) == summarizer._select(
            summarizer._extract(SESSION, 0), budget
        )


async def test_a_result_key_named_like_a_label_is_quoted() -> None:
    """A tool result's ``user`` key is not mistaken for the user's own words."""
    messages = [
        Message.assistant(None, tool_calls=[call("w", "whoami")]),
        Message.tool("w", '{"user": "u-4411"}'),
    ]
    text = await summarize(messages)
    assert "- 'user': u-4411" in text


def _reads(count: int) -> list[Message]:
    messages: list[Message] = []
    for n in range(count):
        read = call(f"r{n}", "read_file", path=f"src/pkg/mod_{n}.py")
        messages.append(Message.assistant(None, tool_calls=[read]))
        messages.append(Message.tool(f"r{n}", "ok"))
    return messages


async def test_a_recurring_kind_of_fact_does_not_crowd_out_a_rarer_one() -> None:
    """An old result fact outlives newer facts of a kind that recurs, which take turns with it instead."""
    build = [
        Message.assistant(None, tool_calls=[call("b", "build")]),
        Message.tool("b", "artifact: BLD-40917"),
    ]
    text = await summarize(build + _reads(30), budget=160)
    assert "artifact: BLD-40917" in text
    kept = [n for n in range(30) if f"src/pkg/mod_{n}.py" in text]
    assert 0 < len(kept) < 30
    assert kept == list(range(30 - len(kept), 30)), "the newest of the recurring kind are kept"


async def test_facts_under_one_key_are_written_on_one_line_and_read_back_one_by_one() -> None:
    """Identifier values sharing a key share a line, and a tighter merge keeps the newest of them."""
    text = await summarize(_reads(4))
    assert "- read_file(path): src/pkg/mod_0.py, src/pkg/mod_1.py, src/pkg/mod_2.py, src/pkg/mod_3.py" in text
    previous = "## Facts and identifiers\n- checksum: 5f1e09a7c3, 6a2b77c1d0, 7c3d88e2f1, 8d4e99f3a2"
    whole = await summarize([], previous=previous)
    assert "- checksum: 5f1e09a7c3, 6a2b77c1d0, 7c3d88e2f1, 8d4e99f3a2" in whole
    tighter = await summarize([], previous=previous, budget=COUNTER.count_text(whole) - 8)
    assert "- checksum: 7c3d88e2f1, 8d4e99f3a2\n" in tighter


# non-text parts ------------------------------------------------------------------------------------

RAW_PNG = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 800, 600)
RAW_PNG += b"\0" * 150_000
INLINE_PNG = base64.b64encode(RAW_PNG).decode()


def with_parts(role: str, *parts: dict[str, object], text: str | None = None) -> Message:
    content: list[dict[str, object]] = [{"type": "text", "text": text}] if text else []
    return Message(role=role, content=[*content, *parts])  # type: ignore[arg-type]


def noisy_session(steps: int) -> list[Message]:
    """Many identifier-heavy tool steps that compete with everything else for the budget."""
    out: list[Message] = []
    for n in range(steps):
        out.append(Message.assistant(None, tool_calls=[call(f"n{n}", "read_file", path=f"/srv/app/m{n}.py")]))
        out.append(Message.tool(f"n{n}", f"version: v1.{n}.0\nowner: team-{n}\nid: REQ-{1000 + n}"))
    return out


async def test_attachments_survive_in_the_summary_as_placeholders() -> None:
    """An image URL, an inline image, a file id and a tool's screenshot are kept as facts under pressure."""
    screenshot_call = Message.assistant(None, tool_calls=[call("s1", "screenshot")])
    screenshot = Message(
        role="tool",
        tool_call_id="s1",
        content=[{"type": "image", "source": {"type": "url", "url": "https://shots.example.com/s1.png"}}],
    )
    messages = [
        with_parts(
            "user",
            {"type": "image_url", "image_url": {"url": "https://cdn.example.com/chart.png"}},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{INLINE_PNG}"}},
            {"type": "file", "file": {"file_id": "file-abc123", "filename": "report.pdf"}},
            text="Compare the chart with the report.",
        ),
        *noisy_session(30),
        screenshot_call,
        screenshot,
        *noisy_session(30),
    ]
    text = await summarize(messages, budget=400)
    facts = text.split("## Facts and identifiers")[1].split("## ")[0]
    assert "[image: https://cdn.example.com/chart.png]" in facts
    assert f"[image: inline image/png, 800x600, {round(len(RAW_PNG) / 1024)} KB]" in facts
    assert "[file: file-abc123 report.pdf]" in facts
    assert "[image: https://shots.example.com/s1.png]" in facts
    assert INLINE_PNG[:40] not in text


async def test_an_attachment_survives_the_next_merges() -> None:
    """A placeholder in the previous summary is read back as a fact and kept through later folds."""
    first = await summarize(
        [with_parts("user", {"type": "image_url", "image_url": {"url": "https://cdn.example.com/a.png"}})],
        budget=300,
    )
    text = first
    for round_ in range(3):
        text = await summarize(noisy_session(20 + round_), previous=text, budget=300)
    assert "[image: https://cdn.example.com/a.png]" in text


async def test_a_long_signed_url_is_kept_whole() -> None:
    """A placeholder longer than max_line_chars is not cut: its URL must stay usable."""
    url = "https://bucket.s3.amazonaws.com/a.png?X-Amz-Signature=" + "f" * 400
    text = await summarize([with_parts("user", {"type": "image_url", "image_url": {"url": url}})], budget=600)
    assert f"[image: {url}]" in text


async def test_reasoning_parts_are_not_kept_as_facts() -> None:
    """A thinking block is neither copied nor listed as an attachment."""
    thinking = {"type": "thinking", "thinking": "private chain of thought", "signature": "sig"}
    text = await summarize([with_parts("assistant", thinking, text="Done.")], budget=300)
    assert "[thinking]" not in text and "private chain" not in text


# off the event loop and never empty -------------------------------------------------------------------


def big_session(steps: int) -> list[Message]:
    out: list[Message] = []
    for n in range(steps):
        out.append(Message.user(f"step {n}: check /srv/app/mod{n}.py and INC-{40000 + n}. " + "lorem " * 80))
        reading = call(f"c{n}", "read_file", path=f"/m{n}.py")
        out.append(Message.assistant("I decided to read it.", tool_calls=[reading]))
        out.append(Message.tool(f"c{n}", "\n".join(f"line {j}: value_{n}_{j} = {j * n}" for j in range(30))))
    return out


@pytest.mark.slow
async def test_a_200k_token_summary_leaves_the_event_loop_free() -> None:
    """During a 200k-token extractive fold a task sleeping 5 ms keeps ticking: p90 lag under 20 ms."""
    await COUNTER.aload()
    messages = big_session(380)
    assert COUNTER.count_messages(messages) > 200_000
    lateness: list[float] = []
    done = anyio.Event()

    async def tick() -> None:
        while not done.is_set():
            began = time.perf_counter()
            await anyio.sleep(0.005)
            lateness.append(time.perf_counter() - began - 0.005)

    # A full collection of the test process's heap (earlier tests' objects) would stall any thread.
    gc.collect()
    began = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        summary = await ExtractiveSummarizer(COUNTER).summarize(
            messages, previous_summary=None, max_summary_tokens=2000
        )
        done.set()
    took = time.perf_counter() - began
    lateness.sort()
    assert "/srv/app/mod379.py" in summary.text
    assert len(lateness) > took / 0.05, "the ticker ran all along"
    p90 = lateness[int(len(lateness) * 0.9)]
    assert p90 < 0.020, f"p90 loop lag {p90:.3f} s"
    assert lateness[-1] < max(0.1, took / 10), f"the loop stalled {lateness[-1]:.3f} s of {took:.2f} s"


async def test_a_budget_too_small_for_any_summary_is_a_summarizer_error() -> None:
    """A budget below the headings' 41 tokens raises SummarizerError instead of returning "" or a stub."""
    for budget in (1, 40):
        with pytest.raises(SummarizerError, match=f"max_summary_tokens={budget} cannot hold"):
            await ExtractiveSummarizer(COUNTER).summarize(
                SESSION, previous_summary=None, max_summary_tokens=budget
            )
    assert (await summarize(SESSION, budget=41)).startswith("## Goal and constraints")


async def test_identifiers_in_json_arguments_and_results_are_read_with_their_escapes_undone() -> None:
    """``\\u00f6`` in JSON arguments or a JSON result reads as ``ö``: no escape becomes a fact or an id."""
    reading = call("c1", "read", path="/srv/données/größe.py", größe=3)
    assert "\\u00f6" in reading.arguments  # json.dumps escapes what is not ASCII
    messages = [
        Message.user("read it"),
        Message.assistant(None, tool_calls=[reading]),
        Message.tool("c1", json.dumps({"city": "Zürich", "ticket": "INC-4821", "note": "naïve ok"})),
    ]
    text = await summarize(messages)
    assert "u00" not in text
    assert "/srv/données/größe.py" in text and "read(größe): 3" in text
    assert '"größe": 3' in text  # the tool line shows the call's arguments decoded too
    assert "city: Zürich" in text and "INC-4821" in text


async def test_identifiers_in_a_result_that_is_not_json_are_read_from_the_raw_text() -> None:
    """A result that only looks like JSON still yields its identifiers, as written."""
    messages = [
        Message.user("look"),
        Message.assistant(None, tool_calls=[call("c1", "grep", pattern="TODO")]),
        Message.tool("c1", '{"hit": "/srv/app/main.py", "id": "INC-77", cut off'),
    ]
    text = await summarize(messages)
    assert "grep result: /srv/app/main.py, INC-77" in text


async def test_an_escaped_lone_surrogate_in_json_becomes_a_replacement_character() -> None:
    """A lone ``\\ud800`` is written as U+FFFD, so the summary can be stored; a whole pair is decoded."""
    odd = ToolCall(id="c1", name="read", arguments='{"path": "/srv/a\\ud800b.py", "pair": "\\ud83d\\ude00"}')
    text = await summarize([Message.user("look"), Message.assistant(None, tool_calls=[odd])])
    text.encode("utf-8")
    assert "read(path): /srv/a\ufffdb.py" in text and "read(pair): \U0001f600" in text


@pytest.mark.parametrize("depth", [900, 100_000])
async def test_a_json_result_nested_past_the_recursion_limit_is_read_as_text(depth: int) -> None:
    """A result nested past what ``json.loads`` can follow is no error: it is read as plain text."""
    nested = "[" * depth + '"/srv/deep.py"' + "]" * depth
    messages = [
        Message.user("look"),
        Message.assistant(None, tool_calls=[call("c1", "read", path="/srv/deep.py")]),
        Message.tool("c1", nested),
    ]
    text = await summarize(messages)
    assert "/srv/deep.py" in text


class _Scans:
    """A stand-in for one of the summary's patterns that notes how much text each call is given."""

    def __init__(self, pattern: re.Pattern[str], sizes: list[int]) -> None:
        self._pattern, self._sizes = pattern, sizes

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._pattern, name)

        def noted(*args: Any, **kwargs: Any) -> Any:
            self._sizes.extend(len(a) for a in args if isinstance(a, str) and len(a) > 1)
            return method(*args, **kwargs)

        return noted


async def test_no_pattern_scans_a_huge_message_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """One regex call holds the GIL until it returns: on a 3 MB message each read a piece at a time.

    The summary runs in a worker thread so the event loop goes on, but the
    loop got no turn while one call scanned 3 MB: 0.2 s stalls. What the
    summary finds deep inside the message is still found.
    """
    sizes: list[int] = []
    for name in ("_SENTENCE", "_CONSTRAINT", "_NEXT", "_DECISION", "_WHITESPACE"):
        monkeypatch.setattr(extractive, name, _Scans(getattr(extractive, name), sizes))
    filler = " ".join(f"word{i} id-{i}x /a/b{i}.py key{i}: v{i}" for i in range(30_000))
    huge = f"{filler} You must never touch /etc/passwd. {filler}\n{filler}"
    steps = [
        Message.user(huge),
        Message.assistant(huge, tool_calls=[call("c1", "grep", pattern=huge)]),
        Message.tool("c1", huge),
        Message.assistant("Next I will read /srv/app/main.py."),
    ]
    summary = await ExtractiveSummarizer(COUNTER).summarize(
        steps, previous_summary=None, max_summary_tokens=800
    )
    assert len(huge) > 3_000_000
    assert sizes and max(sizes) <= 64_000  # pieces, not the 3 MB message
    assert "You must never touch /etc/passwd." in summary.text
    assert "/srv/app/main.py" in summary.text
    assert COUNTER.count_text(summary.text) <= 800
