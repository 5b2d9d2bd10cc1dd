"""The hook's settings, read from ``--additional-config '{"cachettl": {...}}'``.

Every key is optional; unknown keys are an error that lists the valid ones (a typo must
not silently turn pinning off).

>>> HookConfig.from_additional({"cachettl": {"policy": "fixed", "policy_params": {"ttl_s": 1}}})
HookConfig(enabled=True, policy='fixed', policy_params={'ttl_s': 1}, ...)
>>> HookConfig.from_additional({"cachettl": {"ttl_cap": 3}})
Traceback (most recent call last):
...
ValueError: additional_config.cachettl: unknown key 'ttl_cap'; valid: ...
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from enginehook.pressure import PressureRule

__all__ = ["CONFIG_KEY", "HookConfig"]

#: The key under vLLM's ``additional_config`` that holds the hook's settings.
CONFIG_KEY = "cachettl"


@dataclass(frozen=True)
class HookConfig:
    """Settings of the engine hook.

    ``enabled``: pin and reorder at all (off: the stock scheduler's behaviour).
    ``policy`` / ``policy_params``: the estimator TTL policy and its parameters.
    ``profile``: hardware profile of the cost model used until prefill timings arrive.
    ``min_samples``: cold-start threshold K of the duration models.
    ``ttl_cap_s``: hard cap on any TTL. ``budget_fraction``: most of the KV pool pinned
    (1.0: no budget, as the simulator's ablation chose; 0.3 protects non-agent traffic).
    ``pressure``: when pins may be released for memory (``running``, ``always``, ``never``).
    ``order``: program-level ordering of the waiting queue. ``order_window_s``: a
    returning turn overtakes only requests that arrived less than this before it (0: no
    bound, the paper's order); bounds new programs' first-turn wait.
    ``tenant``: the tenant this engine's events and decisions belong to.
    ``control_plane``: ``host:port`` of the control plane (empty: none).
    ``token``: bearer token for the control plane (default: ``$CACHETTL_TOKEN``; never
    shown in the config's repr or logs). ``spill_dir``: where undelivered events
    are spilled (default: a temporary folder). ``event_log``: a JSON Lines file that
    receives every tool-call and program-end event (empty: none). ``metrics_listen``:
    ``host:port`` where the hook serves ``/metrics`` in Prometheus format (empty: off).
    """

    enabled: bool = True
    policy: str = "cachettl"
    policy_params: dict[str, Any] = field(default_factory=dict)
    profile: str = "llama3.1-8b-h100"
    min_samples: int = 100
    ttl_cap_s: float = 300.0
    budget_fraction: float = 1.0
    pressure: str = PressureRule.RUNNING.value
    order: bool = True
    order_window_s: float = 0.0
    tenant: str = "default"
    control_plane: str = ""
    token: str = field(default="", repr=False)
    spill_dir: str = ""
    event_log: str = ""
    metrics_listen: str = ""
    idle_program_s: float = 3600.0

    def __post_init__(self) -> None:
        PressureRule.parse(self.pressure)
        for name in ("ttl_cap_s", "idle_program_s", "order_window_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"additional_config.cachettl.{name} must be >= 0, got {value!r}")
        if not isinstance(self.budget_fraction, int | float) or not (
            0.0 <= self.budget_fraction <= 1.0
        ):
            raise ValueError(
                "additional_config.cachettl.budget_fraction must be in [0, 1], "
                f"got {self.budget_fraction!r}"
            )
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int):
            raise ValueError(
                "additional_config.cachettl.min_samples must be an integer, "
                f"got {self.min_samples!r}"
            )
        if not isinstance(self.policy_params, Mapping):
            raise ValueError("additional_config.cachettl.policy_params must be an object")

    @property
    def pressure_rule(self) -> PressureRule:
        """``pressure`` as a :class:`PressureRule`."""
        return PressureRule.parse(self.pressure)

    @classmethod
    def from_additional(cls, additional: Mapping[str, Any] | None) -> HookConfig:
        """Read ``additional[CONFIG_KEY]`` (missing: defaults)."""
        raw = (additional or {}).get(CONFIG_KEY) or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"additional_config.{CONFIG_KEY} must be an object, got {raw!r}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            if key not in valid:
                names = ", ".join(valid)
                raise ValueError(
                    f"additional_config.{CONFIG_KEY}: unknown key {key!r}; valid: {names}"
                )
        values = dict(raw)
        if not values.get("token"):
            values["token"] = os.environ.get("CACHETTL_TOKEN", "")
        return cls(**values)
