"""ChatSummarizer as a base class: one ``complete`` method gets contextfold's prompt, chunking and checks."""

from __future__ import annotations

from typing import Any

import pytest

from contextfold import ConfigError, Message, SummarizerError, ToolCall, Usage
from contextfold.summarizers import ChatSummarizer, Summarizer
from contextfold.summarizers._prompt import NO_PREVIOUS_SUMMARY, SYSTEM_PROMPT
from contextfold.tokens import ApproximateCounter


class Scripted(ChatSummarizer):
    """A chat-model summarizer without HTTP: it replies from a list and records each request."""

    def __init__(self, replies: list[str], **options: Any) -> None:
        super().__init__("scripted-model", **options)
        self.replies = list(replies)
        self.requests: list[tuple[str, str, int]] = []

    async def complete(self, system: str, user: str, max_tokens: int) -> tuple[str, str | None, Usage]:
        self.requests.append((system, user, max_tokens))
        return self.replies.pop(0), "scripted-2025", Usage(input_tokens=10, output_tokens=2)


CONVERSATION = [
    Message.user("Rename users_v2; ticket INC-48213."),
    Message.assistant(None, tool_calls=[ToolCall(id="c1", name="read_file", arguments='{"path": "/a.sql"}')]),
    Message.tool("c1", "CREATE TABLE users_v2 (id bigint);"),
]
TEMPLATE = (
    "Old summary: <previous_summary>{previous_summary}</previous_summary>\n"
    "New turns: <conversation>{conversation}</conversation>\n"
    "At most {max_summary_tokens} tokens."
)


async def test_a_subclass_implementing_complete_is_a_full_summarizer() -> None:
    """One method is enough: the base sends contextfold's prompt and wraps the reply in a Summary."""
    summarizer = Scripted(["## Decisions\n- rename users_v2  "])
    summary = await summarizer.summarize(
        CONVERSATION, previous_summary="## Facts\n- old", max_summary_tokens=300
    )
    assert isinstance(summarizer, Summarizer)
    assert (summary.text, summary.model) == ("## Decisions\n- rename users_v2", "scripted-2025")
    assert summary.usage == Usage(input_tokens=10, output_tokens=2)
    ((system, user, max_tokens),) = summarizer.requests
    assert system == SYSTEM_PROMPT and max_tokens == 300
    assert "<previous_summary>\n## Facts\n- old\n</previous_summary>" in user
    assert "tool result (read_file, call c1): CREATE TABLE users_v2" in user


async def test_the_base_chunks_input_beyond_the_window_through_complete() -> None:
    """Too much input for context_window_tokens becomes several complete() calls, each folding the last."""
    messages = [Message.user(f"step {n}: " + "lorem ipsum dolor " * 60) for n in range(20)]
    replies = [f"summary {n}" for n in range(1, 40)]
    summarizer = Scripted(replies, context_window_tokens=2048, counter=ApproximateCounter())
    summary = await summarizer.summarize(messages, previous_summary=None, max_summary_tokens=200)
    calls = len(summarizer.requests)
    assert calls > 2 and summary.text == f"summary {calls}"
    for n, (_, user, _) in enumerate(summarizer.requests[1:], start=1):
        assert f"<previous_summary>\nsummary {n}\n</previous_summary>" in user
    sent = "".join(user for _, user, _ in summarizer.requests)
    assert [sent.count(f"step {n}:") for n in range(20)] == [1] * 20


@pytest.mark.parametrize("reply", ["", "   \n"])
async def test_an_empty_reply_from_complete_is_a_summarizer_error(reply: str) -> None:
    """Whatever model a subclass calls, an empty or blank reply raises instead of erasing the history."""
    with pytest.raises(SummarizerError, match="empty summary"):
        await Scripted([reply]).summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)


async def test_nothing_to_summarize_and_no_previous_summary_is_a_summarizer_error() -> None:
    """No messages keeps a previous summary without a call; with none there is no summary to return."""
    summarizer = Scripted([])
    kept = await summarizer.summarize([], previous_summary="kept", max_summary_tokens=300)
    assert kept.text == "kept" and summarizer.requests == []
    with pytest.raises(SummarizerError, match="nothing to summarize"):
        await summarizer.summarize([], previous_summary=None, max_summary_tokens=300)


async def test_a_summary_prompt_replaces_the_request_with_every_field_filled() -> None:
    """A custom template is sent with the conversation, the escaped previous summary and the size."""
    summarizer = Scripted(["first", "second"], summary_prompt=TEMPLATE)
    await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=321)
    await summarizer.summarize(
        [Message.user("more")], previous_summary="first </conversation> trick", max_summary_tokens=321
    )
    first, second = (user for _, user, _ in summarizer.requests)
    assert first.startswith(f"Old summary: <previous_summary>{NO_PREVIOUS_SUMMARY}</previous_summary>")
    assert "user: Rename users_v2; ticket INC-48213." in first and first.endswith("At most 321 tokens.")
    assert "<previous_summary>first &lt;/conversation> trick</previous_summary>" in second
    assert second.count("</conversation>") == 1


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("Summarize {conversation} in {max_summary_tokens} tokens.", "lacks ['previous_summary']"),
        ("{conversation} {previous_summary}", "lacks ['max_summary_tokens']"),
        (TEMPLATE + " Use {style}.", "names ['style']"),
        (TEMPLATE + " {}", "names ['{}']"),
        (TEMPLATE + " {conversation.upper}", "names ['conversation.upper']"),
        (TEMPLATE + " a { brace", "not a valid template"),
        (TEMPLATE.replace("{max_summary_tokens}", "{max_summary_tokens:q}"), "cannot be filled in"),
        ("", "non-empty template"),
        (42, "non-empty template"),
    ],
)
def test_a_summary_prompt_missing_what_the_prompt_needs_is_a_config_error(
    template: object, says: str
) -> None:
    """A template without a required field, with an unknown one, or malformed, fails at construction."""
    with pytest.raises(ConfigError) as caught:
        Scripted([], summary_prompt=template)
    assert caught.value.key == "summary_prompt"
    assert says in caught.value.reason
    assert "{conversation}" in str(caught.value) or "only" in caught.value.reason


def test_bad_base_options_are_config_errors() -> None:
    """The window, the per-message cut and the model name are checked by the base, naming the key."""
    for key, options in [
        ("context_window_tokens", {"context_window_tokens": 100}),
        ("max_message_chars", {"max_message_chars": 10}),
    ]:
        with pytest.raises(ConfigError) as caught:
            Scripted([], **options)
        assert caught.value.key == key


async def test_rendering_and_counting_run_in_a_worker_thread() -> None:
    """The local token counting of a large input happens off the event loop's thread."""
    import threading

    seen: set[int] = set()

    class Recording(ApproximateCounter):
        def count_text(self, text: str) -> int:
            seen.add(threading.get_ident())
            return super().count_text(text)

    summarizer = Scripted(["ok"], counter=Recording())
    await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)
    assert seen and threading.get_ident() not in seen
