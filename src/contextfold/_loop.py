"""The step loop: an ordered hook chain around each LLM request.

Before each request the ``before_request`` hooks run in order (the first is
always the :class:`CompactionHook`); after the response the ``after_response``
hooks run in reverse order, so the outermost hook sees the step last, as with
nested context managers. A hook's error propagates unless the hook is marked
``optional``, in which case it is logged and the chain goes on.

There are three ways in:

* ``async with loop.step(thread) as step:`` wraps an agent loop you already
  have: ``step.messages`` is the compacted context, ``step.record(...)`` keeps
  what your agent did.
* ``await loop.run(...)`` and ``loop.stream(...)`` drive an async LLM callable
  and tools for you, blocking or streaming, through the very same steps.
* ``await maybe_compact(...)`` from any code, without a loop at all.

``async with StepLoop(compactor) as loop:`` owns the compactor's background
folds for the block (see :class:`StepLoop`).
"""

from __future__ import annotations

import inspect
import json
import logging
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeAlias, TypeVar, cast

import anyio

from ._callables import awaited, closing, returns_awaitable, unwrapped
from ._compactor import CompactionResult, Compactor
from ._episodes import ToolCallEpisode, Usage
from ._errors import ConfigError
from ._events import CompactionEvent, deliver
from ._messages import Message, Role, ToolCall
from .stores._base import ShortTermStore

__all__ = [
    "LLM",
    "Compacted",
    "CompactionHook",
    "Hook",
    "Reply",
    "RunFinished",
    "RunResult",
    "Step",
    "StepEvent",
    "StepFinished",
    "StepLoop",
    "StreamingLLM",
    "TextDelta",
    "Tool",
    "ToolFinished",
    "ToolStarted",
]

logger = logging.getLogger("contextfold")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Reply:
    """An assistant reply with what the provider said about the call: its model and usage.

    A model callable may return a ``Reply`` instead of a bare ``Message`` (a
    streaming one may yield it last); the step loop then records the model and
    the usage in the episodic log with the reply.
    """

    message: Message
    model: str | None = None
    usage: Usage | None = None


LLM: TypeAlias = Callable[[list[Message]], Awaitable["Message | Reply"]]
"""A blocking model: the request's messages in, the assistant's reply (or a ``Reply``) out."""

StreamingLLM: TypeAlias = Callable[[list[Message]], AsyncIterator["str | ToolCall | Message | Reply"]]
"""A streaming model: yields text deltas and finished tool calls (or one whole ``Message`` or ``Reply``)."""

Tool: TypeAlias = Callable[..., Awaitable[Any]]
"""A tool: called with the call's JSON arguments as keyword arguments; its result becomes text."""

Tools: TypeAlias = Mapping[str, Tool] | Sequence[Tool]
"""The tools of a driven run: ``{name: async function}``, or a list of async functions named by ``__name__``.

The list is the shape ``chat_llm`` also takes, so one ``tools`` serves both.
"""


class Hook:
    """A link in the step chain; override the events you need.

    Set ``optional = True`` on a hook whose failure must not stop the agent
    (metrics, tracing): its errors are logged instead of raised.
    """

    optional: bool = False

    async def before_request(self, step: Step) -> None:
        """Runs before the request is built, in chain order."""

    async def after_response(self, step: Step) -> None:
        """Runs after the step's messages were recorded, in reverse chain order."""

    async def on_run_completed(self, thread: str, clean: bool) -> None:
        """Runs when a run ends, in reverse chain order."""

    async def on_compaction_event(self, event: CompactionEvent) -> None:
        """Receives every compaction event of the loop's compactor (a fold, a stall, ...).

        Events are observations: an error here is logged and does not stop the step.
        """


class CompactionHook(Hook):
    """Calls ``maybe_compact`` before every request; always first in a ``StepLoop``."""

    def __init__(self, compactor: Compactor) -> None:
        self.compactor = compactor

    async def before_request(self, step: Step) -> None:
        step.compaction = await self.compactor.maybe_compact(step.thread)


