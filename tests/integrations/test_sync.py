"""sync(): a framework's whole message list in, only the unrecorded messages recorded, the context out."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from contextfold import Compactor, ConfigError, Message, RunOptions, SummarizeOptions, ToolCall, conversation
from contextfold._episodes import HistoryClearedEpisode, MessagesRetractedEpisode
from contextfold._sync import KEY_METADATA_KEY, SUMMARY_KEY_PREFIX, append, sync
from contextfold.stores import MemoryStore, SQLiteStore
from contextfold.tokens import ApproximateCounter

QUIET = RunOptions(max_history_tokens=100_000)
SMALL = RunOptions(
    max_history_tokens=1_600,
    compaction=SummarizeOptions(trigger_token_budget=400, max_summary_tokens=80, min_recent_messages=2),
)


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        async with MemoryStore() as memory:
            yield memory
    else:
        async with SQLiteStore(tmp_path / "sync.db") as sqlite:
            yield sqlite


def compactor(store: Any, options: RunOptions = QUIET) -> Compactor:
    return Compactor(store, options=options, counter=ApproximateCounter())


async def logged(c: Compactor, thread: str) -> list[Message]:
    return conversation([record async for record in c.episodic.replay(thread)])


def turn(n: int, filler: int = 0) -> list[Message]:
    call = ToolCall(id=f"call-{n}", name="lookup", arguments=f'{{"n": {n}}}')
    return [
        Message.user(f"question {n}"),
        Message.assistant(None, tool_calls=[call]),
        Message.tool(f"call-{n}", f"answer {n} " + "data " * filler),
        Message.assistant(f"done {n}"),
    ]


async def test_a_growing_list_records_each_message_once(store: Any) -> None:
    """Passing the whole list after every turn records each message exactly once, in order."""
    c = compactor(store)
    history: list[Message] = []
    for n in range(5):
        history += turn(n)
        assert await sync(c, "t", history) is None
    assert [m.text for m in await logged(c, "t")] == [m.text for m in history]


async def test_repeated_content_is_recorded_again(store: Any) -> None:
    """A message that repeats an earlier one word for word is a new message and is recorded."""
    c = compactor(store)
    history = [Message.user("continue"), Message.assistant("ok")]
    await sync(c, "t", history)
    history += [Message.user("continue"), Message.assistant("ok")]
    await sync(c, "t", history)
    await sync(c, "t", history)
    assert [m.text for m in await logged(c, "t")] == ["continue", "ok", "continue", "ok"]


async def test_framework_ids_decide_what_is_new(store: Any) -> None:
    """With ids, a message already recorded under its id is not recorded again, even if reordered."""
    c = compactor(store)
    first = [Message.user("a"), Message.assistant("b")]
    await sync(c, "t", first, ids=["m1", "m2"])
    await sync(c, "t", [first[1], first[0], Message.user("c")], ids=["m2", "m1", "m3"])
    records = await logged(c, "t")
    assert [m.text for m in records] == ["a", "b", "c"]
    assert [m.metadata[KEY_METADATA_KEY] for m in records] == ["m1", "m2", "m3"]


async def test_an_id_the_log_never_saw_does_not_make_a_resent_message_new(store: Any) -> None:
    """A whole list sent again under new ids (LangGraph gives id-less input new ones) records only its end."""
    c = compactor(store)
    history: list[Message] = []
    for text in ("continue", "ok", "ok"):  # the same words twice are two messages
        history += [Message.user(text), Message.assistant(f"done: {text}")]
        await sync(c, "t", history, ids=[f"run-{len(history)}-{n}" for n in range(len(history))])
    assert [m.text for m in await logged(c, "t")] == [m.text for m in history]
    assert [m.text for m in await c.context("t")] == [m.text for m in history]


async def test_ids_must_match_the_messages(store: Any) -> None:
    """An ids list of the wrong length is refused with a ConfigError naming ids."""
    with pytest.raises(ConfigError, match="ids"):
        await sync(compactor(store), "t", [Message.user("a")], ids=["x", "y"])


@pytest.mark.parametrize(
    ("ids", "shown"),
    [
        ([101, 102], "ids=101"),
        (["m1", 102], "ids=102"),
        ([b"m1", b"m2"], "ids=b'm1'"),
        ([0, 1], "ids=0"),
        ("m1", "ids='m1'"),
    ],
    ids=["row-ids", "one-int", "bytes", "a-falsy-int", "a-str"],
)
@pytest.mark.parametrize("call", ["Compactor.sync", "append"])
async def test_ids_of_another_type_than_str_are_refused_before_anything_is_stored(
    store: Any, ids: Any, shown: str, call: str
) -> None:
    """Ids that are not str (or None), database row ids say, are a ConfigError naming ids and the fix."""
    c = compactor(store)
    messages = [Message.user("a"), Message.assistant("b")]
    with pytest.raises(ConfigError) as caught:
        if call == "append":
            await append(c, "t", messages, ids=ids)
        else:
            await c.sync("t", messages, ids=ids)
    assert caught.value.key == "ids"
    assert str(caught.value).startswith(f"{shown}: must ") and "str(" in str(caught.value)
    assert (await store.stats("t")).message_count == 0
    assert await logged(c, "t") == []


@pytest.mark.parametrize(
    ("given", "key", "shown"),
    [
        ({"messages": Message.user("a")}, "messages", "a single message goes in a list too"),
        ({"messages": "a"}, "messages", "must be a list of Message objects"),
        ({"messages": [Message.user("a"), {"role": "user"}]}, "messages", "messages[1] is of type dict"),
        ({"compact": "no"}, "compact", "must be True or False"),
        ({"compact": None}, "compact", "must be True or False"),
    ],
    ids=["one-message", "text", "a-dict", "compact-str", "compact-none"],
)  # fmt: skip
async def test_messages_and_compact_of_the_wrong_type_are_refused_before_anything_is_stored(
    store: Any, given: dict[str, Any], key: str, shown: str
) -> None:
    """sync's messages and compact of the wrong type are a ConfigError naming the parameter, not a crash."""
    c = compactor(store)
    arguments: dict[str, Any] = {"messages": [Message.user("a")], **given}
    with pytest.raises(ConfigError) as caught:
        await c.sync("t", arguments.pop("messages"), **arguments)
    assert caught.value.key == key and shown in caught.value.reason
    assert (await store.stats("t")).message_count == 0


