"""The console's pin-outcome timeline of a tool counts real pins only: a shadow call's
outcome is what a pin would have met (docs/rollout.md), its miss reason what happened."""

from __future__ import annotations

from pathlib import Path

from controlplane.console.views import Sources, _timeline
from controlplane.records import MissReason, PinOutcome, ToolCall, TurnCache
from controlplane.service import ControlPlane
from controlplane.storage import create_store


def test_shadow_calls_count_in_miss_reasons_not_in_pin_outcomes(tmp_path: Path) -> None:
    plane = ControlPlane(create_store(f"sqlite:///{tmp_path / 'cp.sqlite3'}"), min_samples=1)
    tenant, _ = plane.create_tenant("acme")

    def call(i: int, outcome: PinOutcome, reason: MissReason, shadow: bool) -> ToolCall:
        cache = TurnCache(reason)
        return ToolCall(
            f"e{i}", f"p{i}", "bash", "ls", 1.0, 1_000.0 + i, 0, 2.0, outcome, 0.0, cache, shadow
        )

    plane.record_tool_calls(
        tenant,
        [call(i, PinOutcome.EXPIRED, MissReason.EXPIRED, False) for i in range(2)]
        + [call(i, PinOutcome.HIT, MissReason.NOT_PINNED, True) for i in range(2, 5)],
    )
    out = _timeline(Sources(plane), "acme", "bash")
    plane.store.close()
    assert out["calls"] == 5
    assert sum(out["outcomes"][PinOutcome.EXPIRED.label]) == 2
    assert sum(out["outcomes"][PinOutcome.HIT.label]) == 0  # the shadow calls' would-be hits
    assert sum(out["reasons"][MissReason.NOT_PINNED.label]) == 3
    assert sum(out["reasons"][MissReason.EXPIRED.label]) == 2
