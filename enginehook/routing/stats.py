"""What a CacheTTL replica publishes for routing, and the router's view read back from it.

:func:`replica_stats` turns the :class:`PinController` a replica's engine hook runs (and
its queue, as :class:`Queued` entries) into the routing stats ``{STATS_KEY: {...}}`` a
router reads: the live pins, KV neither used nor pinned, running and waiting requests, the
programs bound, the work the replica's own queue order puts ahead of each pinned program's
return and of a program it has never seen, its prefill rate, the step it is running and
when the stats were taken. :func:`view_of` reads them back as the
:class:`~enginehook.routing.rule.ReplicaView` the rule decides on; malformed stats raise
naming the field. Both hosts of the rule publish through here: Ray Serve replicas from
their ``record_routing_stats``, and the simulator's engines at every decision.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from enginehook.core.lifecycle import PinController
from enginehook.routing.drops import check_endpoint
from enginehook.routing.rule import STATS_KEY, PinView, ReplicaView

__all__ = ["Queued", "replica_stats", "view_of"]

#: The request id of a turn that arrives now, after every queued one of its class.
_LAST_RID = "\U0010ffff"


class Queued(NamedTuple):
    """One waiting request as its replica's host sees it: its program, its queue key (what
    the host's queue sorts by, :meth:`PinController.order_key`), its prompt tokens and the
    prefix the host holds for it besides a pin (``cached_tokens``)."""

    program_id: str | None
    key: tuple[object, ...]
    prompt_tokens: int
    cached_tokens: int = 0


def replica_stats(
    controller: PinController[Any],
    *,
    free_tokens: int,
    prefill_tokens_per_s: float,
    tokens_per_block: int,
    now: float,
    running: int = 0,
    prefilling_tokens: int = 0,
    waiting: Iterable[Queued] | None = None,
    queued_tokens: int | None = None,
    pin_endpoint: str | None = None,
    step_s: float | None = None,
) -> dict[str, Any]:
    """The routing stats a replica publishes from its pin controller (the same object the
    engine hook runs): ``{STATS_KEY: {...}}``, JSON-ready. ``free_tokens``: KV neither used
    nor pinned; ``now``: the replica's clock; ``running``: requests running;
    ``prefilling_tokens``: what their prefills have left; ``waiting``: the waiting requests
    (``None``: the host cannot see its queue; the router then counts ``queued_tokens`` as
    every turn's wait); ``queued_tokens``: defaults to the waiting prompts less their held
    prefix; ``step_s``: seconds of the step the replica is running, as it estimates it
    (``None``: not published)."""
    pins = controller.pins
    block: dict[str, Any] = {
        "pins": {p.program_id: [p.expires_at, p.blocks * tokens_per_block] for p in pins},
        "free_tokens": int(free_tokens),
        "pinned_tokens": pins.pinned_blocks * tokens_per_block,
        "running": int(running),
        "bound": controller.programs,
        "prefill_tokens_per_s": float(prefill_tokens_per_s),
        "at": float(now),
    }
    if pin_endpoint is not None:
        block["pin_endpoint"] = check_endpoint(pin_endpoint, "pin_endpoint")
    if step_s is not None:
        block["step_s"] = float(step_s)
    queue = sorted(
        ((q.key, _to_compute(controller, q, tokens_per_block)) for q in (waiting or ())),
        key=lambda kt: kt[0],
    )
    block["waiting"] = len(queue)
    total = sum(t for _, t in queue)
    block["queued_tokens"] = int(queued_tokens if queued_tokens is not None else total)
    if waiting is None:
        return {STATS_KEY: block}
    keys = [k for k, _ in queue]
    before = [int(prefilling_tokens)]  # before[i]: the work ahead of the queue's i-th turn
    for _, tokens in queue:
        before.append(before[-1] + tokens)

    def ahead(program: str | None) -> int:  # a turn of ``program`` arriving now
        return before[bisect_left(keys, controller.order_key(0, False, program, now, _LAST_RID))]

    block["ahead_tokens"] = ahead(None)
    for program, value in block["pins"].items():
        value.append(ahead(program))
    return {STATS_KEY: block}


def _to_compute(controller: PinController[Any], q: Queued, tokens_per_block: int) -> int:
    """A waiting request's prompt less the prefix held for it (its program's pin, or the
    host's ``cached_tokens``), at most all but one token (as an engine computes the last)."""
    pin = controller.pins.get(q.program_id) if q.program_id is not None else None
    held = max(pin.blocks * tokens_per_block if pin is not None else 0, q.cached_tokens)
    return q.prompt_tokens - max(0, min(held, q.prompt_tokens - 1))


def _int(replica_id: str, block: Mapping[str, Any], name: str) -> int | None:
    value = block.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"routing stats of {replica_id}: {name} must be an integer") from e


def _pins(replica_id: str, block: Mapping[str, Any]) -> dict[str, PinView]:
    pins: dict[str, PinView] = {}
    for program, value in dict(block.get("pins") or {}).items():
        try:
            expires_at, tokens, *rest = value
            if len(rest) > 1:
                raise ValueError(value)
            ahead = int(rest[0]) if rest and rest[0] is not None else None
            pins[str(program)] = PinView(float(expires_at), int(tokens), ahead)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"routing stats of {replica_id}: pins[{program!r}] must be "
                "[expires_at, tokens] or [expires_at, tokens, ahead_tokens]"
            ) from e
    return pins


def view_of(
    replica_id: str, stats: Mapping[str, Any] | None, default_prefill_tokens_per_s: float
) -> ReplicaView:
    """A replica's view from its published stats (none yet, or not CacheTTL's: an empty
    replica at the default prefill rate). Malformed stats raise naming the field."""
    block = (stats or {}).get(STATS_KEY)
    if block is None:
        return ReplicaView(replica_id, prefill_tokens_per_s=default_prefill_tokens_per_s)
    if not isinstance(block, Mapping):
        raise ValueError(f"routing stats of {replica_id}: {STATS_KEY} must be a mapping")
    free, queued, running, waiting, bound = (
        _int(replica_id, block, name) or 0
        for name in ("free_tokens", "queued_tokens", "running", "waiting", "bound")
    )
    try:
        rate = float(block.get("prefill_tokens_per_s", default_prefill_tokens_per_s))
        at = None if block.get("at") is None else float(block["at"])
        step_s = float(block.get("step_s") or 0.0)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"routing stats of {replica_id}: prefill_tokens_per_s, step_s and at must be numbers"
        ) from e
    if not step_s >= 0.0:
        raise ValueError(f"routing stats of {replica_id}: step_s must be >= 0, got {step_s}")
    endpoint = block.get("pin_endpoint")
    if endpoint is not None:
        endpoint = check_endpoint(endpoint, f"routing stats of {replica_id}: pin_endpoint")
    return ReplicaView(
        replica_id,
        free,
        queued,
        rate,
        _pins(replica_id, block),
        running,
        waiting,
        bound,
        ahead_tokens=_int(replica_id, block, "ahead_tokens"),
        at=at,
        pin_endpoint=endpoint,
        step_s=step_s,
    )
