"""Compact snapshots through a real server: a full snapshot once, then deltas of the
models whose summary changed, with versions that survive reconnects and replica switches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.records import ToolCall
from controlplane.rpc.client import ControlPlaneClient
from controlplane.service import ControlPlane
from controlplane.storage import create_store
from estimator.sketch import DEFAULT_POINTS

RNG = np.random.default_rng(3)


def _calls(prefix: str, tool: str, n: int, scale: float = 1.0) -> list[ToolCall]:
    return [
        ToolCall(f"{prefix}-{i}", "p", tool, "", float(RNG.lognormal(np.log(scale), 1.0)))
        for i in range(n)
    ]


def _keys(reply: Any) -> set[tuple[str, str]]:
    return {(m.level, m.tool_name) for m in reply.models}


def test_a_full_compact_snapshot_then_deltas_of_what_changed(serve: Callable[..., Any]) -> None:
    plane = ControlPlane(create_store("memory://"), min_samples=10)
    tenant, token = plane.create_tenant("acme")
    for tool in ("bash", "grep", "edit"):
        plane.record_tool_calls(tenant, _calls(tool, tool, 400))
    with (
        serve(plane, watch_interval_s=0.05) as server,
        ControlPlaneClient(server.target, token) as c,
    ):
        stream = c.watch_snapshots(compact=True, timeout_s=30)
        full = next(stream)
        assert not full.delta
        assert full.version == plane.tenant_version(tenant)
        assert _keys(full) == {
            ("all-tools", ""),
            ("tool", "bash"),
            ("tool", "grep"),
            ("tool", "edit"),
        }
        for m in full.models:
            assert m.quantile_sketch
            assert len(m.log_steps) == DEFAULT_POINTS
            assert not m.sorted_durations_seconds
            assert m.sample_count == 400 or m.level == "all-tools"
        # A few more calls of a known shape: within the resend bound, nothing is resent
        # but the version moves (header only).
        plane.record_tool_calls(tenant, _calls("more", "grep", 2))
        quiet = next(stream)
        assert quiet.delta
        assert quiet.base_version == full.version
        assert quiet.lineage == full.lineage
        assert quiet.version == full.version + 2
        assert list(quiet.models) == []
        # A tool whose durations moved: only it and the pool of all tools are resent.
        plane.record_tool_calls(tenant, _calls("slow", "edit", 300, scale=50.0))
        delta = next(stream)
        assert delta.delta
        assert delta.base_version == quiet.version
        assert _keys(delta) == {("all-tools", ""), ("tool", "edit")}
        assert delta.ByteSize() < full.ByteSize()
        # A reconnect with the version and lineage held: a delta from there (or nothing).
        plane.record_tool_calls(tenant, _calls("new", "ls", 20))
        again = next(c.watch_snapshots(delta.version, compact=True, lineage=delta.lineage))
        assert again.delta
        assert again.base_version == delta.version
        assert ("tool", "ls") in _keys(again)
        # A client without the lineage (a missed delta, another replica): a full one.
        fresh = next(c.watch_snapshots(delta.version, compact=True, lineage=12345))
        assert not fresh.delta
        assert len(fresh.models) == 5
        # An engine that does not ask for compact models gets raw windows, as before.
        old = next(c.watch_snapshots(timeout_s=30))
        assert not old.delta
        assert not any(m.quantile_sketch for m in old.models)
        assert max(len(m.sorted_durations_seconds) for m in old.models) > DEFAULT_POINTS


def test_a_replica_on_the_same_log_sends_a_full_snapshot_of_its_own_lineage(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'cp.sqlite3'}"
    a = ControlPlane(create_store(url), min_samples=10)
    tenant, token = a.create_tenant("acme")
    a.record_tool_calls(tenant, _calls("x", "bash", 300))
    b = ControlPlane(create_store(url), min_samples=10)  # a second replica: replays the log
    with (
        serve(a, watch_interval_s=0.05) as sa,
        serve(b, watch_interval_s=0.05) as sb,
        ControlPlaneClient(sa.target, token) as ca,
        ControlPlaneClient(sb.target, token) as cb,
    ):
        held = next(ca.watch_snapshots(compact=True, timeout_s=30))
        moved = next(cb.watch_snapshots(held.version, compact=True, lineage=held.lineage))
        assert not moved.delta
        assert moved.lineage != held.lineage
        assert moved.version == held.version  # equal versions: equal models on any replica
        assert [list(m.log_steps) for m in moved.models] == [list(m.log_steps) for m in held.models]
