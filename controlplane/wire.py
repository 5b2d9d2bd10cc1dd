"""Seconds on the wire: every conversion between Python seconds (``float``) and
``google.protobuf`` ``Duration`` / ``Timestamp``, in one place.

Durations and times are rounded to the nanosecond. ``duration`` refuses a value that is not
finite, naming the field, so a NaN never reaches the wire as garbage.

>>> seconds(duration(1.25))
1.25
>>> timestamp_seconds(timestamp(1700000000.5))
1700000000.5
>>> duration(float("nan"), "ttl_s")
Traceback (most recent call last):
...
ValueError: ttl_s must be finite, got nan
"""

from __future__ import annotations

import math

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

__all__ = ["duration", "seconds", "timestamp", "timestamp_seconds"]


def duration(value_s: float, field: str = "duration") -> Duration:
    """``value_s`` seconds as a ``Duration``; ``ValueError`` naming ``field`` if not finite."""
    if not math.isfinite(value_s):
        raise ValueError(f"{field} must be finite, got {value_s!r}")
    d = Duration()
    d.FromNanoseconds(round(value_s * 1e9))
    return d


def seconds(d: Duration) -> float:
    """A ``Duration`` in seconds."""
    return d.seconds + d.nanos / 1e9


def timestamp(at_s: float) -> Timestamp:
    """Seconds since the epoch as a ``Timestamp``."""
    if not math.isfinite(at_s):
        raise ValueError(f"timestamp must be finite, got {at_s!r}")
    t = Timestamp()
    t.FromNanoseconds(round(at_s * 1e9))
    return t


def timestamp_seconds(t: Timestamp) -> float:
    """A ``Timestamp`` in seconds since the epoch."""
    return t.seconds + t.nanos / 1e9