@dataclass(eq=False)
class Step:
    """One request/response step of a thread."""

    thread: str
    index: int
    _compactor: Compactor = field(repr=False)
    messages: list[Message] = field(default_factory=list)
    """The working context to send, after compaction."""
    request_tokens: int = 0
    """The tokens of ``messages`` as the compactor's counter counts them (no provider overhead)."""
    compaction: CompactionResult | None = None
    recorded: list[Message] = field(default_factory=list)
    """What this step added to the thread, in order."""
    state: dict[str, Any] = field(default_factory=dict)
    """Free space for hooks to share data within the step."""

    async def record(
        self,
        *messages: Message,
        model: str | None = None,
        usage: Usage | None = None,
        started: Sequence[ToolCall] = (),
    ) -> None:
        """Record the agent's reply, tool results or other new messages of this step, in one go.

        On a ``Store`` that is one transaction (see ``Compactor.append``).
        ``started`` names the tool calls that ran: each is noted in the audit
        trail right before the result that answers it, in the same transaction
        (``record(reply, *results, started=reply.tool_calls)`` records a whole
        step at once).
        """
        await self._compactor.append(
            self.thread,
            messages,
            model=model,
            usage=usage,
            request_messages=len(self.messages),
            request_tokens=self.request_tokens,
            started=started,
        )
        self.recorded.extend(messages)

    async def record_tool_call(self, call: ToolCall) -> None:
        """Note in the audit trail that a tool the reply asked for started running."""
        await self._compactor.episodic.record(self.thread, ToolCallEpisode(call=call))


@dataclass(frozen=True, slots=True)
class Compacted:
    """The step began with a compaction."""

    result: CompactionResult


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the assistant's streamed text."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolStarted:
    call: ToolCall


@dataclass(frozen=True, slots=True)
class ToolFinished:
    result: Message


@dataclass(frozen=True, slots=True)
class StepFinished:
    reply: Message
    index: int


@dataclass(frozen=True, slots=True)
class RunFinished:
    reply: Message
    steps: int
    clean: bool


StepEvent: TypeAlias = Compacted | TextDelta | ToolStarted | ToolFinished | StepFinished | RunFinished


@dataclass(frozen=True, slots=True)
class RunResult:
    """The end of a driven run."""

    reply: Message
    steps: int
    clean: bool
    compactions: tuple[CompactionResult, ...]


class _LoopEvents:
    """A compactor's one subscriber for the hooks of the ``StepLoop`` objects alive on it.

    Each hook with ``on_compaction_event`` receives an event once, however many
    loops share it, and a loop's hooks stop receiving events once the loop is
    gone: subscribed one by one, a hook shared by two loops counted every fold
    twice, and a loop built per request on a long-lived compactor left every
    earlier request's hooks subscribed for good. The loops are held weakly.
    """

    _of: ClassVar[weakref.WeakKeyDictionary[Compactor, _LoopEvents]] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._loops: list[weakref.ref[StepLoop]] = []

    @classmethod
    def of(cls, compactor: Compactor) -> _LoopEvents:
        """The compactor's own, subscribed to it the first time it is asked for."""
        events = cls._of.get(compactor)
        if events is None:
            events = cls._of[compactor] = cls()
            compactor.subscribe(events)  # holds it, and it holds no reference back
        return events

    def add(self, loop: StepLoop) -> None:
        self._loops.append(weakref.ref(loop))

    async def __call__(self, event: CompactionEvent) -> None:
        delivered: set[int] = set()
        for ref in tuple(self._loops):  # a copy: a loop may be built while a hook runs
            loop = ref()
            if loop is None:
                continue
            for hook in loop._listening:
                if id(hook) in delivered:
                    continue
                delivered.add(id(hook))
                await deliver(hook.on_compaction_event, event)  # an observation: the others still run
        self._loops[:] = [ref for ref in self._loops if ref() is not None]


