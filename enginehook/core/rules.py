"""Every scheduling choice of the pin controller, its default and its help, in one place.

:class:`SchedulingRules` is what both hosts of :class:`enginehook.core.lifecycle.PinController`
run: the vLLM hook reads it from ``--additional-config`` (:class:`enginehook.config.HookConfig`
embeds it) and the simulator's policies derive their parameters from it. Victim and
ordering strategies are chosen by name from the two registries of
:mod:`enginehook.core.registries` (``VICTIMS``, ``ORDERINGS``) so that every rule the
simulator's ablation measures also runs in vLLM.

>>> rules = SchedulingRules()
>>> rules.in_force(cpu_tier=False), rules.in_force(cpu_tier=True)
((<PressureRule.RUNNING: 'running'>, 0.0), (<PressureRule.ALWAYS: 'always'>, 0.0))
>>> SchedulingRules.parse({"victim": "latest-arrival", "ttl_cap_s": "30"}).ttl_cap_s
30.0
>>> SchedulingRules(victim="newest")
Traceback (most recent call last):
...
ValueError: victim must be one of: latest-arrival, latest-expiry, ..., lowest-loss; got 'newest'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from enginehook.core.admission import INTERVAL_S
from enginehook.core.pressure import PressureRule
from enginehook.core.registries import ORDERINGS, VICTIMS
from estimator import DEFAULT_TTL_CAP_S

__all__ = ["ADMISSIONS", "SchedulingRules"]


#: Program-level admission strategies (``SchedulingRules.admission``).
ADMISSIONS = ("none", "thunderagent")


# -- the rules ----------------------------------------------------------------------------
def _check_seconds(name: str, value: Any, *, finite: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (finite and math.isinf(value)):
        bound = "a finite number >= 0" if finite else "a number >= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def _check_name(name: str, value: Any, registry: Mapping[str, Any]) -> str:
    if value not in registry:
        raise ValueError(f"{name} must be one of: {', '.join(sorted(registry))}; got {value!r}")
    return str(value)


@dataclass(frozen=True, slots=True)
class SchedulingRules:
    """The scheduling rules around the pin table (frozen; compare and hash freely).

    ``tier_pressure`` / ``tier_order_window_s`` replace ``pressure`` / ``order_window_s``
    while a CPU tier holds a copy of the KV (a released pin then costs a reload, and program
    order would mostly move the queue onto new programs); ``None`` keeps the untiered value.
    """

    pressure: PressureRule = field(
        default=PressureRule.RUNNING,
        metadata={
            "help": "when a failed allocation may release pins: running (only for running or "
            "preempted work, or an idle engine), always, never"
        },
    )
    tier_pressure: PressureRule | None = field(
        default=PressureRule.ALWAYS,
        metadata={"help": "pressure while a CPU tier is on (unset: pressure)"},
    )
    ordering: str = field(
        default="program", metadata={"help": "order of the waiting queue (ORDERINGS)"}
    )
    order_window_s: float = field(
        default=0.0,
        metadata={
            "help": "a returning turn overtakes only requests that arrived less than this "
            "before it (0: no bound, the paper's order)"
        },
    )
    tier_order_window_s: float | None = field(
        default=None,
        metadata={"help": "order_window_s while a CPU tier is on (unset: order_window_s)"},
    )
    first_turn_head_start_s: float = field(
        default=math.inf,
        metadata={
            "help": "the program ordering places a new program's first turn as if the program "
            "had arrived this much earlier (inf: before every returning turn; 0: the paper)"
        },
    )
    first_turn_reclaim: bool = field(
        default=True,
        metadata={
            "help": "under the running rule, a new program's first turn may release a priced "
            "pin once it has waited longer than the pin's expected loss (the latency the "
            "pin's program would lose); off: only running or preempted work releases pins"
        },
    )
    waiting_reclaim: bool = field(
        default=False,
        metadata={
            "help": "under the running rule, any waiting request of a program (a returning "
            "turn too, not only a new program's first turn) may release a priced pin of a "
            "program with no request waiting once it has waited longer than the pin's "
            "expected loss; for an engine behind a router that admits by its published KV "
            "usage and waiting count (vllm-router's program scheduling), where pins counted "
            "as free let a turn in that then waits and holds the router's admission; off: "
            "first_turn_reclaim alone"
        },
    )
    first_turn_over_pins: bool = field(
        default=True,
        metadata={
            "help": "the program ordering places every new program's first turn ahead of "
            "every returning turn, those holding a live pin included (only preempted work "
            "goes first; the head start then orders nothing), so a new session never waits "
            "behind pins; off: programs holding a live pin go first (the paper's order)"
        },
    )
    pins_in_kv_usage: bool = field(
        default=False,
        metadata={
            "help": "the KV usage the engine publishes (vllm:kv_cache_usage_perc, which "
            "routers admit and place by) counts pinned blocks as used, as vLLM's own count "
            "does while pins hold them; off: pinned blocks count as free, as vLLM counts "
            "cached blocks no request holds (pins yield to running work), and the pinned "
            "share is published beside it (cachettl_kv_pinned_perc)"
        },
    )
    budget_share: float = field(
        default=1.0, metadata={"help": "share of the KV pool pins may hold at once"}
    )
    ttl_cap_s: float = field(
        default=DEFAULT_TTL_CAP_S, metadata={"help": "hard cap on any TTL, seconds (inf: none)"}
    )
    victim: str = field(
        default="lowest-loss",
        metadata={"help": "which pins go first under memory pressure (VICTIMS)"},
    )
    admission: str = field(
        default="none",
        metadata={
            "help": "program-level admission: none, or thunderagent (pause and resume whole "
            "programs at tool boundaries so admitted programs' KV fits; enginehook.core.admission)"
        },
    )
    admission_interval_s: float = field(
        default=INTERVAL_S,
        metadata={"help": "period of the admission's pause/resume check, seconds"},
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "pressure", _rule_value("pressure", self.pressure))
        if self.tier_pressure is not None:
            set_(self, "tier_pressure", _rule_value("tier_pressure", self.tier_pressure))
        set_(self, "ordering", _check_name("ordering", self.ordering, ORDERINGS))
        set_(self, "victim", _check_name("victim", self.victim, VICTIMS))
        set_(self, "admission", _check_name("admission", self.admission, dict.fromkeys(ADMISSIONS)))
        interval = _check_seconds("admission_interval_s", self.admission_interval_s)
        if interval <= 0:
            raise ValueError(f"admission_interval_s must be > 0, got {interval!r}")
        set_(self, "admission_interval_s", interval)
        set_(self, "order_window_s", _check_seconds("order_window_s", self.order_window_s))
        if self.tier_order_window_s is not None:
            window = _check_seconds("tier_order_window_s", self.tier_order_window_s)
            set_(self, "tier_order_window_s", window)
        set_(self, "ttl_cap_s", _check_seconds("ttl_cap_s", self.ttl_cap_s, finite=False))
        head = _check_seconds("first_turn_head_start_s", self.first_turn_head_start_s, finite=False)
        set_(self, "first_turn_head_start_s", head)
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        share = self.budget_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise ValueError(f"budget_share must be in [0, 1], got {share!r}")
        set_(self, "budget_share", float(share))

    def in_force(self, cpu_tier: bool) -> tuple[PressureRule, float]:
        """``(pressure rule, order window s)`` with or without a CPU tier."""
        pressure, window = self.pressure, self.order_window_s
        if cpu_tier:
            if self.tier_pressure is not None:
                pressure = self.tier_pressure
            if self.tier_order_window_s is not None:
                window = self.tier_order_window_s
        return pressure, window

    def replace(self, **changes: Any) -> SchedulingRules:
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The rule names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each rule's help text."""
        return {f.name: str(f.metadata["help"]) for f in dataclasses.fields(cls)}

    @classmethod
    def parse(cls, values: Mapping[str, Any], base: SchedulingRules | None = None) -> Any:
        """``base`` (default: the defaults) with ``values`` applied; values may be text
        (``"always"``, ``"30"``, ``"inf"``, ``"none"`` for the tier rules). Unknown names
        are an error that lists the valid ones."""
        valid = cls.names()
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if key not in valid:
                raise ValueError(f"unknown scheduling rule {key!r}; valid: {', '.join(valid)}")
            changes[key] = _from_text(key, value) if isinstance(value, str) else value
        return dataclasses.replace(base or cls(), **changes)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (enums by value), e.g. for JSON."""
        out: dict[str, Any] = {}
        for name in self.names():
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, PressureRule) else value
        return out


#: The rules that are true or false.
_FLAGS = ("first_turn_reclaim", "waiting_reclaim", "first_turn_over_pins", "pins_in_kv_usage")


def _rule_value(name: str, value: Any) -> PressureRule:
    if isinstance(value, PressureRule):
        return value
    if isinstance(value, str):
        try:
            return PressureRule.parse(value)
        except ValueError:
            pass
    valid = ", ".join(r.value for r in PressureRule)
    raise ValueError(f"{name} must be one of: {valid}; got {value!r}")


def _from_text(name: str, text: str) -> Any:
    """A rule's value from its text form."""
    if name in ("tier_pressure", "tier_order_window_s") and text.strip().lower() == "none":
        return None
    if name in _FLAGS:
        flag = text.strip().lower()
        if flag in ("1", "true", "on", "yes"):
            return True
        if flag in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"{name} must be one of: 0, 1, true, false, on, off; got {text!r}")
    if name.endswith("_s") or name == "budget_share":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {text!r}") from None
    return text.strip()
