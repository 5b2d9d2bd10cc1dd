"""How long a finished turn stays pinned: every limit on a TTL, applied in one order.

1. The policy decides within its own cap (``ttl_cap_s`` of an estimator policy: its search
   never looks past it), or the client's ``pin_ttl_s`` replaces the policy's TTL.
2. The client's ceiling (``pin_ttl_max_s``, the envelope's ``ttl_ceiling_s``) caps it.
3. The rules' cap (:attr:`enginehook.core.rules.SchedulingRules.ttl_cap_s`) caps that; the
   pin table applies it, whatever the decider said.

:func:`clip_ttl` is steps 2 and 3; :func:`finite_cap` is the rules' cap as the pin table and
the estimator take it (finite).

>>> clip_ttl(90.0, ceiling_s=60.0, cap_s=30.0), clip_ttl(90.0, ceiling_s=None, cap_s=120.0)
(30.0, 90.0)
>>> finite_cap(float("inf")), finite_cap(45.0)
(1000000000.0, 45.0)
"""

from __future__ import annotations

__all__ = ["NO_CAP_S", "clip_ttl", "finite_cap"]

#: "No cap" for the pin table and the estimator, which take finite caps only (~31 years).
NO_CAP_S = 1e9


def finite_cap(cap_s: float) -> float:
    """``cap_s``, at most :data:`NO_CAP_S` (so an infinite cap becomes that)."""
    return min(cap_s, NO_CAP_S)


def clip_ttl(ttl_s: float, *, ceiling_s: float | None, cap_s: float) -> float:
    """``ttl_s`` under the client's ceiling (``None``: none), then under the rules' cap."""
    if ceiling_s is not None and ttl_s > ceiling_s:
        ttl_s = ceiling_s
    return min(ttl_s, cap_s)
