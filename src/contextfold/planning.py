"""The pure building blocks of compaction: triggers, strategies and the cut planner.

Pass them straight to a ``Compactor``::

    Compactor(
        store,
        trigger=TokenCount(8000) | TurnCount(200),
        strategy=[ObservationMasking(2), TokenBudget(4000)],
    )

Nothing here does I/O; ``CompactionConfig.plan`` is a pure function of a
message list, and is what the compactor runs when a trigger fires.
"""

from ._policy import (
    TOKEN_REASONS,
    AllOf,
    AnyOf,
    EpisodicCompactionConfig,
    EpisodicCompactionPressure,
    EpisodicCompactionTrigger,
    EpisodicPolicy,
    MessageCount,
    Pressure,
    Reason,
    TokenCount,
    Trigger,
    TurnCount,
    episodic_compaction_trigger,
)
from ._strategies import (
    MASKED_METADATA_KEY,
    CompactionConfig,
    CompactionPlan,
    ObservationMasking,
    Orphan,
    SlidingWindow,
    Strategy,
    TokenBudget,
    Unit,
    group_units,
    split_head,
)

__all__ = [
    "MASKED_METADATA_KEY",
    "TOKEN_REASONS",
    "AllOf",
    "AnyOf",
    "CompactionConfig",
    "CompactionPlan",
    "EpisodicCompactionConfig",
    "EpisodicCompactionPressure",
    "EpisodicCompactionTrigger",
    "EpisodicPolicy",
    "MessageCount",
    "ObservationMasking",
    "Orphan",
    "Pressure",
    "Reason",
    "SlidingWindow",
    "Strategy",
    "TokenBudget",
    "TokenCount",
    "Trigger",
    "TurnCount",
    "Unit",
    "episodic_compaction_trigger",
    "group_units",
    "split_head",
]
