"""Plain records that cross the storage interface, and the limits every input obeys."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "LIMITS",
    "AppendResult",
    "Limits",
    "PinOutcome",
    "ProgramEnd",
    "SnapshotRecord",
    "StoredProgramEnd",
    "StoredToolCall",
    "Tenant",
    "ToolCall",
]


@dataclass(frozen=True, slots=True)
class Limits:
    """Input limits (characters, counts, seconds). Documented in controlplane/README.md."""

    tenant_name: int = 64
    event_id: int = 128
    program_id: int = 256
    tool_name: int = 128
    tool_args: int = 4096
    batch_events: int = 1000
    total_turns: int = 100_000
    context_tokens: int = 1_000_000_000
    cdf_points: int = 1000
    max_duration_s: float = 24 * 3600.0


LIMITS = Limits()


class PinOutcome(IntEnum):
    """What happened to a pin (the proto enum's numbers)."""

    UNSPECIFIED = 0
    HIT = 1
    EXPIRED = 2
    RELEASED_UNDER_PRESSURE = 3
    NOT_PINNED = 4


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant; ``share``: its events feed the cross-tenant priors."""

    id: int
    name: str
    share: bool
    created_at: float
    revoked_at: float | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One finished tool call, validated (see ``controlplane.validation``)."""

    event_id: str
    program_id: str
    tool_name: str
    tool_args: str
    duration_s: float
    finished_at: float | None = None
    turn_index: int = 0
    chosen_ttl_s: float | None = None
    pin_outcome: PinOutcome = PinOutcome.UNSPECIFIED
    admission_delay_s: float | None = None


@dataclass(frozen=True, slots=True)
class StoredToolCall:
    """A committed tool call: its position ``seq`` in the log, tenant and sharing flag."""

    seq: int
    tenant: str
    shared: bool
    call: ToolCall


@dataclass(frozen=True, slots=True)
class ProgramEnd:
    """The end of one program."""

    program_id: str
    total_turns: int
    finished_at: float | None = None


@dataclass(frozen=True, slots=True)
class StoredProgramEnd:
    """A committed program end and its position ``seq`` in the log."""

    seq: int
    tenant: str
    end: ProgramEnd


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What one committed batch stored: the new rows' positions and the ignored repeats."""

    seqs: tuple[int, ...]
    duplicates: int

    @property
    def accepted(self) -> int:
        return len(self.seqs)


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    """A pickled model snapshot covering the log up to ``tool_seq`` / ``end_seq``."""

    policy: str
    tool_seq: int
    end_seq: int
    created_at: float
    payload: bytes
