"""``maybe_compact`` and manual compaction: the orchestration of one fold.

The per-step check is the hot path. It asks the short-term store for its
maintained counters (and, with an episodic policy, the episodic store for its
pressure counters) and returns ``None`` when no trigger fires, without loading
the thread or tokenizing anything. Only a firing trigger loads the working
context, plans the cut, summarizes the newly dropped turns, records a
``SummaryCheckpoint`` and swaps the prefix in one guarded, atomic write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ._config import RunOptions, SummarizeOptions
from ._episodes import (
    ManualRecoveryBoundary,
    RunCompletedEpisode,
    SummaryCheckpoint,
    Usage,
    episode_for,
)
from ._errors import ConfigError, ConflictError, SummarizerError
from ._messages import SUMMARY_METADATA_KEY, Message, Role
from ._policy import EpisodicCompactionPressure, EpisodicCompactionTrigger, Pressure
from ._strategies import CompactionConfig, CompactionPlan, SlidingWindow
from ._tokens import TiktokenCounter, TokenCounter
from .stores._base import ContextWindow, EpisodicStore, ShortTermStore, StoredMessage
from .summarizers._base import Summarizer, Summary

__all__ = [
    "SUMMARY_PREFIX",
    "TRUNCATED_METADATA_KEY",
    "CompactionResult",
    "Compactor",
    "maybe_compact",
]

logger = logging.getLogger("contextfold")

SUMMARY_PREFIX = "[compacted summary of earlier turns]\n"
"""Text that opens every summary message, so a person skimming a context can tell it apart."""

TRUNCATED_METADATA_KEY = "contextfold.truncated"
"""Metadata key on a tool result whose oversized output was cut to fit the hard limit."""

_MAX_CONFLICT_RETRIES = 5
_MAX_BACKOFF_SKIPS = 32


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What one compaction did, or why it could not make progress."""

    thread: str
    reason: str
    dropped_messages: int
    dropped_turns: int
    tokens_before: int
    tokens_after: int
    usage: Usage = field(default_factory=Usage)
    duration_s: float = 0.0
    masked_messages: int = 0
    truncated_messages: int = 0
    summarizer_model: str | None = None
    degraded: bool = False
    checkpoint_seq: int | None = None
    """Episodic seq of the recorded ``SummaryCheckpoint``."""
    through_seq: int | None = None
    """Last short-term seq the fold replaced."""
    stalled: bool = False
    """True when the trigger fired but nothing could be folded (the kept tail alone is too big)."""
    detail: str = ""

    @property
    def compacted(self) -> bool:
        return not self.stalled


@dataclass(slots=True)
class _Backoff:
    """Per-thread memory of fruitless attempts, so a stuck thread is not re-planned every step."""

    failures: int = 0
    skips_left: int = 0


def _summary_body(message: Message) -> str:
    return message.text.removeprefix(SUMMARY_PREFIX)


