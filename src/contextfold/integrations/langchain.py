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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from langchain.agents.middleware import AgentMiddleware, AgentState
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
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.runtime import Runtime

from .._compactor import Compactor
from .._episodes import Usage
from .._errors import ConfigError, SummarizerError
from .._messages import TOOL_ERROR_METADATA_KEY, Message, Role, ToolCall
from .._sync import KEY_METADATA_KEY, message_key
from ..summarizers._base import Summary
from ..summarizers._prompt import SYSTEM_PROMPT, render_messages, user_prompt

__all__ = ["CompactionMiddleware", "LangChainSummarizer", "from_langchain", "to_langchain"]

_LANGCHAIN_KEY = "langchain"
_NS_SEP = "|"
"""What joins the parts of a LangGraph ``checkpoint_ns`` (``langgraph._internal._constants.NS_SEP``)."""
_MODELLED = frozenset({"content", "id", "tool_calls", "tool_call_id", "type"})
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


def _thread_of(explicit: str | None) -> str:
    """The contextfold thread of the running agent: ``explicit``, else ``thread_id`` and its namespace.

    A hook runs as a node whose ``checkpoint_ns`` is its graph's namespace
    followed by the node's own ``name:task_id``; the graph's namespace is empty
    for the agent the user invoked and names the calling task for a sub-agent.
    """
    if explicit is not None:
        return explicit
    try:
        configurable = get_config().get("configurable") or {}
    except RuntimeError:
        configurable = {}
    thread = configurable.get("thread_id")
    if not thread:
        raise ConfigError(
            "config.configurable.thread_id",
            "names the contextfold thread and is missing; run the agent with "
            'config={"configurable": {"thread_id": "..."}}, or pass '
            "CompactionMiddleware(compactor, thread=...)",
        )
    namespace = configurable.get("checkpoint_ns")
    graph = namespace.rpartition(_NS_SEP)[0] if isinstance(namespace, str) else ""
    return f"{thread}{_NS_SEP}{graph}" if graph else str(thread)


def _run_blocking(fn: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``fn`` to completion from synchronous code, in a worker thread if an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(fn)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(anyio.run, fn).result()


class CompactionMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """Compacts the agent's messages before every model call (``create_agent(middleware=[...])``).

    The thread is the run config's ``thread_id`` (with a sub-agent's namespace,
    see the module's docstring) unless ``thread`` is given; a given ``thread``
    is used as it is wherever the agent runs, so give each agent its own.
    """

    def __init__(self, compactor: Compactor, *, thread: str | None = None) -> None:
        super().__init__()
        if not isinstance(compactor, Compactor):
            raise ConfigError("compactor", "must be a contextfold.Compactor", value=compactor)
        self.compactor = compactor
        self.thread = thread

    async def _update(
        self, thread: str, messages: Sequence[BaseMessage], *, compact: bool = True
    ) -> dict[str, Any] | None:
        converted = [from_langchain(message) for message in messages]
        ids = [message.id for message in messages]
        context = await self.compactor.sync(thread, converted, ids=ids, compact=compact)
        if context is None or not compact:
            return None
        return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *map(to_langchain, context)]}

    async def abefore_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        return await self._update(_thread_of(self.thread), state["messages"])

    def before_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        thread = _thread_of(self.thread)
        messages = list(state["messages"])
        return _run_blocking(lambda: self._update(thread, messages))

    async def aafter_agent(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        # The final answer comes after the last model call: record it before the run ends.
        return await self._update(_thread_of(self.thread), state["messages"], compact=False)

    def after_agent(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        thread = _thread_of(self.thread)
        messages = list(state["messages"])
        return _run_blocking(lambda: self._update(thread, messages, compact=False))


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