class StepLoop:
    """Runs the hook chain around each step of an agent; see the module docstring.

    ``async with StepLoop(compactor) as loop:`` enters the compactor, so its
    background folds (``background_at``) run in a task group the block owns,
    and closes it on the way out: a summary still under way is cancelled and
    nothing is written for it. A compactor you entered yourself (``async with
    compactor:``, around several loops that share it) is left to you: the loop
    neither enters nor closes it. The stores are never closed by either.
    """

    def __init__(self, compactor: Compactor, *, hooks: Sequence[Hook] = ()) -> None:
        if not isinstance(compactor, Compactor):
            fix = (
                f"wrap the store: StepLoop(Compactor({type(compactor).__name__}(...), options=...))"
                if isinstance(compactor, ShortTermStore)
                else "pass StepLoop(Compactor(store, options=...))"
            )
            raise ConfigError("compactor", f"must be a contextfold.Compactor; {fix}", value=compactor)
        for position, hook in enumerate(hooks):
            if not isinstance(hook, Hook):
                raise ConfigError(f"hooks[{position}]", "must be a contextfold.Hook instance", value=hook)
        self.compactor = compactor
        self.hooks: tuple[Hook, ...] = (CompactionHook(compactor), *hooks)
        self._steps: dict[str, int] = {}
        self._entries: list[bool] = []
        """For each ``async with`` of this loop, innermost last: whether it entered the compactor."""
        self._listening = tuple(
            hook for hook in hooks if type(hook).on_compaction_event is not Hook.on_compaction_event
        )
        if self._listening:
            _LoopEvents.of(compactor).add(self)

    async def __aenter__(self) -> Self:
        compactor = self.compactor
        entering = compactor._task_group is None  # not entered by its owner, nor by an outer block
        if entering:
            await compactor.__aenter__()
        self._entries.append(entering)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._entries.pop():
            await self.compactor.aclose()

    async def append(self, thread: str, *messages: Message) -> None:
        """Add messages that are not a step's output (the user's input, a system prompt)."""
        for message in messages:
            if isinstance(message, list | tuple):
                raise ConfigError(
                    "messages",
                    "takes each message as its own argument, not a list of them; "
                    "unpack it: append(thread, *messages)",
                    value=message,
                )
        await self.compactor.append(thread, messages)

    @asynccontextmanager
    async def step(self, thread: str) -> AsyncIterator[Step]:
        """One step: hooks and compaction, then your request, then the after-hooks.

        The after-hooks run only when the body finished without an error.
        """
        index = self._steps.get(thread, 0)
        self._steps[thread] = index + 1
        step = Step(thread, index, self.compactor)
        for hook in self.hooks:
            await _guarded(hook, "before_request", hook.before_request(step))
        step.messages, step.request_tokens = await _request(self.compactor, thread)
        yield step
        for hook in reversed(self.hooks):
            await _guarded(hook, "after_response", hook.after_response(step))

    async def complete_run(self, thread: str, *, clean: bool = True) -> None:
        """Record the end of a run (a clean end resets the unfinished-turns count)."""
        await self.compactor.complete_run(thread, clean=clean)
        for hook in reversed(self.hooks):
            await _guarded(hook, "on_run_completed", hook.on_run_completed(thread, clean))

    async def run(
        self,
        thread: str,
        user: str | Message | None,
        *,
        llm: LLM,
        tools: Tools | None = None,
        max_steps: int = 16,
    ) -> RunResult:
        """Drive ``llm`` and ``tools`` until the assistant answers without calling a tool.

        ``llm`` is an async callable, ``async def llm(messages) -> Message | Reply``;
        ``tools`` maps each tool's name to an async function, or lists async
        functions named by their ``__name__`` (as ``chat_llm`` takes them). A
        plain ``def`` for either is a :class:`ConfigError` before the run starts.
        """
        _check_blocking_llm(llm)

        async def as_stream(messages: list[Message]) -> AsyncIterator[Message | Reply]:
            yield await awaited(llm(messages), llm, "llm", _BLOCKING_SHAPE)

        compactions: list[CompactionResult] = []
        events = self.stream(thread, user, llm=as_stream, tools=tools, max_steps=max_steps)
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Compacted):
                    compactions.append(event.result)
                elif isinstance(event, RunFinished):
                    return RunResult(event.reply, event.steps, event.clean, tuple(compactions))
        raise AssertionError("stream() always ends with RunFinished")  # pragma: no cover

    async def stream(
        self,
        thread: str,
        user: str | Message | None,
        *,
        llm: StreamingLLM,
        tools: Tools | None = None,
        max_steps: int = 16,
    ) -> AsyncGenerator[StepEvent, None]:
        """Like :meth:`run`, yielding events as they happen (text deltas included).

        ``llm`` returns an async iterator of text deltas and tool calls (or one
        whole ``Message`` or ``Reply``): an async generator function, such as
        ``chat_llm(...).stream``. ``tools`` is as for :meth:`run`.

        To stop early, consume it inside ``async with contextlib.aclosing(loop.stream(...))``:
        leaving that block closes the model's stream before it returns, so the
        model's own clean-up runs in your task rather than later in another one.
        """
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError("max_steps", "must be a whole number >= 1", value=max_steps)
        if user is not None and not isinstance(user, str | Message):
            raise ConfigError(
                "user",
                "must be the user's input as a str or a Message, or None; record earlier messages "
                "first with loop.append(thread, *messages)",
                value=user,
            )
        _check_streaming_llm(llm)
        runnable = _tool_mapping(tools)
        if user is not None:
            await self.append(thread, Message.user(user) if isinstance(user, str) else user)
        reply = Message.assistant("")
        for number in range(1, max_steps + 1):
            async with self.step(thread) as step:
                if step.compaction is not None and step.compaction.compacted:
                    yield Compacted(step.compaction)
                text: list[str] = []
                calls: list[ToolCall] = []
                whole: Message | None = None
                model: str | None = None
                usage: Usage | None = None
                async with closing(_stream_of(llm, step.messages)) as chunks:
                    async for chunk in chunks:
                        if isinstance(chunk, str):
                            text.append(chunk)
                            yield TextDelta(chunk)
                        elif isinstance(chunk, ToolCall):
                            calls.append(chunk)
                        elif isinstance(chunk, Reply):
                            whole, model, usage = chunk.message, chunk.model, chunk.usage
                        elif isinstance(chunk, Message):
                            whole = chunk
                        else:
                            raise ConfigError(
                                "llm",
                                "gave neither a reply nor a part of one: a model returns one Message or "
                                "Reply (run), or yields str text deltas and ToolCall objects (stream); "
                                "did a return go missing?",
                                value=chunk,
                            )
                if whole is None:
                    whole = Message.assistant("".join(text) or None, tool_calls=calls)
                reply = whole
                if reply.role is not Role.ASSISTANT:
                    raise ConfigError("llm", "must reply with an assistant message", value=reply.role)
                # The reply, each tool's start and its result: one transaction once the tools ran.
                started: list[ToolCall] = []
                results: list[Message] = []
                try:
                    for call in reply.tool_calls:
                        yield ToolStarted(call)
                        started.append(call)
                        results.append(await _run_tool(runnable, call))
                        yield ToolFinished(results[-1])
                except BaseException as exc:
                    # Cut short (cancelled, or its consumer stopped): what the step had is kept, and
                    # each call it did not finish is answered, or every later request would be refused.
                    unfinished = reply.tool_calls[len(results) :]
                    results.extend(_cut_short(call, call in started, exc) for call in unfinished)
                    with anyio.CancelScope(shield=True):
                        try:
                            await step.record(reply, *results, model=model, usage=usage, started=started)
                        except Exception:
                            logger.exception("thread %r: could not record the interrupted step", thread)
                    raise
                # Shielded as the path above is: the tools ran (their effects happened), so a
                # cancellation arriving now waits for the record instead of losing the step.
                with anyio.CancelScope(shield=True):
                    await step.record(reply, *results, model=model, usage=usage, started=started)
            yield StepFinished(reply, number)
            if not reply.tool_calls:
                await self.complete_run(thread, clean=True)
                yield RunFinished(reply, number, clean=True)
                return
        await self.complete_run(thread, clean=False)
        yield RunFinished(reply, max_steps, clean=False)


