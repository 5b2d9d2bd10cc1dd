"""Plain records that cross the storage interface, and the limits every input obeys."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Self

__all__ = [
    "LIMITS",
    "MAX_PROGRAM_LOCATIONS",
    "MAX_ROLLOUT_TOOLS",
    "MISSES",
    "AppendResult",
    "Limits",
    "MissQuery",
    "MissReason",
    "Move",
    "NotPinnedCause",
    "PinOutcome",
    "ProgramEnd",
    "Rollout",
    "RolloutMode",
    "SnapshotRecord",
    "StoredProgramEnd",
    "StoredToolCall",
    "Tenant",
    "ToolCall",
    "TurnCache",
    "parse_tools",
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
    misses_listed: int = 1000


LIMITS = Limits()


class PinOutcome(IntEnum):
    """What became of the KV cache of an LLM turn that called a tool.

    The one vocabulary of a pin's outcome: the engine hook's tracker
    (``enginehook.core.tracker.ToolCallReport.pin_outcome``), the simulator, the store and the wire
    (the numbers are those of the proto enum ``cachettl.v1.PinOutcome``).

    >>> PinOutcome.parse("hit"), PinOutcome.parse(2)
    (<PinOutcome.HIT: 1>, <PinOutcome.EXPIRED: 2>)
    >>> PinOutcome.parse("pressure").label
    'released_under_pressure'
    >>> [o.label for o in PinOutcome if o.feeds_queue_delay]
    ['expired', 'released_under_pressure', 'not_pinned']
    """

    #: Not known: the pin ended for a reason that is no outcome (its program ended, it was
    #: replaced, the engine shut down), or it was gone at admission with no release seen.
    UNSPECIFIED = 0
    #: The program came back while its cache was still pinned.
    HIT = 1
    #: The TTL ran out before the program came back.
    EXPIRED = 2
    #: Released early because the engine ran short of KV memory (or of its pin budget).
    RELEASED_UNDER_PRESSURE = 3
    #: The policy chose not to pin (TTL 0), or the pin was refused.
    NOT_PINNED = 4
    #: The program's next turn arrived at another engine (the control plane told this one,
    #: or a router dropped the pin to send it there); this engine released what it held.
    #: Neither a hit nor a waste of the TTL: the router, not the policy, decided where the
    #: program went; and its next turn was admitted elsewhere, so it is no sample of T.
    MOVED = 5

    @property
    def label(self) -> str:
        """The outcome's name in JSON (event logs, spill files): ``"hit"``, ``"expired"``..."""
        return self.name.lower()

    @property
    def feeds_queue_delay(self) -> bool:
        """Whether the next turn's admission delay is a sample of T: its cache had been
        released by a known cause (expired, under pressure, not pinned)."""
        return self in _QUEUE_DELAY_OUTCOMES

    @classmethod
    def parse(cls, value: int | str) -> PinOutcome:
        """An outcome from its number or label (also the labels of earlier releases,
        ``"pressure"`` and ``"other"``, found in old spill files); the error names it."""
        if isinstance(value, str):
            key = _LEGACY_LABELS.get(value, value)
            try:
                return cls[key.upper()]
            except KeyError:
                valid = ", ".join(o.label for o in cls)
                raise ValueError(f"unknown pin outcome {value!r}; valid: {valid}") from None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown pin outcome number {value!r}") from None


_QUEUE_DELAY_OUTCOMES = frozenset(
    {PinOutcome.EXPIRED, PinOutcome.RELEASED_UNDER_PRESSURE, PinOutcome.NOT_PINNED}
)
_LEGACY_LABELS = {"pressure": "released_under_pressure", "other": "unspecified"}


