"""Messages and their OpenAI and Anthropic wire formats, and the metadata keys contextfold writes."""

from ._compactor import (
    ABANDONED_METADATA_KEY,
    LATE_RESULT_METADATA_KEY,
    SUMMARY_PREFIX,
    TRUNCATED_METADATA_KEY,
)
from ._messages import (
    SUMMARY_METADATA_KEY,
    TOOL_ERROR_METADATA_KEY,
    Message,
    Role,
    ToolCall,
    from_anthropic,
    from_openai,
    to_anthropic,
    to_openai,
)
from ._strategies import MASKED_METADATA_KEY

__all__ = [
    "ABANDONED_METADATA_KEY",
    "LATE_RESULT_METADATA_KEY",
    "MASKED_METADATA_KEY",
    "SUMMARY_METADATA_KEY",
    "SUMMARY_PREFIX",
    "TOOL_ERROR_METADATA_KEY",
    "TRUNCATED_METADATA_KEY",
    "Message",
    "Role",
    "ToolCall",
    "from_anthropic",
    "from_openai",
    "to_anthropic",
    "to_openai",
]