async def _guarded(hook: Hook, event: str, call: Awaitable[None]) -> None:
    """Await one hook event; an optional hook's failure is logged instead of raised."""
    try:
        await call
    except Exception:
        if not hook.optional:
            raise
        logger.exception("optional hook %r failed in %s; continuing", hook, event)


async def _request(compactor: Compactor, thread: str) -> tuple[list[Message], int]:
    """The working context a step sends and its messages' tokens, from the compactor's per-thread cache."""
    return await compactor._counted_context(thread)


_BLOCKING_SHAPE = "async def llm(messages) -> Message | Reply"
_STREAMING_SHAPE = "an async generator function, async def llm(messages): yield text deltas and tool calls"


def _check_blocking_llm(llm: object) -> None:
    """Refuse an ``llm`` that ``run`` cannot await: not callable, a plain ``def``, or a streaming model."""
    if not callable(llm):
        raise ConfigError("llm", f"must be an async function, {_BLOCKING_SHAPE}", value=llm)
    if returns_awaitable(llm) is False:
        if inspect.isasyncgenfunction(unwrapped(llm)):
            reason = (
                "is a streaming model (an async generator); run() awaits one reply: "
                "pass it to loop.stream(...), or pass the blocking callable (llm, not llm.stream)"
            )
        else:
            reason = (
                f"is not async, but run() awaits it: define it as {_BLOCKING_SHAPE} "
                "(run a blocking client with anyio.to_thread.run_sync inside it)"
            )
        raise ConfigError("llm", reason, value=llm)