class _Labelled(IntEnum):
    """An enum of the wire whose JSON form is its lower-case name."""

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: int | str) -> Self:
        """A member from its number or label; the error names the valid labels."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                valid = ", ".join(m.label for m in cls)
                raise ValueError(f"unknown {cls.__name__} {value!r}; valid: {valid}") from None
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown {cls.__name__} number {value!r}") from None


class MissReason(_Labelled):
    """Whether a returning turn (the one after a tool call) found its previous turn's KV
    cache and, when it did not, why: one reason per returning turn, the first that applies.

    With what the engine saw at admission (hit tokens, the reusable prefix: the tokens of
    the returning prompt that the previous turn's cached blocks could serve, block-exact):

    1. ``DIVERGED``: the prompt differs from the previous turn's cached prefix at token k
       (``diverged_at``) and the cache served all it could (pin held, or hit >= reusable):
       no TTL can fix it;
    2. ``HIT``: the pin was held and handed over, and the hit covered the reusable prefix;
    3. ``EVICTED``: the pin was held but the hit fell short (blocks gone before the pin
       took them), or no pin was held, the cache was lost and no pin outcome explains it;
    4. ``PREFIX_CACHE``: no pin held, but the ordinary prefix cache still served the
       reusable prefix (not a miss);
    5. ``NOT_PINNED`` / ``EXPIRED`` / ``RELEASED_UNDER_PRESSURE``: no pin held and the
       cache lost, because no pin was taken (``NotPinnedCause`` says why), its TTL lapsed
       (``expired_by_s``), or it was released for memory.

    ``UNSPECIFIED``: not reported (engines of earlier releases). Numbers are those of the
    proto enum ``cachettl.v1.MissReason``.

    >>> MissReason.parse("diverged"), MissReason.EXPIRED.missed, MissReason.HIT.missed
    (<MissReason.DIVERGED: 7>, True, False)
    """

    UNSPECIFIED = 0
    HIT = 1
    PREFIX_CACHE = 2
    NOT_PINNED = 3
    EXPIRED = 4
    RELEASED_UNDER_PRESSURE = 5
    EVICTED = 6
    DIVERGED = 7

    @property
    def missed(self) -> bool:
        """Whether the turn missed its previous turn's cache (a reason other than a hit)."""
        return self in MISSES


#: The reasons of a miss (the returning turn recomputed what its previous turn had).
MISSES = frozenset(
    {
        MissReason.NOT_PINNED,
        MissReason.EXPIRED,
        MissReason.RELEASED_UNDER_PRESSURE,
        MissReason.EVICTED,
        MissReason.DIVERGED,
    }
)


class NotPinnedCause(_Labelled):
    """Why no pin was taken after a turn (``MissReason.NOT_PINNED``): ``NO_TOOL``, no tool
    call was detected (counted by the engine hook only: such a turn has no tool-call
    event); ``CLIENT``, the client disabled pinning for the turn; ``TTL_ZERO``, the policy
    chose τ = 0 (or none runs); ``BUDGET``, the pinned-memory budget refused the pin."""

    UNSPECIFIED = 0
    NO_TOOL = 1
    CLIENT = 2
    TTL_ZERO = 3
    BUDGET = 4


@dataclass(frozen=True, slots=True)
class TurnCache:
    """What a returning turn found of its previous turn's cache (``MissReason``), and the
    details: how long after its pin's expiry it arrived (``expired_by_s``, seconds), the
    token where its prompt diverged (``diverged_at``, the first token of the first
    differing block), the tokens the cache served at admission (``hit_tokens``) and those
    the previous turn's cache could have served (``reusable_tokens``). ``None``: not
    observed."""

    reason: MissReason = MissReason.UNSPECIFIED
    not_pinned_cause: NotPinnedCause = NotPinnedCause.UNSPECIFIED
    expired_by_s: float | None = None
    diverged_at: int | None = None
    hit_tokens: int | None = None
    reusable_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class MissQuery:
    """Which returning turns to list: of ``tool`` and ``program`` (``None``: any), with a
    reason in ``reasons`` (default: every miss reason), the newest ``limit``."""

    tool: str | None = None
    program: str | None = None
    reasons: frozenset[MissReason] = MISSES
    limit: int = 50


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
    tool: str
    tool_args: str
    duration_s: float
    finished_at: float | None = None
    turn_index: int = 0
    chosen_ttl_s: float | None = None
    pin_outcome: PinOutcome = PinOutcome.UNSPECIFIED
    admission_delay_s: float | None = None
    cache: TurnCache = TurnCache()
    #: Shadow mode: nothing was pinned; ``chosen_ttl_s`` and ``pin_outcome`` are what the
    #: pin would have been and met (kept out of the pin statistics, learned as any call).
    shadow: bool = False


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


#: Programs whose location pin coherence keeps per tenant, in memory or in PostgreSQL (the
#: least recently arrived go first).
MAX_PROGRAM_LOCATIONS = 200_000


@dataclass(frozen=True, slots=True)
class Move:
    """A turn of ``program_id`` arrived at ``to_engine`` at ``arrived_at`` (the engine's
    clock); the program's previous turn had arrived at ``from_engine``, which is told
    (pin coherence: :mod:`controlplane.coherence`)."""

    program_id: str
    from_engine: str
    to_engine: str
    arrived_at: float


# -- rollouts: which tools a tenant's engines pin ------------------------------------------
# A platform changes an engine's scheduling gradually: first it watches (``shadow``: every
# decision made and reported, nothing pinned, vLLM's own order kept), then pins a few tools
# (``only``), or all but a few (``except``), then everything (``all``). A tool outside the
# rollout is handled as in shadow mode: the engine decides the TTL it would have pinned for
# and reports what that pin would have met (``ToolCall.shadow``), and pins nothing. The
# control plane stores a tenant's rollout (``controlplane.storage.rollouts``) and sends it in
# every snapshot; the hook applies it (``enginehook.core.rollout``) and has a setting of its
# own in the same terms.

#: Tools a rollout lists at most (it rides in every snapshot).
MAX_ROLLOUT_TOOLS = 1000
#: The longest tool name (as ``ToolCallEvent.tool_name``).
_MAX_TOOL_NAME = LIMITS.tool_name


class RolloutMode(IntEnum):
    """Which tools a rollout pins; the values are the wire's ``RolloutMode``."""

    UNSPECIFIED = 0
    ALL = 1
    ONLY = 2
    EXCEPT = 3
    SHADOW = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int) -> RolloutMode:
        """A mode by label (``all``, ``only``, ``except``, ``shadow``) or wire value."""
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str) and value.upper() in cls.__members__:
            mode = cls[value.upper()]
            if mode is not cls.UNSPECIFIED:
                return mode
        names = ", ".join(m.label for m in cls if m is not cls.UNSPECIFIED)
        raise ValueError(f"rollout: unknown mode {value!r}; valid: {names}")