async def test_ids_may_be_none_empty_or_a_str_subclass(store: Any) -> None:
    """None and "" mean a message without an id; a subclass of str is an id like any other."""

    class RowId(str):
        pass

    c = compactor(store)
    await c.sync("t", [Message.user("a"), Message.user("b"), Message.user("c")], ids=[None, "", RowId("r3")])
    keys = [m.metadata[KEY_METADATA_KEY] for m in await logged(c, "t")]
    assert keys[2] == "r3" and keys[0].startswith("c:") and keys[1].startswith("c:")


async def test_a_restarted_process_resumes_without_duplicates(tmp_path: Path) -> None:
    """A new compactor over the same SQLite file reads the recorded keys back and records only what is new."""
    path = tmp_path / "resume.db"
    history = turn(0) + turn(1)
    async with SQLiteStore(path) as first:
        await sync(compactor(first), "t", history)
    history += turn(2)
    async with SQLiteStore(path) as second:
        c = compactor(second)
        await sync(c, "t", history)
        assert [m.text for m in await logged(c, "t")] == [m.text for m in history]


async def sync_until_a_fold(c: Compactor) -> list[Message]:
    """Sync a growing history turn by turn until a fold hands back a new context."""
    history: list[Message] = []
    for n in range(12):
        history += turn(n, filler=60)
        returned = await sync(c, "t", history)
        if returned is not None:
            return returned
    raise AssertionError("twelve turns did not fold")


