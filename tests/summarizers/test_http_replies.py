"""Malformed provider replies, served by a real server on 127.0.0.1: each one is a SummarizerError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from http_fakes import (
    ANTHROPIC,
    API_KEY,
    OPENAI,
    Provider,
    Script,
    input_tokens_written_as,
    reply_json,
    reply_raw,
)

from contextfold import Message, SummarizerError, Usage
from contextfold.summarizers._http import HTTPSummarizer

CONVERSATION = [Message.user("Rename the table users_v2; ticket INC-48213.")]


def _input_field(provider: Provider) -> str:
    return "prompt_tokens" if provider is OPENAI else "input_tokens"


@pytest.mark.parametrize(
    ("number", "shown", "expected"),
    [
        ("1e400", "inf", "a whole number"),
        ("Infinity", "inf", "a whole number"),
        ("-Infinity", "-inf", "a whole number"),
        ("NaN", "nan", "a whole number"),
        ("-5", "-5", "at least 0"),
        ("2.5", "2.5", "a whole number"),
        ("12.0", "12.0", "a whole number"),
        ("true", "true", "a whole number"),
        ('"12"', "a string", "a whole number"),
        ("1" + "0" * 30, "a number of 31 digits", "at most 2147483647"),
    ],
)
async def test_a_token_count_that_is_not_a_whole_number_of_tokens_is_a_summarizer_error(
    provider: Provider, script: Script, summarizer: HTTPSummarizer, number: str, shown: str, expected: str
) -> None:
    """A usage count that is non-finite, huge, negative, fractional, a bool or text names its field."""
    script.then(input_tokens_written_as(provider, number))
    with pytest.raises(SummarizerError) as caught:
        await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)
    message = str(caught.value)
    assert f"malformed reply from {summarizer.url}: 'usage.{_input_field(provider)}' is {shown}" in message
    assert f"; expected {expected}" in message
    assert caught.value.status == 200
    assert caught.value.body is not None and caught.value.body.startswith("{")
    assert len(script.requests) == 1


@pytest.mark.parametrize("provider", [ANTHROPIC], ids=["anthropic"])
@pytest.mark.parametrize("field", ["cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens"])
async def test_every_anthropic_usage_count_is_checked(
    script: Script, summarizer: HTTPSummarizer, field: str
) -> None:
    """Cache counts and the output count are checked like the input count."""
    reply = ANTHROPIC.reply("## Decisions\n- keep ids", 10, 5)
    reply["usage"][field] = float("inf")
    script.then(reply_json(reply))
    with pytest.raises(SummarizerError, match=rf"'usage\.{field}' is inf; expected a whole number"):
        await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)


async def test_a_reply_nested_deeper_than_json_can_be_read_is_a_summarizer_error(
    provider: Provider, script: Script, summarizer: HTTPSummarizer
) -> None:
    """A body of 100,000 nested arrays is a malformed reply, not a RecursionError."""
    script.then(reply_raw("[" * 100_000 + "]" * 100_000))
    with pytest.raises(SummarizerError, match=r"malformed reply .*: it is nested deeper than JSON") as caught:
        await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)
    assert caught.value.status == 200
    assert caught.value.body is not None and caught.value.body.endswith("[[[...")


def _openai(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    reply = OPENAI.reply("## Decisions\n- keep ids", 10, 5)
    change(reply)
    return reply


def _anthropic(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    reply = ANTHROPIC.reply("## Decisions\n- keep ids", 10, 5)
    change(reply)
    return reply


@pytest.mark.parametrize(
    ("provider", "reply", "fault"),
    [
        (OPENAI, _openai(lambda r: r.update(choices=[None])), "'choices[0]' is null; expected an object"),
        (OPENAI, _openai(lambda r: r.update(choices=[])), "'choices' is an empty array; expected an array"),
        (OPENAI, _openai(lambda r: r["choices"][0].pop("message")), "'choices[0].message' is missing"),
        (
            OPENAI,
            _openai(lambda r: r["choices"][0]["message"].update(content=5)),
            "'choices[0].message.content' is 5; expected a string or an array",
        ),
        (
            OPENAI,
            _openai(lambda r: r["choices"][0]["message"].update(content=["a", {"text": "S"}])),
            "'choices[0].message.content[0]' is a string; expected an object",
        ),
        (OPENAI, _openai(lambda r: r.update(usage=[1])), "'usage' is an array; expected an object"),
        (OPENAI, _openai(lambda r: r.update(model=5)), "'model' is 5; expected a string"),
        (
            ANTHROPIC,
            _anthropic(lambda r: r.update(content=[None])),
            "'content[0]' is null; expected an object",
        ),
        (
            ANTHROPIC,
            _anthropic(lambda r: r["content"][0].update(text=["S"])),
            "'content[0].text' is an array; expected a string",
        ),
        (ANTHROPIC, _anthropic(lambda r: r.update(content="S")), "'content' is a string; expected an array"),
        (ANTHROPIC, _anthropic(lambda r: r.update(stop_reason=1)), "'stop_reason' is 1; expected a string"),
        (OPENAI, [], "the reply is an empty array; expected an object"),
        (ANTHROPIC, "text", "the reply is a string; expected an object"),
    ],
    ids=lambda value: value.name if isinstance(value, Provider) else None,
)
async def test_a_value_of_the_wrong_type_anywhere_is_a_summarizer_error_naming_it(
    provider: Provider, script: Script, summarizer: HTTPSummarizer, reply: Any, fault: str
) -> None:
    """A reply whose fields hold the wrong types raises a SummarizerError naming the field and its type."""
    script.then(reply_json(reply))
    with pytest.raises(SummarizerError) as caught:
        await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)
    assert f"{provider.cls.provider} summarizer got a malformed reply from {summarizer.url}: {fault}" in str(
        caught.value
    )


async def test_a_malformed_reply_that_echoes_the_key_never_shows_it(
    provider: Provider, script: Script, summarizer: HTTPSummarizer
) -> None:
    """The error names the faulty field without quoting its text, and the body excerpt is redacted."""
    reply = provider.reply(API_KEY, 10, 5)
    if provider is OPENAI:
        reply["choices"][0]["message"]["content"] = [API_KEY]
    else:
        reply["content"] = [API_KEY]
    script.then(reply_json(reply))
    with pytest.raises(SummarizerError, match="malformed reply") as caught:
        await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)
    assert API_KEY not in str(caught.value)
    assert "[redacted]" in str(caught.value.body)


async def test_fields_the_reply_shape_does_not_name_are_ignored(
    provider: Provider, script: Script, summarizer: HTTPSummarizer
) -> None:
    """Fields the APIs add (cache details, thinking blocks, a null count) leave a reply well-formed."""
    reply = provider.reply("## Decisions\n- keep ids", 10, 5)
    if provider is OPENAI:
        reply.update(system_fingerprint=None, service_tier="default")
        reply["choices"][0]["message"].update(refusal=None, annotations=[], tool_calls=None)
        reply["usage"].update(prompt_tokens_details={"cached_tokens": 0}, completion_tokens=None)
    else:
        reply["content"].insert(0, {"type": "thinking", "thinking": "...", "signature": "x"})
        reply["usage"].update(cache_creation={"ephemeral_5m_input_tokens": 0}, output_tokens=None)
        reply.update(stop_sequence=None)
    script.then(reply_json(reply))
    summary = await summarizer.summarize(CONVERSATION, previous_summary=None, max_summary_tokens=300)
    assert summary.text == "## Decisions\n- keep ids"
    assert summary.usage == Usage(input_tokens=10, output_tokens=0)