def _check_streaming_llm(llm: object) -> None:
    """Refuse an ``llm`` that ``stream`` cannot iterate: not callable, or an ``async def`` of one reply."""
    if not callable(llm):
        raise ConfigError("llm", f"must be a streaming model, {_STREAMING_SHAPE}", value=llm)
    if returns_awaitable(llm) is True:
        raise ConfigError(
            "llm",
            f"returns one awaited reply, but stream() iterates the model's output: pass {_STREAMING_SHAPE} "
            "(chat_llm(...).stream, ScriptedModel(...).stream), or call loop.run(...) with this one",
            value=llm,
        )


def _stream_of(llm: StreamingLLM, messages: list[Message]) -> AsyncIterator[str | ToolCall | Message | Reply]:
    """``llm(messages)``, checked to be an async iterator (a plain ``def`` may return one)."""
    chunks: object = llm(messages)
    if not isinstance(chunks, AsyncIterable):
        if inspect.iscoroutine(chunks):
            chunks.close()  # never awaited: closed here rather than warned about by the collector
        raise ConfigError(
            "llm",
            f"returned a {type(chunks).__name__} rather than an async iterator; pass {_STREAMING_SHAPE}",
            value=llm,
        )
    return cast("AsyncIterator[str | ToolCall | Message | Reply]", chunks)