async def test_a_fold_returns_the_context_with_a_keyed_summary(store: Any) -> None:
    """After a fold the new context comes back with a keyed summary; writing it back records nothing."""
    c = compactor(store, SMALL)
    returned = await sync_until_a_fold(c)
    assert returned[0].is_summary
    assert returned[0].metadata[KEY_METADATA_KEY].startswith(SUMMARY_KEY_PREFIX)
    assert [m.text for m in returned] == [m.text for m in await c.context("t")]
    before = await logged(c, "t")
    # The framework stores the context it was given, losing the summary's mark but keeping ids.
    written_back = [
        m.model_copy(update={"metadata": {KEY_METADATA_KEY: m.metadata[KEY_METADATA_KEY]}}) for m in returned
    ]
    assert await sync(c, "t", written_back) is None
    following = turn(99)
    await sync(c, "t", written_back + following)
    after = await logged(c, "t")
    assert after == before + after[len(before) :]
    assert [m.text for m in after[len(before) :]] == [m.text for m in following]
    assert not any(m.is_summary or m.text.startswith("[compacted") for m in after)


async def test_a_context_without_keys_resumes_by_content(store: Any) -> None:
    """A framework that keeps no ids and passes the folded context back still records only the new turn."""
    c = compactor(store, SMALL)
    returned = await sync_until_a_fold(c)
    before = await logged(c, "t")
    plain = [
        Message(role=m.role, content=m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id)
        for m in returned
    ]
    await sync(c, "t", plain + turn(100))
    after = await logged(c, "t")
    assert [m.text for m in after[len(before) :]] == [m.text for m in turn(100)]


async def test_retractions_and_clears_are_followed(store: Any) -> None:
    """After a retraction or a clear in the log, the withdrawn messages count as unrecorded again."""
    c = compactor(store)
    await sync(c, "t", [Message.user("a"), Message.assistant("b")])
    await c.episodic.record("t", MessagesRetractedEpisode(count=1))
    await sync(c, "t", [Message.user("a"), Message.assistant("b")])
    assert [m.text for m in await logged(c, "t")] == ["a", "b"]
    await c.episodic.record("t", HistoryClearedEpisode())
    await sync(c, "t", [Message.user("a")])
    assert [m.text for m in await logged(c, "t")] == ["a"]


async def test_messages_appended_directly_are_known(store: Any) -> None:
    """Messages recorded with Compactor.append, not through sync, are not recorded a second time."""
    c = compactor(store)
    await c.append("t", [Message.system("be brief"), Message.user("hi")])
    await sync(c, "t", [Message.system("be brief"), Message.user("hi"), Message.assistant("hello")])
    assert [m.text for m in await logged(c, "t")] == ["be brief", "hi", "hello"]


async def test_a_long_list_is_matched_off_the_event_loop(store: Any) -> None:
    """A list of hundreds of messages (matched in a worker thread) still records only its new turn."""
    c = compactor(store)
    history = [m for n in range(100) for m in turn(n)]
    await sync(c, "t", history)
    await sync(c, "t", [*history, *turn(100)])
    assert [m.text for m in await logged(c, "t")] == [m.text for m in [*history, *turn(100)]]


def same_ids_turn(n: int, filler: int = 0) -> tuple[list[Message], list[str | None]]:
    """Turn ``n`` of a provider that numbers tool calls per reply: every call is ``call_0``."""
    call = ToolCall(id="call_0", name="lookup", arguments=f'{{"n": {n}}}')
    messages = [
        Message.user(f"question {n}"),
        Message.assistant(None, tool_calls=[call]),
        Message.tool("call_0", f"answer {n}" + " data" * filler),
        Message.assistant(f"done {n}"),
    ]
    return messages, [None, "calls:call_0", "result:call_0", None]


