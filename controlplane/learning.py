"""Bounds on what one tenant can make the models hold, and learning that never fails.

Learning runs after a batch is committed, so it must never raise: a committed row that a
model cannot learn is skipped (its position still counts as applied, so the models stay
a replay of the log), counted by reason and logged (``cachettl_events_unlearned_total``).

Per tenant, the models hold at most ``NameLimits.max_tools`` distinct tool names and
``NameLimits.max_signatures`` distinct (tool, argument signature) pairs. A batch that
would pass either is refused whole before anything is stored (``NameLimitExceededError``,
RESOURCE_EXHAUSTED, the message names the limit and its flag). Rows past a bound that
reach the log anyway (written through a server with higher limits, or committed by
another server at the same moment) are skipped by learning, reason ``name_limit``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

from controlplane.errors import OverloadedError
from controlplane.records import StoredProgramEnd, StoredToolCall, ToolCall

if TYPE_CHECKING:  # light at import: the CLI reads NameLimits' defaults for its flags
    from controlplane.storage.base import Compaction
    from estimator.hierarchy import DurationHierarchy

__all__ = [
    "LearningCounters",
    "NameLimitExceededError",
    "NameLimits",
    "RetentionCounters",
    "check_names",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NameLimits:
    """Distinct names per tenant the models hold (None: unbounded)."""

    max_tools: int | None = 1000
    max_signatures: int | None = 10_000

    def __post_init__(self) -> None:
        for name in ("max_tools", "max_signatures"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')}-per-tenant must be >= 1")

    def apply(self, durations: DurationHierarchy) -> None:
        durations.max_tools = self.max_tools
        durations.max_signatures = self.max_signatures

    def holds_for(self, durations: DurationHierarchy) -> bool:
        """Whether ``durations`` (say, restored from a snapshot) was built with these."""
        return (durations.max_tools, durations.max_signatures) == (
            self.max_tools,
            self.max_signatures,
        )


class NameLimitExceededError(OverloadedError):
    """A batch would give its tenant more distinct names than a bound (nothing stored);
    ``limit`` is ``"tools"`` or ``"signatures"``."""

    retryable = False  # the same batch is refused again until an operator raises the bound

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


_FLAGS = {"tool names": "--max-tools-per-tenant", "signatures": "--max-signatures-per-tenant"}


def check_names(
    durations: DurationHierarchy,
    tenant: str,
    calls: Sequence[ToolCall],
    earlier: Sequence[ToolCall] = (),
) -> None:
    """Raise ``NameLimitExceededError`` if learning ``calls`` would pass a bound of ``tenant``,
    after ``earlier`` (the tenant's calls admitted before them and not learned yet, which
    are within the bounds).

    Call it under the writer lock (names change only there); it reads the models and the
    signature cache but changes neither (decisions use them concurrently).
    """
    max_tools, max_signatures = durations.max_tools, durations.max_signatures
    tools, signatures = durations.name_counts(tenant)
    n = len(earlier) + len(calls)
    # Far from both bounds (the usual case), the batch cannot pass them: nothing to parse.
    if max_tools is None or tools + n <= max_tools:
        max_tools = None
    if max_signatures is None or signatures + n <= max_signatures:
        max_signatures = None
    if max_tools is None and max_signatures is None:
        return
    new_tools: set[str] = set()
    new_signatures: set[tuple[str, str]] = set()
    for i, call in enumerate(chain(earlier, calls), -len(earlier)):  # i: index in calls
        tool = call.tool
        if tool not in new_tools and not durations.knows(tool, "", tenant):
            new_tools.add(tool)
            if max_tools is not None and tools + len(new_tools) > max_tools and i >= 0:
                _refuse(f"events[{i}].tool_name", tenant, "tool names", max_tools, tools)
        if max_signatures is None or not call.tool_args:
            continue
        try:
            signature = durations.signatures.compute(tool, call.tool_args)
        except Exception:  # a broken extractor: learning skips the row (counted, logged)
            continue
        key = (tool, signature)
        if signature and key not in new_signatures and not durations.knows(*key, tenant):
            new_signatures.add(key)
            if signatures + len(new_signatures) > max_signatures and i >= 0:
                field = f"events[{i}].tool_args"
                _refuse(field, tenant, "signatures", max_signatures, signatures)


def _refuse(field: str, tenant: str, what: str, limit: int, held: int) -> None:
    raise NameLimitExceededError(
        f"{field}: tenant {tenant!r} holds {held} distinct {what} and this batch would pass "
        f"the limit of {limit} per tenant (server flag {_FLAGS[what]}); nothing was stored",
        "tools" if what == "tool names" else "signatures",
    )


class LearningCounters:
    """Committed rows the models could not learn, by reason; batches refused, by limit;
    group commits and the batches they committed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.unlearned: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.commits = 0
        self.batches_committed = 0

    def committed(self, batches: int) -> None:
        """Count one store commit of ``batches`` batches (under the write lock)."""
        self.commits += 1
        self.batches_committed += batches

    def skipped(self, row: StoredToolCall | StoredProgramEnd, error: Exception) -> None:
        """Count and log one row learning skipped."""
        from estimator.hierarchy import NameLimitError

        reason = "name_limit" if isinstance(error, NameLimitError) else type(error).__name__
        with self._lock:
            self.unlearned[reason] += 1
        if isinstance(row, StoredToolCall):
            what = f"tool call {row.seq} (tool {row.call.tool!r})"
        else:
            what = f"program end {row.seq}"
        log.warning(
            "learning skipped %s of tenant %r: %s: %s",
            what,
            row.tenant,
            type(error).__name__,
            error,
            exc_info=not isinstance(error, NameLimitError),
        )

    def refused_batch(self, error: NameLimitExceededError) -> None:
        with self._lock:
            self.refused[error.limit] += 1


class RetentionCounters:
    """The log's compactions by one server: how many, the rows they deleted per log, the
    latest (its positions, time and the rows kept then), and how often its models started
    again from a snapshot because the log was compacted past them (``reloads``)."""

    def __init__(self) -> None:
        self.compactions = 0
        self.reloads = 0
        self.deleted = {"tool_calls": 0, "program_ends": 0}
        self.latest: Compaction | None = None

    def counted(self, done: Compaction) -> None:
        self.compactions += 1
        self.deleted["tool_calls"] += done.tool_rows_deleted
        self.deleted["program_ends"] += done.end_rows_deleted
        self.latest = done
