"""The episodic log's records: one episode per message, model call, tool call, run end and fold.

``conversation(records)`` turns a replayed log back into the conversation.
"""

from ._episodes import (
    Episode,
    EpisodeKind,
    EpisodeRecord,
    HistoryClearedEpisode,
    LlmCallEpisode,
    ManualRecoveryBoundary,
    MessagesRetractedEpisode,
    RunCompletedEpisode,
    SummaryCheckpoint,
    SystemMessageEpisode,
    ToolCallEpisode,
    ToolResultEpisode,
    Usage,
    UserMessageEpisode,
    conversation,
    episode_for,
)

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