def _tool_mapping(tools: object) -> Mapping[str, Tool]:
    """``tools`` as ``{name: async function}``; a list of functions is keyed by their ``__name__``."""
    if tools is None:
        return {}
    if isinstance(tools, Mapping):
        named: dict[str, Any] = {}
        for name, tool in tools.items():
            if not isinstance(name, str):
                raise ConfigError(
                    "tools", f"must map tool names (str) to async functions, not {name!r}", value=tools
                )
            named[name] = tool
    elif isinstance(tools, Sequence) and not isinstance(tools, str | bytes):
        named = {}
        for index, tool in enumerate(tools):
            name = getattr(tool, "__name__", None)
            if isinstance(tool, Mapping):
                raise ConfigError(
                    f"tools[{index}]",
                    "is a tool schema, but the step loop runs the tools: pass the async functions "
                    "(a list of them, or {name: function}); schemas go to chat_llm only",
                    value=tool,
                )
            if not callable(tool):
                raise ConfigError(f"tools[{index}]", "must be an async function", value=tool)
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(
                    f"tools[{index}]",
                    "has no name of its own (a partial or a lambda): "
                    "name it with a mapping, {'name': function}",
                    value=tool,
                )
            if name in named:
                raise ConfigError(
                    f"tools[{index}]",
                    f"is named {name!r} like another tool in the list: name them apart with a mapping, "
                    "{'name': function}",
                    value=tool,
                )
            named[name] = tool
    else:
        raise ConfigError(
            "tools",
            f"must be {{name: async function}} or a list of async functions, not a {type(tools).__name__}",
            value=tools,
        )
    for name, tool in named.items():
        if not callable(tool):
            raise ConfigError(f"tools[{name!r}]", "must be an async function", value=tool)
        if returns_awaitable(tool) is False:
            raise ConfigError(
                f"tools[{name!r}]",
                f"is not async, but the step loop awaits its tools: define it as 'async def {name}(...)' "
                "(run blocking work with anyio.to_thread.run_sync inside it)",
                value=tool,
            )
    return named


async def _run_tool(tools: Mapping[str, Tool], call: ToolCall) -> Message:
    """Run one tool call; a missing tool or a tool's exception becomes an error result for the model."""
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return Message.tool(call.id, f"error: no tool named {call.name!r} (known: {known})", is_error=True)
    arguments = call.parsed_arguments()
    try:
        pending = tool(**arguments) if isinstance(arguments, dict) else tool(arguments)
    except Exception as exc:  # arguments the tool does not take, say
        return _tool_failed(call, exc)
    pending = awaited(pending, tool, f"tools[{call.name!r}]", f"async def {call.name}(...)")
    try:
        output = await pending
    except Exception as exc:
        return _tool_failed(call, exc)
    if isinstance(output, Message):
        if output.role is Role.TOOL and output.tool_call_id == call.id:
            return output
        # Recorded as the result, it would leave the call unanswered in every later request.
        wrong = ConfigError(
            f"tools[{call.name!r}]",
            f"returned a {output.role.value} message, not the result of call {call.id!r}: return the "
            f"output (a str, or a value JSON can carry), or Message.tool({call.id!r}, ...)",
            value=output,
        )
        return _tool_failed(call, wrong)
    text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False, default=str)
    return Message.tool(call.id, text)


def _cut_short(call: ToolCall, started: bool, exc: BaseException) -> Message:
    """The error result of a call its step did not finish: no result will ever come for it.

    Left unanswered, the call would be followed by the next user message in
    every later request, which OpenAI's and Anthropic's APIs refuse.
    """
    how = f"stopped on {type(exc).__name__}" if isinstance(exc, Exception) else "was cut short"
    when = "before this tool returned" if started else "before this tool ran"
    return Message.tool(call.id, f"error: interrupted: the step {how} {when}", is_error=True)


def _tool_failed(call: ToolCall, exc: Exception) -> Message:
    """A tool's exception as its result: the model gets the error, the log the traceback."""
    logger.warning(
        "tool %r (call %s) failed; the model gets an error result", call.name, call.id, exc_info=exc
    )
    return Message.tool(call.id, f"error: {type(exc).__name__}: {exc}", is_error=True)
