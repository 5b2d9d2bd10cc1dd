"""What one tenant can learn about others over the wire: versions are per tenant, and a
shared model is shown only k-anonymous, undominated and quantised (SQLite, PostgreSQL)."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.rpc.client import ControlPlaneClient, ToolCall
from controlplane.service import ControlPlane
from controlplane.sharing import SharingRules, anonymous
from controlplane.storage import Store
from tests.support import running

BOTH = pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)


def _calls(prefix: str, durations: list[float], tool: str = "secret-tool") -> list[ToolCall]:
    return [ToolCall(f"{prefix}{i}", "p", tool, "", d) for i, d in enumerate(durations)]


@BOTH
def test_versions_do_not_tell_another_tenants_volume(store: Store) -> None:
    plane = ControlPlane(store, min_samples=1)
    _, busy = plane.create_tenant("busy", share=True)
    _, quiet = plane.create_tenant("quiet", share=True)
    with (
        running(plane) as server,
        ControlPlaneClient(server.target, busy) as b,
        ControlPlaneClient(server.target, quiet) as q,
    ):
        ack = q.record_tool_calls(_calls("q", [0.5, 0.6], tool="bash"))
        assert ack.model_version == 2
        for k in range(3):  # the busy tenant ingests 300 events, program ends too
            b.record_tool_calls(_calls(f"b{k}-", [0.1 + i / 100 for i in range(100)]))
            b.record_program_end(f"prog{k}", 3)
        assert q.decide_ttl("bash").model_version == 2
        assert q.list_tools().model_version == 2
        assert q.workload_stats().model_version == 2
        assert q.record_program_end("mine", 2) is True
        assert q.decide_ttl("bash").model_version == 3
        assert b.decide_ttl("secret-tool").model_version == 303


@BOTH
def test_one_sharing_tenant_is_never_shown_to_another(store: Store) -> None:
    """The probe's case: two sharing tenants; the other's 150 durations of a tool never
    appear in a snapshot or steer a decision."""
    plane = ControlPlane(store, min_samples=10)
    _, owner = plane.create_tenant("owner", share=True)
    _, peeker = plane.create_tenant("peeker", share=True)
    durations = [0.137 + 0.0131 * i for i in range(150)]
    with (
        running(plane) as server,
        ControlPlaneClient(server.target, owner) as o,
        ControlPlaneClient(server.target, peeker) as p,
    ):
        o.record_tool_calls(_calls("o", durations))
        p.record_tool_calls(_calls("p", [1.0], tool="bash"))
        snapshot = next(p.watch_snapshots(timeout_s=10))
        assert {m.tool_name for m in snapshot.models} == {"", "bash"}
        seen = {x for m in snapshot.models for x in m.sorted_durations_seconds}
        assert not seen & set(durations)
        assert p.decide_ttl("secret-tool", reload_cost_s=2.0).basis == "cold-start"


@BOTH
def test_a_dominant_contributor_keeps_a_shared_model_unpublished(store: Store) -> None:
    plane = ControlPlane(store, min_samples=3, sharing=SharingRules(refresh_every=8))
    tokens = [plane.create_tenant(f"t{i}", share=True)[1] for i in range(5)]
    with running(plane) as server:
        clients = [ControlPlaneClient(server.target, t) for t in tokens]
        try:
            clients[0].record_tool_calls(_calls("big", [0.2 + i / 1000 for i in range(200)]))
            for i, c in enumerate(clients[1:4]):
                c.record_tool_calls(_calls(f"s{i}", [0.3, 0.4, 0.5]))
            # four contributors, but one holds 200 of 209 samples: nothing is shown
            viewer = clients[4]
            assert viewer.decide_ttl("secret-tool", reload_cost_s=2.0).basis == "cold-start"
            for i, c in enumerate(clients[1:4]):  # the others catch up: 200/100/100/100
                c.record_tool_calls(_calls(f"m{i}", [0.3 + j / 500 for j in range(97)]))
            decision = viewer.decide_ttl("secret-tool", reload_cost_s=2.0)
            assert (decision.basis, decision.model_version) == ("shared", 1)
        finally:
            for c in clients:
                c.close()


def test_the_anonymity_rule() -> None:
    rules = SharingRules()
    assert not anonymous(Counter(a=5, b=5, c=5), rules)  # a viewer among them sees two
    assert anonymous(Counter(a=5, b=5, c=5, d=5), rules)
    assert not anonymous(Counter(a=50, b=5, c=5, d=5), rules)  # a dominates
    assert anonymous(Counter(a=8, b=5, c=5, d=5), rules)
    assert not anonymous(Counter(a=8, b=8, c=1, d=1), rules)  # for c: b holds 8 of 17


@BOTH
def test_a_restart_restores_published_models_and_versions(store: Store) -> None:
    """Publications are a function of the log: a snapshot plus the tail, and a replay
    of the whole log, give the same shared models and versions."""
    rules = SharingRules(refresh_every=8)
    plane = ControlPlane(store, min_samples=3, sharing=rules)
    tenants = [plane.create_tenant(f"t{i}", share=True)[0] for i in range(5)]
    for i, tenant in enumerate(tenants[:4]):
        plane.record_tool_calls(tenant, _calls(f"a{i}", [0.2 + j / 50 for j in range(10)]))
    assert plane.write_snapshot()
    for i, tenant in enumerate(tenants[:4]):
        plane.record_tool_calls(tenant, _calls(f"b{i}", [0.3 + j / 40 for j in range(10)]))
    restored = ControlPlane(store, min_samples=3, sharing=rules)
    replayed = ControlPlane(store, min_samples=3, sharing=SharingRules(refresh_every=8, grid=0.1))
    for other in (restored, replayed):
        assert other.state.shared.publications == plane.state.shared.publications == 2
        assert [other.tenant_version(t) for t in tenants] == [
            plane.tenant_version(t) for t in tenants
        ]
    assert restored.snapshot_payload(tenants[4]) == plane.snapshot_payload(tenants[4])
    assert replayed.snapshot_payload(tenants[4]) != plane.snapshot_payload(tenants[4])
