"""Client hints carried in a request's ``vllm_xargs`` (vLLM's ``SamplingParams.extra_args``).

Keys: ``last_turn`` (bool), ``tool`` (the tool this turn calls), ``tool_args``,
``pin_ttl_s`` (override the TTL, seconds >= 0), ``pin`` (bool; 0 disables pinning for
this request). The tenant is never a request field: it is the engine's (its control-plane
credentials). vLLM turns JSON booleans into ``1``/``0`` on the way, so flags
accept 0/1, booleans and the strings ``"true"``/``"false"``/``"1"``/``"0"``.

>>> Hints.from_extra_args({"last_turn": 1, "tool": "bash", "pin_ttl_s": "2.5"})
Hints(last_turn=True, tool='bash', tool_args=None, pin_ttl_s=2.5, pin=True)
>>> Hints.from_extra_args({"pin_ttl_s": -1})
Traceback (most recent call last):
...
ValueError: vllm_xargs.pin_ttl_s must be a finite number >= 0, got -1
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Hints", "parse_flag"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_MAX_TEXT = 4096


def parse_flag(name: str, value: Any) -> bool:
    """A boolean hint as vLLM delivers it (``1``/``0``, bool, or a string)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"vllm_xargs.{name} must be a boolean (0/1, true/false), got {value!r}")


def _text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"vllm_xargs.{name} must be a string, got {value!r}")
    if len(value) > _MAX_TEXT:
        raise ValueError(f"vllm_xargs.{name} must be at most {_MAX_TEXT} characters")
    return value or None


@dataclass(frozen=True, slots=True)
class Hints:
    """What the client said about one request."""

    last_turn: bool = False
    tool: str | None = None
    tool_args: str | None = None
    pin_ttl_s: float | None = None
    pin: bool = True

    @classmethod
    def from_extra_args(cls, extra: Mapping[str, Any] | None) -> Hints:
        """Parse ``vllm_xargs``; unknown keys are ignored, bad values name the key."""
        if not extra:
            return cls()
        ttl = extra.get("pin_ttl_s")
        if ttl is not None:
            try:
                ttl = float(ttl)
            except (TypeError, ValueError):
                ttl = math.nan
            if not math.isfinite(ttl) or ttl < 0:
                raise ValueError(
                    f"vllm_xargs.pin_ttl_s must be a finite number >= 0, got {extra['pin_ttl_s']!r}"
                )
        return cls(
            last_turn=parse_flag("last_turn", extra.get("last_turn", False)),
            tool=_text("tool", extra.get("tool")),
            tool_args=_text("tool_args", extra.get("tool_args")),
            pin_ttl_s=ttl,
            pin=parse_flag("pin", extra.get("pin", True)),
        )
