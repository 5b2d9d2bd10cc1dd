"""The engine side of compact snapshots, over a real server: the engine's models from a
full compact snapshot and the deltas after it decide within the stated bound of the
server's raw-duration decisions, and a delta that does not build on what the engine holds
makes it ask for a full snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.records import ToolCall
from controlplane.service import ControlPlane
from controlplane.snapshots import RESEND
from controlplane.storage import create_store
from enginehook.link.snapshot import MissedDeltaError, SnapshotData, models_from_snapshot
from enginehook.link.transport import GrpcTransport
from estimator import Level, RequestFacts, get_policy
from estimator.sketch import GRID_RATIO
from tests.support import running

TOOLS = {"bash": 0.4, "grep": 0.03, "edit": 4.0, "web": 12.0}
POLICY = get_policy("cachettl", ttl_slack=1.0, contradiction_alpha=0.0)


def _record(plane: ControlPlane, tenant, rng, n: int, prefix: str, shift: float = 1.0) -> None:
    calls = []
    for i in range(n):
        tool = list(TOOLS)[i % len(TOOLS)]
        args = ("ls", "pytest -x")[i % 2] if tool == "bash" else ""
        d = float(rng.lognormal(np.log(TOOLS[tool] * shift), 1.0))
        calls.append(ToolCall(f"{prefix}-{i}", "p", tool, args, d))
    plane.record_tool_calls(tenant, calls)


def _objective(window: np.ndarray, tau: float, benefit: float) -> float:
    return float(np.searchsorted(window, tau, side="right") / window.size * benefit - tau)


def _check_within_bound(plane: ControlPlane, tenant, snap: SnapshotData) -> int:
    engine = models_from_snapshot(snap, POLICY, tenant=tenant.name)
    checked = 0
    for tool in TOOLS:
        for args in ("ls", "pytest -x", None):
            for benefit in (0.05, 0.5, 3.0, 20.0, 100.0):
                facts = RequestFacts(
                    tool=tool,
                    tool_args=args,
                    tenant=tenant.name,
                    reload_cost_s=benefit,
                    queue_delay_s=0.0,
                )
                raw = POLICY.decide(facts, plane.state.models)
                mine = POLICY.decide(facts, engine)
                assert mine.basis == raw.basis
                chain = plane.state.models.durations.chain(
                    tool, args, tenant.name, (Level.INVOCATION, Level.TOOL, Level.TENANT)
                )
                assert chain.chosen.model is not None
                window = np.asarray(chain.chosen.model.sorted_samples())
                loss = _objective(window, raw.ttl_s, benefit) - _objective(
                    window, mine.ttl_s, benefit
                )
                assert -1e-9 <= loss <= (2 * RESEND + GRID_RATIO) * benefit + 1e-6, (
                    tool,
                    args,
                    benefit,
                )
                checked += 1
    return checked


def test_engine_decisions_from_compact_snapshots_and_deltas_stay_within_the_bound() -> None:
    rng = np.random.default_rng(11)
    plane = ControlPlane(create_store("memory://"), min_samples=50)
    tenant, token = plane.create_tenant("acme")
    _record(plane, tenant, rng, 4000, "a")
    with running(plane, watch_interval_s=0.05) as server:
        transport = GrpcTransport(server.target, token, timeout_s=10)
        try:
            stream = iter(transport.watch(0))
            first = next(stream)
            assert first.version == plane.tenant_version(tenant)
            assert all(m.quantile_sketch for m in first.models)
            assert _check_within_bound(plane, tenant, first) == 60
            # A delta (merged by the transport's follower) after the durations moved.
            _record(plane, tenant, rng, 800, "b", shift=3.0)  # durations moved
            target = plane.tenant_version(tenant)
            second = next(s for s in stream if s.version >= target)  # deltas merged on the way
            assert second.version == target
            assert {m.key for m in second.models} == {m.key for m in first.models}
            _check_within_bound(plane, tenant, second)
            del stream  # the generator's stream is cancelled when it is collected

            follower = transport._follower
            held = follower.version
            with pytest.raises(MissedDeltaError):
                follower.apply(
                    SnapshotData(
                        held + 5, [], delta=True, base_version=held + 3, lineage=follower.lineage
                    )
                )
            assert follower.lineage == 0  # asks for a full snapshot next
            _record(plane, tenant, rng, 40, "c")
            third = next(transport.watch(held))
            assert third.version == plane.tenant_version(tenant)
            assert follower.lineage != 0
            _check_within_bound(plane, tenant, third)
        finally:
            transport.close()
