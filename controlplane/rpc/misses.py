"""Why returning turns missed their cache, on the wire: the ``ListMisses`` answer and the
summary by reason (``MissStats``) that ``GetToolDistribution`` carries."""

from __future__ import annotations

from controlplane._gen.cachettl.v1 import inspect_pb2
from controlplane.inspection import MissesView, MissStats
from controlplane.records import ToolCall
from controlplane.wire import duration, timestamp

__all__ = ["miss_stats_proto", "misses_response"]


def miss_stats_proto(stats: MissStats) -> inspect_pb2.MissStats:
    """``MissStats`` on the wire."""
    return inspect_pb2.MissStats(
        returning=stats.returning,
        missed=stats.missed,
        reasons=[
            inspect_pb2.ReasonCount(reason=int(r), count=n)  # type: ignore[arg-type]
            for r, n in stats.reasons.items()
        ],
        expired_by=[inspect_pb2.Quantile(q=q, value=duration(s)) for q, s in stats.expired_by],
    )


def _turn_proto(call: ToolCall) -> inspect_pb2.MissedTurn:
    cache = call.cache
    turn = inspect_pb2.MissedTurn(
        event_id=call.event_id,
        program_id=call.program_id,
        tool_name=call.tool,
        turn_index=call.turn_index,
        reason=int(cache.reason),  # type: ignore[arg-type]
        not_pinned_cause=int(cache.not_pinned_cause),  # type: ignore[arg-type]
        duration=duration(call.duration_s),
    )
    if call.finished_at is not None:
        turn.finished_at.CopyFrom(timestamp(call.finished_at))
    if call.chosen_ttl_s is not None:
        turn.chosen_ttl.CopyFrom(duration(call.chosen_ttl_s))
    if cache.expired_by_s is not None:
        turn.expired_by.CopyFrom(duration(cache.expired_by_s))
    if cache.diverged_at is not None:
        turn.diverged_at_token = cache.diverged_at
    if cache.hit_tokens is not None:
        turn.hit_tokens = cache.hit_tokens
    if cache.reusable_tokens is not None:
        turn.reusable_tokens = cache.reusable_tokens
    return turn


def misses_response(view: MissesView) -> inspect_pb2.ListMissesResponse:
    """The ``ListMisses`` answer."""
    return inspect_pb2.ListMissesResponse(
        turns=[_turn_proto(c) for c in view.turns], summary=miss_stats_proto(view.summary)
    )
