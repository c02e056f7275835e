"""Episodes: the append-only audit trail's records, and summarizer usage.

Every original message, every LLM call and every compaction becomes one
episode. Replaying a thread's episodes gives back the whole conversation,
however often its working context was compacted.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ._messages import Message, Role, ToolCall
from ._policy import Reason, known_reason
from ._trusted import trusted

__all__ = [
    "Episode",
    "EpisodeKind",
    "EpisodeRecord",
    "HistoryClearedEpisode",
    "LlmCallEpisode",
    "ManualRecoveryBoundary",
    "MessagesRetractedEpisode",
    "RunCompletedEpisode",
    "SummaryCheckpoint",
    "SystemMessageEpisode",
    "ToolCallEpisode",
    "ToolResultEpisode",
    "Usage",
    "UserMessageEpisode",
    "conversation",
    "episode_for",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Usage(_Frozen):
    """Tokens a model call consumed."""

    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
        )


class UserMessageEpisode(_Frozen):
    """A user message entered the conversation."""

    kind: Literal["user_message"] = "user_message"
    message: Message


class SystemMessageEpisode(_Frozen):
    """A system message (a prompt, an instruction) entered the conversation."""

    kind: Literal["system_message"] = "system_message"
    message: Message


class LlmCallEpisode(_Frozen):
    """The agent's model was called: what was sent, in short, and the reply."""

    kind: Literal["llm_call"] = "llm_call"
    reply: Message
    request_messages: int = Field(default=0, ge=0)
    request_tokens: int = Field(default=0, ge=0)
    model: str | None = None
    usage: Usage | None = None


class ToolCallEpisode(_Frozen):
    """A tool the assistant called started running."""

    kind: Literal["tool_call"] = "tool_call"
    call: ToolCall


class ToolResultEpisode(_Frozen):
    """A tool's result entered the conversation."""

    kind: Literal["tool_result"] = "tool_result"
    message: Message


class RunCompletedEpisode(_Frozen):
    """A run ended; only a clean end resets the unfinished-turns count."""

    kind: Literal["run_completed"] = "run_completed"
    clean: bool = True


class SummaryCheckpoint(_Frozen):
    """A compaction folded short-term messages ``from_seq..through_seq`` into ``summary``."""

    kind: Literal["summary_checkpoint"] = "summary_checkpoint"
    trigger: Annotated[Reason | str, BeforeValidator(known_reason)]
    """Why the fold happened: a :class:`Reason` for every built-in trigger, else a custom trigger's name."""
    from_seq: int
    through_seq: int
    summary: str
    model: str | None = None
    usage: Usage = Field(default_factory=Usage)
    degraded: bool = False
    dropped_messages: int = Field(default=0, ge=0)
    tokens_before: int = Field(default=0, ge=0)
    tokens_after: int = Field(default=0, ge=0)
    log_from_seq: int | None = None
    """Episodic seq of the oldest original message the fold covers, when known."""
    log_through_seq: int | None = None
    """Episodic seq of the newest original message the fold covers, when known."""


class ManualRecoveryBoundary(_Frozen):
    """An operator's clean-slate boundary; never written automatically."""

    kind: Literal["manual_recovery"] = "manual_recovery"
    reason: Annotated[Reason | str, BeforeValidator(known_reason)] = Reason.MANUAL_RECOVERY
    through_seq: int | None = None


class MessagesRetractedEpisode(_Frozen):
    """The newest ``count`` messages of the conversation were withdrawn (a session's ``pop_item``).

    The retracted messages stay in the log; :func:`conversation` leaves them out.
    """

    kind: Literal["messages_retracted"] = "messages_retracted"
    count: int = Field(default=1, ge=1)


class HistoryClearedEpisode(_Frozen):
    """Every message so far was withdrawn (a session's ``clear_session``); the log keeps them."""

    kind: Literal["history_cleared"] = "history_cleared"


Episode = Annotated[
    UserMessageEpisode
    | SystemMessageEpisode
    | LlmCallEpisode
    | ToolCallEpisode
    | ToolResultEpisode
    | RunCompletedEpisode
    | SummaryCheckpoint
    | ManualRecoveryBoundary
    | MessagesRetractedEpisode
    | HistoryClearedEpisode,
    Field(discriminator="kind"),
]
EpisodeKind = Literal[
    "user_message",
    "system_message",
    "llm_call",
    "tool_call",
    "tool_result",
    "run_completed",
    "summary_checkpoint",
    "manual_recovery",
    "messages_retracted",
    "history_cleared",
]


class EpisodeRecord(_Frozen):
    """An episode as stored: its thread, its sequence number and when it was recorded."""

    thread: str
    seq: int
    at: datetime
    episode: Episode


_EPISODE_OF_ROLE: dict[Role, type[UserMessageEpisode | SystemMessageEpisode | ToolResultEpisode]] = {
    Role.USER: UserMessageEpisode,
    Role.SYSTEM: SystemMessageEpisode,
    Role.TOOL: ToolResultEpisode,
}
"""The episode that records a message of each role but the assistant's (an LLM call)."""

_KIND_OF_ROLE: dict[Role, str] = {
    role: kind.model_fields["kind"].default for role, kind in _EPISODE_OF_ROLE.items()
}
"""The ``kind`` of each role's episode, looked up once (a model's fields are dearer to read per call)."""


def episode_for(
    message: Message,
    *,
    model: str | None = None,
    usage: Usage | None = None,
    request_messages: int = 0,
    request_tokens: int = 0,
) -> Episode:
    """The episode that records ``message`` entering a conversation.

    The keyword arguments describe the request behind an assistant reply and
    are ignored for other roles.
    """
    if type(message) is not Message:
        return _validated_episode_for(message, model, usage, request_messages, request_tokens)
    # A Message is checked when it is built (and again by the store that records it); validating
    # the episode around it would run the message's own checks once more, on every step.
    role = message.role
    kind = _EPISODE_OF_ROLE.get(role)
    if kind is not None:
        return trusted(kind, kind=_KIND_OF_ROLE[role], message=message)
    if model is None and usage is None and request_messages == 0 and request_tokens == 0:
        return trusted(
            LlmCallEpisode,
            kind="llm_call",
            reply=message,
            request_messages=0,
            request_tokens=0,
            model=None,
            usage=None,
        )
    return _validated_episode_for(message, model, usage, request_messages, request_tokens)


def _validated_episode_for(
    message: Message, model: str | None, usage: Usage | None, request_messages: int, request_tokens: int
) -> Episode:
    """``episode_for`` through the episodes' own validation: for anything but a Message and default fields."""
    kind = _EPISODE_OF_ROLE.get(message.role)
    if kind is not None:
        return kind(message=message)
    return LlmCallEpisode(
        reply=message,
        model=model,
        usage=usage,
        request_messages=request_messages,
        request_tokens=request_tokens,
    )


def conversation(records: Iterable[EpisodeRecord]) -> list[Message]:
    """The original conversation, message by message, from replayed episodes.

    Retractions and clears are applied, so the result is the conversation as
    it stands, not every message ever recorded.
    """
    out: list[Message] = []
    for record in records:
        episode = record.episode
        if isinstance(episode, UserMessageEpisode | SystemMessageEpisode | ToolResultEpisode):
            out.append(episode.message)
        elif isinstance(episode, LlmCallEpisode):
            out.append(episode.reply)
        elif isinstance(episode, MessagesRetractedEpisode):
            del out[max(0, len(out) - episode.count) :]
        elif isinstance(episode, HistoryClearedEpisode):
            out.clear()
    return out
