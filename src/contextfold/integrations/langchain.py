"""LangChain v1: compaction as ``create_agent`` middleware, and any chat model as a summarizer.

::

    compactor = Compactor(SQLiteStore("agent.db"), options=options,
                          summarizer=LangChainSummarizer(init_chat_model("openai:gpt-4o-mini")))
    agent = create_agent(model, tools, middleware=[CompactionMiddleware(compactor)],
                         checkpointer=InMemorySaver())
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "t1"}})

Before every model call the middleware records the agent state's new messages
in the thread named by the run config's ``thread_id``, compacts when due, and
after a fold replaces the state's messages with the working context: the
summary, then the kept turns, each under its original id. The summary's id
starts with ``contextfold.summary:``, so a restarted agent never records it
as a user message. Works under ``invoke`` and ``ainvoke``.

A sub-agent (an agent a tool invokes, or one added as a node of another graph)
runs under a LangGraph ``checkpoint_ns`` and gets a thread of its own, named
``thread_id|namespace``, the namespace being the one LangGraph stores that
sub-agent's state under. So it holds history exactly when LangGraph does: a
sub-agent compiled with ``checkpointer=True`` keeps one thread across calls
(``main|tools``); by default the namespace names the calling task
(``main|tools:<task id>``), so each call starts a thread afresh, as its state
does, and an interrupt resumed in that task finds it again.

With a checkpointer, the agent's state is the conversation, and the thread
follows edits made to it: a message removed (``RemoveMessage``) or rewritten
under its id with ``update_state``, a run continued from an earlier checkpoint,
a state emptied with ``RemoveMessage(REMOVE_ALL_MESSAGES)``. The working
context takes the edit, and the log, which keeps every original, records the
conversation withdrawn from the oldest edited message on and what stays of it
again, so a replay gives the edited conversation. A step whose state holds
the messages the last step saw or handed back, unchanged, and new ones after
them (every step of a run, and a run that continues one) made no edit: it
reads nothing more from the store and converts only the new messages. Without
a checkpointer the state starts empty on every run, and the thread supplies
the history; an application that sends the whole chat each run instead (as
dicts, or as messages without ids, which LangGraph gives new random ids each
run) has it matched by content, so nothing of it is recorded or sent twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import operator
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
    messages_from_dict,
    messages_to_dict,
)
from langgraph.config import get_config
from langgraph.constants import CONFIG_KEY_CHECKPOINTER
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.runtime import Runtime

from .._compactor import TRUNCATED_METADATA_KEY, Compactor
from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._messages import TOOL_ERROR_METADATA_KEY, Message, Role, ToolCall
from .._strategies import MASKED_METADATA_KEY
from .._sync import KEY_METADATA_KEY, SUMMARY_KEY_PREFIX, _off_loop, alike, message_key
from ..stores._base import StoredMessage
from ..summarizers._base import Summary
from ..summarizers._prompt import SYSTEM_PROMPT, render_messages, user_prompt
from ._edits import Edit, Row, follow, kept, said, withdrawal

__all__ = ["CompactionMiddleware", "LangChainSummarizer", "from_langchain", "to_langchain"]

_LANGCHAIN_KEY = "langchain"
_NS_SEP = "|"
"""What joins the parts of a LangGraph ``checkpoint_ns`` (``langgraph._internal._constants.NS_SEP``)."""
_MODELLED = frozenset({"content", "id", "tool_calls", "tool_call_id", "type"})
_REMEMBERED_THREADS = 1024
_T = TypeVar("_T")


def _json_safe(value: Any) -> Any:
    """``value`` as JSON data; what is not JSON (a tool's artifact object, say) becomes its repr."""
    return json.loads(json.dumps(value, default=repr))


def from_langchain(message: BaseMessage) -> Message:
    """A LangChain message as a contextfold message; its other fields are kept under ``langchain``."""
    [dumped] = messages_to_dict([message])
    kind = dumped["type"]
    data = dumped["data"]
    extra = {
        key: value for key, value in data.items() if key not in _MODELLED and value not in (None, {}, [])
    }
    metadata: dict[str, Any] = {_LANGCHAIN_KEY: _json_safe({"type": kind, **extra})}
    if message.id:
        metadata[KEY_METADATA_KEY] = message.id
    content = _json_safe(message.content)
    if isinstance(message, AIMessage):
        calls = [
            ToolCall(id=call["id"] or f"call_{n}", name=call["name"], arguments=json.dumps(call["args"]))
            for n, call in enumerate(message.tool_calls)
        ]
        return Message(
            role=Role.ASSISTANT,
            content=content or None if calls else content,
            tool_calls=tuple(calls),
            metadata=metadata,
        )
    if isinstance(message, ToolMessage):
        if message.status == "error":
            metadata[TOOL_ERROR_METADATA_KEY] = True
        return Message(role=Role.TOOL, content=content, tool_call_id=message.tool_call_id, metadata=metadata)
    if isinstance(message, SystemMessage):
        return Message(role=Role.SYSTEM, content=content, metadata=metadata)
    # Human messages, and kinds contextfold has no role for (chat, function), are user turns;
    # their kind is kept, so they become what they were when written back.
    return Message(role=Role.USER, content=content, metadata=metadata)


def to_langchain(message: Message) -> BaseMessage:
    """A contextfold message as a LangChain message, its id the key it is known by."""
    stored = message.metadata.get(_LANGCHAIN_KEY)
    stored = dict(stored) if isinstance(stored, dict) else {}
    kind = stored.pop("type", None)
    data: dict[str, Any] = {**stored, "content": message.content if message.content is not None else ""}
    key = message_key(message)
    if key is not None:
        data["id"] = key
    if message.role is Role.ASSISTANT:
        kind = "ai"
        data["tool_calls"] = [
            {"name": call.name, "args": call.parsed_arguments(), "id": call.id, "type": "tool_call"}
            for call in message.tool_calls
        ]
    elif message.role is Role.TOOL:
        kind = "tool"
        data["tool_call_id"] = message.tool_call_id
        if message.metadata.get(TOOL_ERROR_METADATA_KEY):
            data["status"] = "error"
    elif message.role is Role.SYSTEM:
        kind = "system"
    elif kind not in ("human", "chat", "function"):
        kind = "human"
    [converted] = messages_from_dict([{"type": kind, "data": data}])
    return converted


@dataclass(frozen=True, slots=True)
class _Run:
    """Where a hook runs: its contextfold thread, and whether a checkpointer keeps the agent's state."""

    thread: str
    persistent: bool
    checkpointer: Any = None
    """The checkpointer keeping the agent's state, when one does."""
    state_config: Any = None
    """The agent's own ``thread_id`` and ``checkpoint_ns`` in that checkpointer."""


async def _kept_earlier_runs(run: _Run) -> bool:
    """Whether the checkpointer holds a run of this agent's thread before the current one.

    A state holding none of the working context is a cleared or forked
    conversation when the checkpointer kept earlier runs; when it kept none (an
    ``InMemorySaver`` after a restart), the checkpointer lost the conversation
    and the thread still supplies it. Each run starts with an ``input`` checkpoint.
    """
    saver, config = run.checkpointer, run.state_config
    if saver is None or config is None:
        return False
    found = {"source": "input"}
    try:
        inputs = [item async for item in saver.alist(config, filter=found, limit=2)]
    except NotImplementedError:  # a checkpointer for synchronous calls only (SqliteSaver)
        inputs = await anyio.to_thread.run_sync(lambda: list(saver.list(config, filter=found, limit=2)))
    return len(inputs) > 1


def _run_of(explicit: str | None) -> _Run:
    """The running agent's thread (``explicit``, else ``thread_id`` and its namespace) and persistence.

    A hook runs as a node whose ``checkpoint_ns`` is its graph's namespace
    followed by the node's own ``name:task_id``; the graph's namespace is empty
    for the agent the user invoked and names the calling task for a sub-agent.
    """
    try:
        configurable = get_config().get("configurable") or {}
    except RuntimeError:
        configurable = {}
    checkpointer = configurable.get(CONFIG_KEY_CHECKPOINTER)
    persistent = checkpointer is not None
    thread = configurable.get("thread_id")
    namespace = configurable.get("checkpoint_ns")
    graph = namespace.rpartition(_NS_SEP)[0] if isinstance(namespace, str) else ""
    state_config = {"configurable": {"thread_id": thread, "checkpoint_ns": graph}} if thread else None
    if explicit is not None:
        return _Run(explicit, persistent, checkpointer, state_config)
    if not thread:
        raise ConfigError(
            "config.configurable.thread_id",
            "names the contextfold thread and is missing; run the agent with "
            'config={"configurable": {"thread_id": "..."}}, or pass '
            "CompactionMiddleware(compactor, thread=...)",
        )
    return _Run(f"{thread}{_NS_SEP}{graph}" if graph else str(thread), persistent, checkpointer, state_config)


@dataclass(frozen=True, slots=True)
class _Edit:
    """How the agent's state differs from the working context it was handed: by the messages' keys."""

    removed: frozenset[str]
    changed: Mapping[str, Message]
    """Each message the state rewrote in place, as the state now holds it."""
    cleared: bool
    """The state holds none of the context's messages: the conversation starts over from the state."""


def _edit_of(context: Sequence[Message], state: Mapping[str, Message], *, persistent: bool) -> _Edit | None:
    """The edit the state made to ``context`` (``update_state``, time travel), ``None`` if it made none.

    The state made one when it holds a message of the context but not
    another, or holds one with other content; or, kept by a checkpointer, when
    it holds none of them (cleared, or forked from before them). A state that
    holds none of them and is not kept is the start of a run that the thread
    supplies the history to. ``state`` holds the state's messages by id.
    Summaries, and messages contextfold rewrote in the context (masked or
    truncated outputs), are left out of the comparison.
    """
    kept = [
        (message, key)
        for message in context
        if (key := message_key(message)) is not None
        and not key.startswith(SUMMARY_KEY_PREFIX)
        and not message.is_summary
    ]
    if not kept:
        return None
    if not any(key in state for _, key in kept):
        return _Edit(frozenset(key for _, key in kept), {}, cleared=True) if persistent else None
    resent = frozenset() if persistent else _resent(kept, state)
    removed = frozenset(key for _, key in kept if key not in state and key not in resent)
    changed: dict[str, Message] = {}
    for message, key in kept:
        held = state.get(key)
        rewritten = message.metadata.get(TRUNCATED_METADATA_KEY) or message.metadata.get(MASKED_METADATA_KEY)
        if held is not None and not rewritten and not alike(held, message):
            changed[key] = held
    if not removed and not changed:
        return None
    return _Edit(removed, changed, cleared=False)


def _resent(kept: Sequence[tuple[Message, str]], state: Mapping[str, Message]) -> frozenset[str]:
    """The keys of the context's messages that a state without a checkpointer holds again under a new id.

    An application that keeps no checkpointer sends the chat each run, and
    LangGraph gives each message sent without an id a random one: a reply the
    application kept as it came (its id kept) then sits among its own turns
    under ids the context never saw. Such a message stands for the context's
    message it is alike, in the same place: after the state's copy of the
    context message before it, and before its copy of the one after it. One
    alike elsewhere, or none, leaves the message removed. ``state`` is in the
    state's order.
    """
    keys = list(state)
    where = {key: n for n, key in enumerate(keys)}
    known = {key for _, key in kept}
    bound = [len(keys)] * len(kept)  # where the state holds the next message of the context, by key
    for n in range(len(kept) - 2, -1, -1):
        following = kept[n + 1][1]
        bound[n] = where[following] if following in where else bound[n + 1]
    found: set[str] = set()
    start = 0  # in the state: past the last message matched, by key or by content
    for n, (message, key) in enumerate(kept):
        if key in where:
            start = max(start, where[key] + 1)
            continue
        match = next(
            (
                index
                for index in range(start, bound[n])
                if keys[index] not in known and alike(state[keys[index]], message)
            ),
            None,
        )
        if match is not None:
            found.add(key)
            start = match + 1
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class _Last:
    """The agent state's message list as the middleware last saw or handed it back, and as converted."""

    messages: list[BaseMessage]
    converted: list[Message]


async def _extended(last: _Last | None, messages: Sequence[BaseMessage]) -> list[Message] | None:
    """``messages`` converted when they are ``last``'s list with new ones at its end, else ``None``.

    Such a state made no edit, so the step neither reads the working context
    nor compares it with the state, and only the new messages are converted.
    Within a run the state holds the very message objects of the previous step
    (the identity check, linear but a pointer comparison each); a new run's
    state, loaded from the checkpointer, holds equal copies, compared off the
    event loop when there are many. A message an application changes in place,
    without a state update, is not noticed.
    """
    if last is None or len(messages) < len(last.messages):
        return None
    held = len(last.messages)
    prefix = messages[:held]
    if not all(map(operator.is_, prefix, last.messages)) and not await _off_loop(
        held, operator.eq, list(prefix), last.messages
    ):
        return None
    return [*last.converted, *map(from_langchain, messages[held:])]


def _converted(messages: Sequence[BaseMessage]) -> list[Message]:
    return [from_langchain(message) for message in messages]


def _hand_back(context: Sequence[Message]) -> tuple[list[BaseMessage], list[Message]]:
    """The working context as the state's new messages, and those as the next step converts them."""
    handed = [to_langchain(message) for message in context]
    return handed, _converted(handed)


def _run_blocking(fn: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``fn`` to completion from synchronous code, in a worker thread if an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(fn)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(anyio.run, fn).result()


def _input_tokens(response: ModelResponse[Any] | AIMessage) -> int | None:
    """The input tokens the provider reported for the model call ``response`` answers, if it did."""
    replies = response.result if isinstance(response, ModelResponse) else [response]
    for reply in reversed(replies):
        usage = reply.usage_metadata if isinstance(reply, AIMessage) else None
        if usage and usage.get("input_tokens"):
            return int(usage["input_tokens"])
    return None


class CompactionMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """Compacts the agent's messages before every model call (``create_agent(middleware=[...])``).

    The thread is the run config's ``thread_id`` (with a sub-agent's namespace,
    see the module's docstring) unless ``thread`` is given; a given ``thread``
    is used as it is wherever the agent runs, so give each agent its own.

    The agent's system prompt counts toward the budget as the model call
    receives it from this middleware, and a reply's ``usage_metadata`` makes
    all the provider billed beyond the messages count (tool schemas, a prompt
    changed further in). Without usage, list this one after any middleware
    that changes the prompt (``@dynamic_prompt``), which wraps the model call
    inside the ones before it.
    """

    def __init__(self, compactor: Compactor, *, thread: str | None = None) -> None:
        super().__init__()
        if not isinstance(compactor, Compactor):
            raise ConfigError("compactor", "must be a contextfold.Compactor", value=compactor)
        self.compactor = compactor
        self.thread = thread
        self._last: OrderedDict[str, _Last] = OrderedDict()
        """Per thread, the list the last step saw or handed back: a state extending it made no edit."""
        self._last_lock = threading.Lock()  # ``before_model`` runs each step in a loop of its own
        self._systems: OrderedDict[str, list[Message]] = OrderedDict()
        """Per thread, the system prompt its agent sends beside the state's messages, as last seen."""

    async def _update(
        self, run: _Run, messages: Sequence[BaseMessage], *, compact: bool = True
    ) -> dict[str, Any] | None:
        thread = run.thread
        ids = [message.id for message in messages]
        last = self._forget(thread)  # remembered again once this step is through, not if it fails
        converted = await _extended(last, messages)
        if converted is None:
            converted = await _off_loop(len(messages), _converted, messages)
            await self._check_edit(run, ids, converted)
        context = await self.compactor.sync(thread, converted, ids=ids, compact=compact)
        if context is None or not compact:
            self._remember(thread, _Last(list(messages), converted))
            return None
        handed, handed_converted = await _off_loop(len(context), _hand_back, context)
        self._remember(thread, _Last(handed, handed_converted))
        return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *handed]}

    async def _check_edit(self, run: _Run, ids: Sequence[str | None], converted: Sequence[Message]) -> None:
        """Find the edit the state made to the working context (a read, a full comparison); follow it."""
        by_id = {id_: message for id_, message in zip(ids, converted, strict=True) if id_}
        context = await self.compactor.context(run.thread)
        edit = await _off_loop(len(context), partial(_edit_of, persistent=run.persistent), context, by_id)
        if edit is not None and (not edit.cleared or await _kept_earlier_runs(run)):
            await self._follow(run.thread, edit)

    def _forget(self, thread: str) -> _Last | None:
        with self._last_lock:
            return self._last.pop(thread, None)

    def _remember(self, thread: str, seen: _Last) -> None:
        with self._last_lock:
            self._last[thread] = seen
            while len(self._last) > _REMEMBERED_THREADS:
                self._last.popitem(last=False)

    async def _follow(self, thread: str, edit: _Edit) -> None:
        """Make the working context and the log follow ``edit``; the log keeps every original.

        The context loses the removed messages and takes the rewritten ones in
        place. The log records the conversation withdrawn from the oldest
        message edited on (``MessagesRetractedEpisode``, or ``HistoryClearedEpisode``
        from the start), then what stays of it again, as edited: a replay gives
        the edited conversation. Both in one write, holding the thread's lock
        (see ``_edits.follow``); the edit is by key, so a message another step
        recorded since it was found stays.
        """
        compactor = self.compactor

        async def plan(window: Sequence[StoredMessage]) -> Edit:
            context: list[Row] = []
            for stored in window:
                key = message_key(stored.message)
                if edit.cleared or key in edit.removed:
                    continue
                if key is not None and key in edit.changed:
                    context.append(Row(edit.changed[key], None, stored.seq))
                else:
                    context.append(kept(stored))
            conversation = await said(compactor, thread)
            edited = edit.removed | edit.changed.keys()
            first = 0
            if not edit.cleared:  # the newest message of each key is the context's (a provider may reuse ids)
                newest = {message_key(message): n for n, message in enumerate(conversation)}
                first = min((newest[key] for key in edited if key in newest), default=len(conversation))
            again: list[Message] = []
            if not edit.cleared:
                for message in conversation[first:]:
                    key = message_key(message)
                    if key is None or key not in edit.removed:
                        again.append(edit.changed.get(key, message) if key else message)
            return withdrawal(len(conversation), first, again, context)

        await follow(compactor, thread, plan)

    async def abefore_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        return await self._update(_run_of(self.thread), state["messages"])

    def before_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        run = _run_of(self.thread)
        messages = list(state["messages"])
        return _run_blocking(lambda: self._update(run, messages))

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]],
    ) -> ModelResponse[Any] | AIMessage:
        thread = _run_of(self.thread).thread
        await self._count_system_prompt(thread, request.system_message)
        sent = await self._sent_tokens(thread)
        response = await handler(request)
        self._learn_from_usage(thread, response, sent)
        return response

    def wrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], ModelResponse[Any]],
    ) -> ModelResponse[Any] | AIMessage:
        thread = _run_of(self.thread).thread

        async def before() -> int:
            await self._count_system_prompt(thread, request.system_message)
            return await self._sent_tokens(thread)

        sent = _run_blocking(before)
        response = handler(request)
        self._learn_from_usage(thread, response, sent)
        return response

    async def _sent_tokens(self, thread: str) -> int:
        """The tokens of the context a model call is about to send, as the compactor counts them."""
        _, counted = await self.compactor._counted_context(thread)
        return counted

    def _learn_from_usage(self, thread: str, response: ModelResponse[Any] | AIMessage, sent: int) -> None:
        """The reply's billed input tokens beyond the context sent (``sent``) stand as the thread's overhead.

        That is the system prompt as the model got it (set by any middleware),
        the tool schemas and the provider's framing, none of which the state's
        messages hold; as ``StepLoop`` learns it from a reply's usage. ``sent``
        is read before the call: a background fold applied meanwhile does not
        change what that request held. A reply with no ``usage_metadata``
        leaves the counted system prompt standing.
        """
        billed = _input_tokens(response)
        if billed is not None:
            self.compactor._learn_overhead(thread, billed, sent)

    async def _count_system_prompt(self, thread: str, prompt: SystemMessage | None) -> None:
        """Count ``create_agent``'s ``system_prompt`` toward the budget, as a pinned head is counted.

        The agent sends it beside the state's messages, which ``before_model``
        sees without it; a model call tells what it is. The thread's checks from
        then on count it (``Compactor.count_beside``); only a thread's first
        model call in a process goes without. Each thread has its own: a
        middleware shared by an agent and its sub-agents counts each one's.
        """
        system = [from_langchain(prompt)] if prompt is not None else []
        with self._last_lock:
            known = self._systems.get(thread)
            self._systems[thread] = system
            self._systems.move_to_end(thread)
            while len(self._systems) > _REMEMBERED_THREADS:
                self._systems.popitem(last=False)
        if known != system:
            await self.compactor.count_beside(thread, system)

    async def aafter_agent(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        # The final answer comes after the last model call: record it before the run ends.
        return await self._update(_run_of(self.thread), state["messages"], compact=False)

    def after_agent(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        run = _run_of(self.thread)
        messages = list(state["messages"])
        return _run_blocking(lambda: self._update(run, messages, compact=False))


class LangChainSummarizer:
    """Any LangChain chat model as a contextfold summarizer, with contextfold's incremental prompt."""

    def __init__(self, chat_model: BaseChatModel, *, model: str | None = None) -> None:
        if not isinstance(chat_model, BaseChatModel):
            raise ConfigError(
                "chat_model", "must be a LangChain chat model (BaseChatModel)", value=chat_model
            )
        self.chat_model = chat_model
        self.model = model or str(
            getattr(chat_model, "model_name", None)
            or getattr(chat_model, "model", None)
            or chat_model._llm_type
        )

    async def summarize(
        self, messages: Sequence[Message], *, previous_summary: str | None, max_summary_tokens: int
    ) -> Summary:
        prompt = user_prompt(render_messages(messages), previous_summary, max_summary_tokens)
        try:
            reply = await self.chat_model.ainvoke([SystemMessage(SYSTEM_PROMPT), HumanMessage(prompt)])
        except Exception as exc:
            raise SummarizerError(f"chat model {self.model!r} failed to summarize: {exc!r}") from exc
        text = reply.text.strip()
        if not text:
            raise SummarizerError(f"chat model {self.model!r} returned an empty summary")
        usage = Usage()
        counts = getattr(reply, "usage_metadata", None)
        if counts:
            usage = Usage(
                input_tokens=counts.get("input_tokens", 0), output_tokens=counts.get("output_tokens", 0)
            )
        model = reply.response_metadata.get("model_name") or self.model
        return Summary(text=text, model=str(model), usage=usage)
