"""Argument checks shared by the estimator: each error names the argument and the value."""

from __future__ import annotations

import math

__all__ = ["check_duration", "check_finite", "check_non_negative", "check_positive"]


def check_finite(name: str, value: float) -> float:
    """Return ``value`` as a float, or raise ``ValueError`` if it is not a finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def check_non_negative(name: str, value: float) -> float:
    """Return ``value`` as a float if it is finite and >= 0, else raise ``ValueError``."""
    number = check_finite(name, value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def check_positive(name: str, value: float) -> float:
    """Return ``value`` as a float if it is finite and > 0, else raise ``ValueError``."""
    number = check_finite(name, value)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def check_duration(name: str, value: float) -> float:
    """A duration in seconds: finite and >= 0."""
    return check_non_negative(name, value)


def check_count(name: str, value: int) -> int:
    """A non-negative integer count (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value
