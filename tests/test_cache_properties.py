"""The compactor's cached context agrees with reading its rows, over random conversations.

Ids come from a small set, so calls reuse the ids of answered calls, and of
calls still open, as some providers' ids ("call_0") do.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contextfold import Message, ToolCall
from contextfold._compactor import _Cache
from contextfold._strategies import unanswered_calls
from contextfold.stores import StoredMessage

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)

IDS = ("call_0", "call_1", "call_2")

messages_ = st.one_of(
    st.builds(Message.user, st.just("task")),
    st.builds(Message.assistant, st.just("done")),
    st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True).map(
        lambda ids: Message.assistant(None, tool_calls=[ToolCall(id=i, name="read") for i in ids])
    ),
    st.sampled_from(IDS).map(lambda i: Message.tool(i, "output")),
)


def row(seq: int, message: Message, tokens: int, link: int | None) -> StoredMessage:
    return StoredMessage(seq=seq, message=message, tokens=tokens, episode_seq=link)


def cache_of(messages: list[Message], tokens: list[int]) -> _Cache:
    """The cache a step at a time makes of ``messages``: one row per step."""
    cache = _Cache(1)
    for n, (message, count) in enumerate(zip(messages, tokens, strict=True)):
        cache.extend([row(n + 1, message, count, n)])
    return cache


@PROPERTY_SETTINGS
@given(st.lists(messages_, max_size=16))
def test_the_cached_open_calls_give_what_reading_the_rows_gives(messages: list[Message]) -> None:
    rows = cache_of(messages, [1] * len(messages)).snapshot()
    assert rows.unanswered() == unanswered_calls(messages)


@PROPERTY_SETTINGS
@given(st.data(), st.lists(messages_, min_size=1, max_size=16))
def test_the_cache_after_a_fold_is_the_cache_of_the_folded_rows(
    data: st.DataObject, messages: list[Message]
) -> None:
    tokens = data.draw(st.lists(st.integers(0, 50), min_size=len(messages), max_size=len(messages)))
    through = data.draw(st.integers(1, len(messages)))
    replacement = data.draw(st.lists(messages_, max_size=through))
    counts = data.draw(st.lists(st.integers(0, 50), min_size=len(replacement), max_size=len(replacement)))
    folded = cache_of(messages, tokens).folded(2, through, replacement, counts)
    expected = _Cache(2)
    first = through - len(replacement) + 1
    expected.extend(
        [row(first + n, m, count, None) for n, (m, count) in enumerate(zip(replacement, counts, strict=True))]
    )
    expected.extend([row(n + 1, messages[n], tokens[n], n) for n in range(through, len(messages))])
    expected.last_seq = len(messages)
    assert folded == expected
    assert list(folded.open_calls.items()) == list(expected.open_calls.items())


@PROPERTY_SETTINGS
@given(st.data(), st.lists(messages_, min_size=1, max_size=16))
def test_rows_the_cache_holds_already_are_not_added_again(
    data: st.DataObject, messages: list[Message]
) -> None:
    """Two updates of one cache overlapping (a step's append, a background read) give each row once."""
    rows = [row(n + 1, message, 1, n) for n, message in enumerate(messages)]
    held = data.draw(st.integers(0, len(rows)))
    start = data.draw(st.integers(0, held))
    cache = _Cache(1)
    cache.extend(rows[:held])
    cache.extend(rows[start:])  # read from an older seq than the cache's newest
    expected = cache_of(messages, [1] * len(messages))
    assert (cache.plain, cache.seqs, cache.links, cache.total_tokens, cache.turns, cache.last_seq) == (
        expected.plain,
        expected.seqs,
        expected.links,
        expected.total_tokens,
        expected.turns,
        expected.last_seq,
    )
