"""The step loop: the hook chain around each LLM request, and the events a driven run streams."""

from ._loop import (
    LLM,
    Compacted,
    CompactionHook,
    Hook,
    Reply,
    RunFinished,
    RunResult,
    Step,
    StepEvent,
    StepFinished,
    StepLoop,
    StreamingLLM,
    TextDelta,
    Tool,
    ToolFinished,
    ToolStarted,
)

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