async def test_an_id_reused_in_a_later_turn_is_a_new_message(store: Any) -> None:
    """A call id the provider gives again in the next turn is a new call: its turn is recorded and sent."""
    c = compactor(store)
    history: list[Message] = []
    ids: list[str | None] = []
    for n in range(3):
        messages, turn_ids = same_ids_turn(n)
        for end in (2, 3, 4):  # as a framework syncs: before each model call, then at the end
            assert await sync(c, "t", history + messages[:end], ids=ids + turn_ids[:end]) is None
        history, ids = history + messages, ids + turn_ids
    assert [m.text or m.tool_calls[0].arguments for m in await logged(c, "t")] == [
        text for n in range(3) for text in (f"question {n}", f'{{"n": {n}}}', f"answer {n}", f"done {n}")
    ]
    assert [m.text for m in await c.context("t")][-2:] == ["answer 2", "done 2"]


async def test_an_id_reused_after_its_first_use_folded_away_is_new(store: Any) -> None:
    """After a fold the framework holds the context: a reused id in it, or after it, is still new."""
    c = compactor(store, SMALL)
    held: list[Message] = []  # what the framework holds: its list, replaced by the context after a fold
    held_ids: list[str | None] = []
    folds = 0
    for n in range(12):
        full, full_ids = same_ids_turn(n, filler=60)
        done = 0  # of this turn's messages, how many the framework's list holds
        for end in (1, 2, 3, 4):
            context = await sync(c, "t", held + full[done:end], ids=held_ids + full_ids[done:end])
            if context is None:
                continue
            folds += 1  # the framework now holds the context, known by the keys it carries
            held, held_ids, done = context, [None] * len(context), end
        held, held_ids = held + full[done:], held_ids + full_ids[done:]
        sent = [m.text.split(" data")[0] for m in await c.context("t")]
        assert sent[-2:] == [f"answer {n}", f"done {n}"], n
    texts = [(m.text or m.tool_calls[0].arguments).split(" data")[0] for m in await logged(c, "t")]
    assert texts == [
        text for n in range(12) for text in (f"question {n}", f'{{"n": {n}}}', f"answer {n}", f"done {n}")
    ]
    assert folds >= 3


def test_two_event_loops_in_two_os_threads_sync_one_thread() -> None:
    """A framework's synchronous calls each run an event loop of their own (LangChain's invoke in a threaded
    server): two of them syncing one thread at once both finish, and each message is recorded once.

    Before, the thread's lock was anyio's, which belongs to one event loop: the second call waited for it,
    and the first one's release never woke the other loop.
    """
    holding = threading.Event()
    release = threading.Event()

    class Slow(Compactor):
        async def maybe_compact(self, thread: str, *, now: Any = None) -> Any:
            if threading.current_thread().name == "first" and not holding.is_set():
                holding.set()  # the first call holds the thread's lock until the second one waits
                await anyio.to_thread.run_sync(release.wait)
            return await super().maybe_compact(thread, now=now)

    store = MemoryStore()
    c = Slow(store, options=QUIET, counter=ApproximateCounter())
    history = turn(0)
    failures: list[BaseException] = []

    def call(messages: list[Message]) -> None:
        try:
            anyio.run(partial(sync, c, "t", messages))
        except BaseException as exc:  # reported below
            failures.append(exc)

    first = threading.Thread(target=call, args=(history[:2],), name="first", daemon=True)
    second = threading.Thread(target=call, args=(history,), name="second", daemon=True)
    first.start()
    assert holding.wait(10)
    second.start()
    time.sleep(0.2)  # the second call is now waiting for the lock
    release.set()
    for worker in (first, second):
        worker.join(10)
        assert not worker.is_alive(), f"the {worker.name} call never finished"
    assert failures == []
    records = anyio.run(partial(logged, c, "t"))
    assert [(m.text or m.tool_calls[0].id).strip() for m in records] == [
        "question 0",
        "call-0",
        "answer 0",
        "done 0",
    ]
