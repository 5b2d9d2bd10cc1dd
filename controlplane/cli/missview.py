"""Why did returning turns miss their cache: `cachettl misses` (text or JSON, read from the
database like `cachettl tools`). The same answer on the wire is :mod:`controlplane.rpc.misses`.

Text output escapes non-printable characters (``controlplane.cli.terminal.printable``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from controlplane.cli.terminal import printable
from controlplane.inspection import MissesView, MissStats, compacted, misses
from controlplane.records import MISSES, MissQuery, MissReason, NotPinnedCause, ToolCall
from controlplane.storage import create_store

__all__ = [
    "parse_reason",
    "print_miss_stats",
    "run",
    "stats_record",
    "turn_record",
]


def parse_reason(label: str | None) -> frozenset[MissReason]:
    """The reasons ``--reason`` selects (``None``: every miss reason); the error names the
    valid ones."""
    if label is None:
        return MISSES
    valid = ", ".join(r.label for r in MissReason if r.missed)
    try:
        reason = MissReason.parse(label)
    except ValueError:
        raise ValueError(f"--reason: unknown reason {label!r}; valid: {valid}") from None
    if not reason.missed:
        raise ValueError(f"--reason: {label!r} is no miss reason; valid: {valid}")
    return frozenset({reason})


def turn_record(call: ToolCall) -> dict[str, Any]:
    """One missed turn as a JSON-ready dict (reasons by label)."""
    cache = call.cache
    return {
        "event_id": call.event_id,
        "program_id": call.program_id,
        "tool": call.tool,
        "turn_index": call.turn_index,
        "finished_at": call.finished_at,
        "duration_s": call.duration_s,
        "chosen_ttl_s": call.chosen_ttl_s,
        "reason": cache.reason.label,
        "not_pinned_cause": cache.not_pinned_cause.label,
        "expired_by_s": cache.expired_by_s,
        "diverged_at": cache.diverged_at,
        "hit_tokens": cache.hit_tokens,
        "reusable_tokens": cache.reusable_tokens,
    }


def stats_record(stats: MissStats) -> dict[str, Any]:
    return {
        "returning": stats.returning,
        "missed": stats.missed,
        "reasons": {r.label: n for r, n in stats.reasons.items()},
        "expired_by_s": {f"p{round(100 * q)}": s for q, s in stats.expired_by},
    }


def print_miss_stats(stats: MissStats, indent: str = "") -> None:
    """The summary by reason as text lines."""
    if not stats.returning:
        print(f"{indent}returning turns: none reported")
        return
    share = 100 * stats.missed / stats.returning
    print(f"{indent}returning turns {stats.returning}, missed {stats.missed} ({share:.1f}%)")
    for reason, n in stats.reasons.items():
        print(f"{indent}  {reason.label:<24} {n:>8}  {100 * n / stats.returning:>5.1f}%")
    if stats.expired_by:
        late = "  ".join(f"p{round(100 * q)}={s:.3f}s" for q, s in stats.expired_by)
        print(f"{indent}expired by  {late}")


def _detail(call: ToolCall) -> str:
    cache = call.cache
    parts = []
    if cache.not_pinned_cause is not NotPinnedCause.UNSPECIFIED:
        parts.append(f"cause {cache.not_pinned_cause.label}")
    if cache.expired_by_s is not None:
        parts.append(f"expired by {cache.expired_by_s:.3f}s (ttl {call.chosen_ttl_s or 0:.3f}s)")
    if cache.diverged_at is not None:
        parts.append(f"diverged at token {cache.diverged_at}")
    if cache.hit_tokens is not None:
        reusable = "?" if cache.reusable_tokens is None else str(cache.reusable_tokens)
        parts.append(f"hit {cache.hit_tokens}/{reusable} tokens")
    return ", ".join(parts)


def _print(view: MissesView) -> None:
    print(f"{'FINISHED (UTC)':<19} {'PROGRAM':<20} {'TURN':>5} {'TOOL':<16} {'REASON':<24} DETAIL")
    for call in view.turns:
        at = call.finished_at
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) if at is not None else "-"
        print(
            f"{when:<19} {printable(call.program_id):<20} {call.turn_index + 1:>5}"
            f" {printable(call.tool):<16} {call.cache.reason.label:<24} {_detail(call)}"
        )
    print_miss_stats(view.summary)


def run(args: argparse.Namespace, url: str) -> int:
    """`cachettl misses`: the newest missed turns of a tenant, and the summary."""
    if not 1 <= args.limit <= 1000:
        raise ValueError(f"--limit must be in 1..1000, got {args.limit}")
    query = MissQuery(args.tool, args.session, parse_reason(args.reason), args.limit)
    store = create_store(url)
    try:
        view = misses(store, args.tenant, query)
        gone = compacted(store)
    finally:
        store.close()
    if args.json:
        out = {"turns": [turn_record(c) for c in view.turns], "summary": stats_record(view.summary)}
        print(json.dumps({**out, "compacted": gone} if gone else out, indent=2))
        return 0
    _print(view)
    if gone:
        print(f"(the event log was compacted: {gone} are not counted here)")
    return 0