@dataclass(frozen=True, slots=True)
class Rollout:
    """Which tools are pinned. ``tools``: those of ``ONLY`` / ``EXCEPT``, sorted.

    >>> Rollout.of("only", ["pytest", "bash"])
    Rollout(mode=<RolloutMode.ONLY: 2>, tools=('bash', 'pytest'))
    >>> r = Rollout.of("except", parse_tools("web_search", "--except"))
    >>> r.pins("bash"), r.pins("web_search"), r.describe()
    (True, False, 'every tool except web_search')
    >>> Rollout.of("only", [])
    Traceback (most recent call last):
    ...
    ValueError: rollout: mode 'only' needs at least one tool
    >>> parse_tools("bash,,pytest", "--only")
    Traceback (most recent call last):
    ...
    ValueError: --only: tool 2 is empty (tools are separated by commas: bash,pytest)
    """

    mode: RolloutMode = RolloutMode.ALL
    tools: tuple[str, ...] = ()

    @classmethod
    def of(cls, mode: str | int | RolloutMode, tools: Iterable[str] = ()) -> Rollout:
        """A checked rollout: ``only`` and ``except`` need tools, ``all`` and ``shadow``
        take none; each name 1..128 characters without commas or NUL."""
        kind = mode if isinstance(mode, RolloutMode) else RolloutMode.parse(mode)
        if kind is RolloutMode.UNSPECIFIED:
            raise ValueError("rollout: mode must be all, only, except or shadow")
        names = tuple(sorted(set(tools)))
        for name in names:
            _check_tool(name, "rollout")
        if kind in (RolloutMode.ONLY, RolloutMode.EXCEPT) and not names:
            raise ValueError(f"rollout: mode {kind.label!r} needs at least one tool")
        if kind in (RolloutMode.ALL, RolloutMode.SHADOW) and names:
            raise ValueError(f"rollout: mode {kind.label!r} takes no tools, got {names!r}")
        if len(names) > MAX_ROLLOUT_TOOLS:
            raise ValueError(f"rollout: at most {MAX_ROLLOUT_TOOLS} tools, got {len(names)}")
        return cls(kind, names)

    @property
    def shadow(self) -> bool:
        """No tool is pinned and vLLM's own order is kept."""
        return self.mode is RolloutMode.SHADOW

    def pins(self, tool: str) -> bool:
        """Whether a call of ``tool`` may be pinned (outside: reported as shadow)."""
        if self.mode is RolloutMode.ONLY:
            return tool in self.tools
        if self.mode is RolloutMode.EXCEPT:
            return tool not in self.tools
        return self.mode is not RolloutMode.SHADOW

    def describe(self) -> str:
        """In words, for logs and the CLI."""
        listed = ", ".join(self.tools)
        if self.mode is RolloutMode.ONLY:
            return f"only {listed}"
        if self.mode is RolloutMode.EXCEPT:
            return f"every tool except {listed}"
        if self.mode is RolloutMode.SHADOW:
            return "shadow: no tool pinned, vLLM's order kept"
        return "every tool"


def _check_tool(name: object, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool name must be a non-empty string, got {name!r}")
    if len(name) > _MAX_TOOL_NAME or "," in name or "\x00" in name:
        raise ValueError(
            f"{where}: tool name {name[:40]!r} must be at most {_MAX_TOOL_NAME} characters "
            "without commas or NUL"
        )


def parse_tools(text: str | Iterable[str], where: str) -> tuple[str, ...]:
    """Tool names from ``bash,pytest`` (or a list of names); errors name ``where``."""
    if not isinstance(text, str | list | tuple | frozenset | set):
        raise ValueError(f"{where}: a list of tool names or 'bash,pytest', got {text!r}")
    names = text.split(",") if isinstance(text, str) else list(text)
    tools = []
    for i, raw in enumerate(names, 1):
        name = raw.strip() if isinstance(raw, str) else raw
        if name == "":
            raise ValueError(
                f"{where}: tool {i} is empty (tools are separated by commas: bash,pytest)"
            )
        _check_tool(name, where)
        tools.append(name)
    return tuple(sorted(set(tools)))