class Compactor:
    """Folds the older part of threads, as configured by ``RunOptions``.

    ``store`` is one object implementing both store protocols (every bundled
    backend does); pass ``short_term`` and ``episodic`` to use two. The
    summarizer defaults to the offline :class:`ExtractiveSummarizer`, which is
    also the fallback when ``on_summarizer_error="fallback"``.
    """

    def __init__(
        self,
        store: Any = None,
        *,
        options: RunOptions,
        summarizer: Summarizer | None = None,
        counter: TokenCounter | None = None,
        short_term: ShortTermStore | None = None,
        episodic: EpisodicStore | None = None,
        fallback: Summarizer | None = None,
    ) -> None:
        from .summarizers import ExtractiveSummarizer

        short_term = short_term if short_term is not None else store
        episodic = episodic if episodic is not None else store
        if not isinstance(short_term, ShortTermStore):
            raise ConfigError(
                "short_term",
                "must implement ShortTermStore; pass a MemoryStore, SQLiteStore or PostgresStore",
                value=short_term,
            )
        if not isinstance(episodic, EpisodicStore):
            raise ConfigError(
                "episodic",
                "must implement EpisodicStore; pass a MemoryStore, SQLiteStore or PostgresStore",
                value=episodic,
            )
        if not isinstance(options, RunOptions):
            raise ConfigError("options", "must be RunOptions(...)", value=options)
        self.short_term: ShortTermStore = short_term
        self.episodic: EpisodicStore = episodic
        self.options = options
        self.counter: TokenCounter = counter if counter is not None else TiktokenCounter()
        self.fallback: Summarizer = (
            fallback if fallback is not None else ExtractiveSummarizer(counter=self.counter)
        )
        self.summarizer: Summarizer = summarizer if summarizer is not None else self.fallback
        self._config: CompactionConfig | None = (
            options.compaction.compaction_config() if options.compaction is not None else None
        )
        self._backoff: dict[str, _Backoff] = {}

    # Recording ---------------------------------------------------------------

    async def append(
        self,
        thread: str,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        usage: Usage | None = None,
        request_messages: int = 0,
        request_tokens: int = 0,
    ) -> list[StoredMessage]:
        """Record messages in the episodic log, then append them to the working context.

        The recording comes first so that no message can reach short-term memory
        without being in the audit trail. The LLM-call fields describe the
        request that produced an assistant reply.
        """
        tokens = [self.counter.count(message) for message in messages]
        for message in messages:
            episode = episode_for(
                message,
                model=model,
                usage=usage,
                request_messages=request_messages,
                request_tokens=request_tokens,
            )
            await self.episodic.record(thread, episode)
        return await self.short_term.append(thread, messages, tokens)

    async def complete_run(self, thread: str, *, clean: bool = True) -> None:
        """Record the end of a run; a clean end resets the unfinished-turns count."""
        await self.episodic.record(thread, RunCompletedEpisode(clean=clean))

    async def context(self, thread: str) -> list[Message]:
        """The working context the next request is built from."""
        return (await self.short_term.load(thread)).plain

    # The per-step check ----------------------------------------------------------

    async def maybe_compact(self, thread: str, *, now: datetime | None = None) -> CompactionResult | None:
        """Compact ``thread`` if a trigger fires; ``None`` when it does not (the cheap path)."""
        opts = self.options.compaction
        if opts is None or self._config is None:
            return None
        stats = await self.short_term.stats(thread)
        episodic = None
        if opts.episodic is not None:
            episodic = await self.episodic.pressure(
                thread, now=now, estimated_context_tokens=stats.total_tokens
            )
        # Messages bound turns from above, so a monotone trigger that stays quiet here
        # stays quiet on the exact turn count too; the plan re-checks with exact turns.
        reason = self._config.trigger.reason(
            Pressure(stats.message_count, stats.total_tokens, episodic=episodic)
        )
        if reason is None:
            return None
        backoff = self._backoff.get(thread)
        if backoff is not None and backoff.skips_left > 0:
            backoff.skips_left -= 1
            return None
        return await self._compact(thread, opts, self._config, reason=None, episodic=episodic)

    async def compact_now(
        self, thread: str, *, reason: str = "manual", summarize: bool = True
    ) -> CompactionResult | None:
        """Compact ``thread`` now, whatever the triggers say.

        With ``reason="manual_recovery"`` this writes an operator's clean-slate
        boundary: every turn but a still-running tool step is folded into the
        summary (or dropped, with ``summarize=False``), and a
        ``ManualRecoveryBoundary`` is recorded after the checkpoint.
        """
        opts = self.options.compaction or SummarizeOptions(
            trigger_token_budget=self.options.max_history_tokens
        )
        if not summarize:
            opts = opts.model_copy(update={"mode": "drop"})
        config = opts.compaction_config()
        manual = reason == EpisodicCompactionTrigger.MANUAL_RECOVERY.value
        if manual:
            config = CompactionConfig(config.trigger, SlidingWindow(0), min_recent_turns=0)
        result = await self._compact(thread, opts, config, reason=reason, episodic=None)
        if manual and result is not None and not result.stalled:
            boundary = ManualRecoveryBoundary(reason=reason, through_seq=result.through_seq)
            await self.episodic.record(thread, boundary)
        return result

    # The fold itself ---------------------------------------------------------------

    async def _compact(
        self,
        thread: str,
        opts: SummarizeOptions,
        config: CompactionConfig,
        *,
        reason: str | None,
        episodic: EpisodicCompactionPressure | None,
    ) -> CompactionResult | None:
        async with self.short_term.compaction_lock(thread) as acquired:
            if not acquired:
                logger.debug("thread %r: another worker is compacting it; skipping", thread)
                return None
            for _ in range(_MAX_CONFLICT_RETRIES):
                try:
                    return await self._compact_once(thread, opts, config, reason, episodic)
                except ConflictError:
                    logger.info("thread %r changed during compaction; reading it again", thread)
            logger.warning("thread %r kept changing during compaction; giving up this step", thread)
            return None

    async def _load(self, thread: str, opts: SummarizeOptions) -> ContextWindow:
        window = await self.short_term.load(thread, max_tokens=opts.window_tokens)
        if not window.complete:
            # Older messages than the window can see must still be summarized, never discarded.
            logger.warning(
                "thread %r holds %d tokens, more than the %d-token compaction window; loading it whole",
                thread,
                window.total_tokens,
                opts.window_tokens,
            )
            window = await self.short_term.load(thread)
        return window

    async def _compact_once(
        self,
        thread: str,
        opts: SummarizeOptions,
        config: CompactionConfig,
        forced: str | None,
        episodic: EpisodicCompactionPressure | None,
    ) -> CompactionResult | None:
        started = time.perf_counter()
        window = await self._load(thread, opts)
        stored = window.messages
        messages = window.plain
        plan = config.plan(
            messages,
            window.total_tokens,
            message_tokens=window.tokens,
            episodic=episodic,
            force_reason=forced,
        )
        if plan.reason is None:
            return None
        reason = plan.reason
        for orphan in plan.orphans:
            logger.warning(
                "thread %r: %s for tool call %r at body index %d",
                thread,
                orphan.problem.replace("_", " "),
                orphan.tool_call_id,
                orphan.index,
            )

        pinned_len = len(plan.pinned)
        previous_len = 1 if plan.previous_summary is not None else 0
        body_start = pinned_len + previous_len
        kept = list(plan.kept)
        truncated = self._cap_tool_outputs(kept, opts, window.total_tokens)
        kept_start = body_start + len(plan.dropped)
        changed_kept = [i for i, message in enumerate(kept) if message is not messages[kept_start + i]]

        if not plan.dropped and not plan.masked and not truncated:
            return self._stall(thread, reason, window.total_tokens, opts)

        summary: Summary | None = None
        new_head: list[Message] = list(plan.pinned)
        if opts.mode == "summarize" and plan.dropped:
            summary = await self._summarize(plan, opts)
            if summary is None:  # on_summarizer_error="skip"
                return self._stall(thread, reason, window.total_tokens, opts, "the summarizer failed")
            new_head.append(self._summary_message(summary, opts))
        elif plan.previous_summary is not None:
            new_head.append(plan.previous_summary)

        # Everything up to the last changed message is rewritten; the rest stays untouched.
        last_changed = max(changed_kept, default=-1)
        rewritten_kept = kept[: last_changed + 1]
        through_index = kept_start + last_changed
        replacement = new_head + rewritten_kept
        replacement_tokens = [
            stored[i].tokens if i < pinned_len else self.counter.count(m) for i, m in enumerate(replacement)
        ]
        removed_tokens = sum(s.tokens for s in stored[: through_index + 1])
        tokens_after = window.total_tokens - removed_tokens + sum(replacement_tokens)

        dropped_from = stored[body_start].seq
        through_seq = stored[through_index].seq
        model = summary.model if summary is not None else None
        usage = summary.usage if summary is not None else Usage()
        degraded = summary is not None and summary.degraded
        # The audit record comes first: a fold must never reach the working context
        # unrecorded. If the swap below then fails, the context stays as it was and the
        # checkpoint remains in the log as the record of an attempt that was not applied;
        # the version check here keeps that window as small as the store allows.
        if (await self.short_term.stats(thread)).version != window.version:
            raise ConflictError(f"thread {thread!r} was compacted by another worker")
        checkpoint = await self.episodic.record(
            thread,
            SummaryCheckpoint(
                trigger=reason,
                from_seq=dropped_from,
                through_seq=through_seq,
                summary=summary.text if summary is not None else "",
                model=model,
                usage=usage,
                degraded=degraded,
                dropped_messages=len(plan.dropped),
                tokens_before=window.total_tokens,
                tokens_after=tokens_after,
            ),
        )
        await self.short_term.replace_prefix(
            thread,
            through_seq=through_seq,
            expected_version=window.version,
            replacement=replacement,
            tokens=replacement_tokens,
        )
        self._backoff.pop(thread, None)
        result = CompactionResult(
            thread=thread,
            reason=reason,
            dropped_messages=len(plan.dropped),
            dropped_turns=plan.dropped_turns,
            tokens_before=window.total_tokens,
            tokens_after=tokens_after,
            usage=usage,
            duration_s=time.perf_counter() - started,
            masked_messages=plan.masked,
            truncated_messages=truncated,
            summarizer_model=model,
            degraded=degraded,
            checkpoint_seq=checkpoint.seq,
            through_seq=through_seq,
        )
        logger.info(
            "thread %r compacted (%s): %d messages dropped, %d -> %d tokens",
            thread,
            reason,
            result.dropped_messages,
            result.tokens_before,
            result.tokens_after,
        )
        return result

    def _stall(
        self, thread: str, reason: str, tokens: int, opts: SummarizeOptions, why: str = ""
    ) -> CompactionResult:
        backoff = self._backoff.setdefault(thread, _Backoff())
        backoff.failures += 1
        backoff.skips_left = min(2**backoff.failures - 1, _MAX_BACKOFF_SKIPS)
        detail = why or (
            f"nothing can be folded: the protected recent turns alone hold about {tokens} tokens, "
            f"over the {opts.trigger_token_budget}-token budget; raise the budget, lower "
            "min_recent_turns / keep_recent_messages, or set max_tool_output_tokens"
        )
        logger.warning("thread %r: %s (next %d checks skipped)", thread, detail, backoff.skips_left)
        return CompactionResult(
            thread=thread,
            reason=reason,
            dropped_messages=0,
            dropped_turns=0,
            tokens_before=tokens,
            tokens_after=tokens,
            stalled=True,
            detail=detail,
        )

    def _cap_tool_outputs(self, kept: list[Message], opts: SummarizeOptions, total: int) -> int:
        """Cut oversized tool outputs in place; return how many were cut.

        A tool output is oversized when it alone is over ``max_tool_output_tokens``,
        or, without that option, when the context is over the hard limit and the
        output is more than a quarter of it.
        """
        cap = opts.max_tool_output_tokens
        if cap is None:
            if total <= self.options.max_history_tokens:
                return 0
            cap = max(1, self.options.max_history_tokens // 4)
        cut = 0
        for index, message in enumerate(kept):
            if message.role is not Role.TOOL or message.metadata.get(TRUNCATED_METADATA_KEY):
                continue
            tokens = self.counter.count(message)
            if tokens <= cap:
                continue
            text = message.text
            keep_chars = max(1, int(len(text) * cap / tokens * 0.9))
            head = text[: keep_chars * 2 // 3]
            tail = text[len(text) - keep_chars // 3 :] if keep_chars // 3 else ""
            marker = f"\n[... about {tokens - cap} tokens of tool output cut by contextfold ...]\n"
            kept[index] = message.model_copy(
                update={
                    "content": head + marker + tail,
                    "metadata": {**message.metadata, TRUNCATED_METADATA_KEY: tokens},
                }
            )
            cut += 1
        return cut

    async def _summarize(self, plan: CompactionPlan, opts: SummarizeOptions) -> Summary | None:
        previous = _summary_body(plan.previous_summary) if plan.previous_summary is not None else None
        try:
            return await self.summarizer.summarize(
                plan.dropped, previous_summary=previous, max_summary_tokens=opts.max_summary_tokens
            )
        except Exception as exc:
            if opts.on_summarizer_error == "raise":
                if isinstance(exc, SummarizerError):
                    raise
                raise SummarizerError(f"summarizer {self.summarizer!r} failed: {exc!r}") from exc
            logger.warning("summarizer failed (%s); on_summarizer_error=%r", exc, opts.on_summarizer_error)
            if opts.on_summarizer_error == "skip" or self.summarizer is self.fallback:
                return None
        summary = await self.fallback.summarize(
            plan.dropped, previous_summary=previous, max_summary_tokens=opts.max_summary_tokens
        )
        return summary.model_copy(update={"degraded": True})

    def _summary_message(self, summary: Summary, opts: SummarizeOptions) -> Message:
        metadata: dict[str, Any] = {
            SUMMARY_METADATA_KEY: True,
            "contextfold.summary_model": summary.model,
        }
        if summary.degraded:
            metadata["contextfold.degraded"] = True
        return Message(role=opts.summary_role, content=SUMMARY_PREFIX + summary.text, metadata=metadata)


async def maybe_compact(
    store: Any,
    thread: str,
    *,
    options: RunOptions,
    summarizer: Summarizer | None = None,
    counter: TokenCounter | None = None,
    now: datetime | None = None,
) -> CompactionResult | None:
    """One compaction check for ``thread`` from any code: a ``Compactor`` used once.

    Prefer a long-lived :class:`Compactor` in a loop: it keeps the per-thread
    back-off that spares a stuck thread from being re-planned every step.
    """
    return await Compactor(store, options=options, summarizer=summarizer, counter=counter).maybe_compact(
        thread, now=now
    )
